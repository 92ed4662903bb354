"""Continuous batching of speculative rows: a waiting queue and admission on top of a `decoding.engine.Engine`.

The engine owns the rows (a fixed number of slots with per-row sampling, fixed capacity), their programs and the
envelope for each number of live rows; one engine thread drives it. Between cycles the thread brings waiting
requests into free slots (each the one whose caches share most with its prompt: the next turn of a conversation
prefills only the rest), then runs one cycle of the live rows. Each row gets its new tokens; a finished, stopped or
cancelled row frees its slot at once. A waiting request whose client goes away leaves the queue at once.

When the engine fails (a program raises), the traceback is logged once, the requests whose rows were running or
being admitted end with reason "error", and the engine takes new work on rebuilt rows: requests still waiting in
the queue stay there and run on them. Where the rows cannot be rebuilt, every waiting request ends with "error"
too, the batcher is `dead` (the server answers /health with 503) and `on_dead` is called (the server exits).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from eagle_jax.decoding import engine as engines
from eagle_jax.decoding import logprobs as lps
from eagle_jax.decoding.engine import EngineError
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import TreeConfig, envelope_name
from eagle_jax.errors import EagleError
from eagle_jax.parallel import distributed

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its limit; retry later."""


@dataclasses.dataclass(eq=False)  # one request is one object: queued twice, it is two
class Request:
    """A generation request. `on_tokens(new ids)` and `on_finish(reason)` are called from the engine thread (a
    waiting request cancelled: from the cancelling one); reason is "stop" (an eos id), "length" (its budget or the
    cache), "cancelled" or "error" (the engine failed). With `on_logprobs`, the row records its tokens' logprobs
    (`decoding.logprobs`), handed to it just before the tokens they belong to. Before each `on_tokens`,
    `on_sources(where each new id came from, the envelope's name)` (`speculative.SOURCES`, `tree.envelope_name`).
    `speculate=False`: decoded plainly (`engine.Row.plain`)."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    on_tokens: Callable[[list[int]], None]
    on_finish: Callable[[str], None]
    cancelled: bool = False
    cached: int = 0  # prompt tokens its row did not feed (its caches or the prefix cache held them)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    on_cancel: Callable[[Request], None] = dataclasses.field(default=lambda req: None, repr=False, compare=False)
    on_logprobs: Callable[[list[lps.TokenLogprobs]], None] | None = None
    speculate: bool = True
    on_sources: Callable[[list[str], str], None] = dataclasses.field(
        default=lambda sources, tree: None, repr=False, compare=False
    )
    grammar: Any = None  # a fresh `grammar.Matcher` the answer follows (None: free text)

    def cancel(self) -> None:
        """Stop generating (a client went away or a stop string was met): a waiting request leaves the queue at
        once, a running row is freed before the next cycle."""
        if not self.cancelled:
            self.cancelled = True
            self.on_cancel(self)


@dataclasses.dataclass
class Stats:
    """Counters for /metrics (read without locking: each is a single Python value)."""

    requests: int = 0
    finished: int = 0
    rejected: int = 0
    dropped: int = 0  # cancelled while waiting
    failed: int = 0  # ended by a failure of the engine
    prompt_tokens: int = 0
    kept_tokens: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    row_cycles: int = 0
    cycle_seconds: float = 0.0
    accept_histogram: collections.Counter = dataclasses.field(default_factory=collections.Counter)


@dataclasses.dataclass(frozen=True)
class Admission:
    slot: int
    request: Request


def _ignore(*_) -> None:
    pass


@dataclasses.dataclass(frozen=True)
class SlotChanges:
    """What the engine does before a cycle: rows to cancel, requests to admit. Process 0 decides; on a
    multi-host server every process carries it out, so it travels as bytes (callbacks stay with process 0)."""

    cancel: tuple[int, ...] = ()
    admit: tuple[Admission, ...] = ()

    def to_bytes(self) -> bytes:
        """The plan as JSON; the usual plan, nothing to do but the cycle, as no bytes at all."""
        if not self.cancel and not self.admit:
            return b""
        admit = [
            [
                a.slot,
                a.request.prompt,
                a.request.max_tokens,
                dataclasses.asdict(a.request.sampling),
                a.request.seed,
                a.request.on_logprobs is not None,
                a.request.speculate,
            ]
            for a in self.admit
        ]
        return json.dumps({"cancel": self.cancel, "admit": admit}, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(message: bytes) -> SlotChanges:
        if not message:
            return SlotChanges()
        doc = json.loads(message)
        admit = (
            Admission(
                slot,
                Request(
                    list(prompt),
                    max_tokens,
                    SamplingConfig(**sampling),
                    seed,
                    _ignore,
                    _ignore,
                    on_logprobs=_ignore if logprobs else None,
                    speculate=spec,
                ),
            )
            for slot, prompt, max_tokens, sampling, seed, logprobs, spec in doc["admit"]
        )
        return SlotChanges(tuple(doc["cancel"]), tuple(admit))

    @staticmethod
    def max_bytes(slots: int, capacity: int) -> int:
        """A bound on `to_bytes` of any plan (every slot admitting a prompt as long as the cache, ids < 10^7)."""
        return slots * (capacity * 8 + 256) + 64


def check_hosts(mesh: Mesh | None) -> None:
    """A server on several processes decodes on one mesh over all their devices."""
    if distributed.is_multi_host() and mesh is None:
        n, d = jax.process_count(), jax.device_count()
        raise EagleError(
            f"a server on {n} processes needs one mesh over all their {d} devices (sizes multiplying to {d})", "mesh"
        )


class Batcher:
    """A waiting queue, admission and the engine thread on top of an `Engine` of `slots` rows."""

    def __init__(
        self,
        tparams: dict,
        dparams: dict | None,
        cfg: DecodeConfig,
        envelopes: Callable[[int], TreeConfig] | None = None,
        slots: int = 8,
        capacity: int = 2048,
        chunks: Sequence[int] = engines.CHUNKS,
        max_queue: int = 64,
        mesh: Mesh | None = None,
        logprobs: int = lps.MAX_TOP,
        prefix_tokens: int | None = None,
        structured: bool = False,
    ):
        """`envelopes(n)`: the tree for n live rows (default `cfg.tree`, plain decoding unless it says otherwise);
        each request samples as it asks, and may ask for its tokens' logprobs with up to `logprobs` alternatives.
        `prefix_tokens`: the prefix cache's budget, `structured`: compile the programs of requests that follow
        grammars in the warm-up (`Engine`)."""
        check_hosts(mesh)
        cfg = dataclasses.replace(cfg, logprobs=logprobs)
        self.engine = engines.Engine(
            tparams,
            dparams,
            cfg,
            slots,
            capacity,
            chunks,
            envelopes,
            per_row=True,
            mesh=mesh,
            prefix_tokens=prefix_tokens,
            structured=structured,
        )
        self.slots, self.capacity, self.max_queue = slots, capacity, max_queue
        self.multi_host = distributed.is_multi_host()
        self.queue: collections.deque[Request] = collections.deque()
        self.claimed = 0  # requests taken from the queue for free slots, not yet admitted
        self.wake = threading.Condition()
        self.stats = Stats()
        self.running = False
        self.dead = False
        self.on_dead: Callable[[], None] = lambda: None  # called once when the engine cannot rebuild its rows
        self.thread: threading.Thread | None = None

    @property
    def cfg(self) -> DecodeConfig:
        return self.engine.cfg

    @property
    def max_prompt(self) -> int:
        return self.engine.max_prompt

    # ------------------------------------------------------------ requests

    def check(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Refuse a request that can never run (the caller turns this into a 400)."""
        if not prompt:
            raise EagleError("the prompt is empty")
        if max_tokens < 1:
            raise EagleError(f"max_tokens={max_tokens} must be >= 1")
        if len(prompt) > self.max_prompt:
            raise EagleError(
                f"the prompt has {len(prompt)} tokens; this server's cache holds {self.capacity} "
                f"({self.max_prompt} for a prompt); shorten it"
            )

    def submit(self, *reqs: Request) -> None:
        """Queue requests, all or none: QueueFull when the free slots and the queue's room cannot take them all
        (an idle server takes as many requests as it has slots before it counts the queue)."""
        for req in reqs:
            self.check(req.prompt, req.max_tokens)
        with self.wake:
            if self.dead:
                raise EngineError("the engine failed and could not rebuild its rows", dead=True)
            rows = self.engine.rows
            taken = sum(r.running and not r.owner.cancelled for r in rows) + self.claimed  # cancelled: free
            room = self.max_queue + self.slots - taken - len(self.queue)
            if len(reqs) > room:
                self.stats.rejected += len(reqs)
                raise QueueFull(f"{len(self.queue)} requests are waiting and every slot is taken")
            for req in reqs:
                req.on_cancel = self._cancelled
            self.queue.extend(reqs)
            self.stats.requests += len(reqs)
            self.wake.notify()

    def _cancelled(self, req: Request) -> None:
        """A cancelled request leaves the queue at once (it never ran: not counted as finished); a running one is
        retired before the next cycle."""
        with self.wake:
            if req in self.queue:
                self.queue.remove(req)
                self.stats.dropped += 1
                req.on_finish("cancelled")
            self.wake.notify()

    @property
    def live(self) -> int:
        return len(self.engine.live)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # ------------------------------------------------------------ programs

    def programs(self) -> list[str]:
        return self.engine.programs() + [f"broadcast {n} bytes" for n in self._message_sizes()]

    def _message_sizes(self) -> list[int]:
        """The sizes plans travel as between the processes of a multi-host server (none on one)."""
        if not self.multi_host:
            return []
        largest = distributed.message_size(SlotChanges.max_bytes(self.slots, self.capacity))
        return [distributed.MIN_MESSAGE << k for k in range((largest // distributed.MIN_MESSAGE).bit_length())]

    def warm_up(self, wait: bool = True) -> float:
        """Compile every program the loop can run (`Engine.warm_up`) and, on several processes, exchange a plan of
        each size once. Returns the seconds taken."""
        t0 = time.perf_counter()
        self.engine.warm_up(wait=False)
        for size in self._message_sizes():  # collectives: in one order on every process
            distributed.broadcast(bytes(size))
        if wait:
            self.engine.compiled.wait()
        return time.perf_counter() - t0

    # ------------------------------------------------------------ the loop

    def plan(self) -> SlotChanges:
        """Decide what happens before the next cycle: cancelled rows go, waiting requests take the free slots
        (each the one whose caches share most with its prompt). Host-only: the queue and the rows."""
        rows = self.engine.rows
        cancel = tuple(s for s, r in enumerate(rows) if r.running and r.owner.cancelled)
        free = [s for s, r in enumerate(rows) if not r.running or s in cancel]
        admit = []
        with self.wake:
            while self.queue and free:
                req = self.queue.popleft()
                self.claimed += 1
                slot = max(free, key=lambda s: engines.common_prefix(rows[s].cached, req.prompt))
                free.remove(slot)
                admit.append(Admission(slot, req))
        return SlotChanges(cancel, tuple(admit))

    def apply(self, plan: SlotChanges) -> bool:
        """Carry out a plan, run one cycle, hand out tokens. Returns False when no row was running."""
        pending = [a.request for a in plan.admit]  # claimed, not yet being admitted
        try:
            for req in self.engine.cancel(plan.cancel):
                self._finish(req, "cancelled")
            for a in plan.admit:
                req = pending.pop(0)
                wants = req.on_logprobs is not None
                try:
                    kept = self.engine.admit(
                        a.slot,
                        req.prompt,
                        req.max_tokens,
                        req.sampling,
                        req.seed,
                        owner=req,
                        logprobs=wants,
                        plain=not req.speculate,
                        grammar=req.grammar,
                    )
                finally:  # a live row now, or one the failure ends (its slot's owner): no longer claimed
                    with self.wake:
                        self.claimed = max(0, self.claimed - 1)  # (followers claim nothing)
                self.stats.prompt_tokens += len(req.prompt)
                self.stats.kept_tokens += kept
                req.cached = kept
            if not self.engine.live:
                return False
            t0 = time.perf_counter()
            steps = self.engine.cycle()
        except EngineError as exc:
            self._failed(exc, pending)
            return True
        self.stats.cycle_seconds += time.perf_counter() - t0
        self.stats.cycles += 1
        for step in steps:
            self.stats.row_cycles += 1
            self.stats.accept_histogram[max(0, len(step.tokens) - 1)] += 1
            if step.tokens:
                self.stats.generated_tokens += len(step.tokens)
                if step.logprobs is not None:
                    step.owner.on_logprobs(step.logprobs)
                step.owner.on_sources(step.sources, envelope_name(step.tree))
                step.owner.on_tokens(step.tokens)
            if step.finish:
                self._finish(step.owner, step.finish)
        return True

    def _finish(self, req: Request, reason: str) -> None:
        self.stats.finished += 1
        req.on_finish(reason)

    def _failed(self, exc: EngineError, unadmitted: list[Request]) -> None:
        """The engine failed: its rows' requests end with "error"; requests claimed but not yet admitted wait again
        (at the queue's front), unless the engine is dead: then every waiting request ends too."""
        log.error("%s", exc, exc_info=exc.__cause__)
        with self.wake:
            self.claimed = max(0, self.claimed - len(unadmitted))
            self.queue.extendleft(reversed(unadmitted))
            ended = list(exc.owners)
            if exc.dead:
                self.dead, self.running = True, False
                ended += list(self.queue)
                self.queue.clear()
        for req in ended:
            self.stats.failed += 1
            req.on_finish("error")
        if exc.dead:
            self.on_dead()

    def step(self) -> bool:
        """SlotChanges, carry it out (every process of a multi-host server does: process 0 sends it), one cycle."""
        plan = self.plan()
        if self.multi_host:
            distributed.broadcast(plan.to_bytes())
        return self.apply(plan)

    def follow(self) -> None:
        """A multi-host server's processes but the first: carry out process 0's plans until it stops."""
        while (message := distributed.broadcast(None)) is not None:
            self.apply(SlotChanges.from_bytes(message))
        self.leave()  # together with process 0's engine

    def run(self) -> None:
        """The engine loop (runs until `stop` or the engine's death; idle, it steps every half second, which keeps
        a multi-host server's other processes listening)."""
        while self.running:
            if not self.step():
                with self.wake:
                    if self.running and not self.queue:
                        self.wake.wait(timeout=0.5)
        if self.multi_host:
            distributed.broadcast(None)  # the other processes stop following
            self.leave()  # with theirs (a barrier): whatever ends this process next, they exit cleanly

    def leave(self) -> None:
        """A multi-host process's end: once its compilations are done (one still under way when the process exits
        aborts it), its distributed runtime shuts down with the other processes' (a barrier)."""
        self.engine.compiled.wait()
        jax.distributed.shutdown()

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self.run, name="eagle-jax-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        with self.wake:
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

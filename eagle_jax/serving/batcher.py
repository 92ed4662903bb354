"""Continuous batching of speculative rows: a fixed number of row slots decoded together, one cycle at a time.

One engine thread owns the device state (`speculative.SpecState` with per-row sampling controls, fixed
capacity). Between cycles it brings waiting requests into free slots with the chunked prefill of
`speculative.extend` (computed on that slot's row alone), and runs one cycle on the live rows only: their
count rounded up to a bucket (a power of two, or every slot), with the tree envelope the measured budget
chose for that many rows (`PLAIN`, plain decoding that keeps the head's context, where no tree wins), over
the attention span the live rows need. One live row among eight slots costs one row's cycle, as in the
budget's calibration. Each row gets its new tokens; a finished, stopped or cancelled row frees its slot at
once. A free slot keeps its caches: a new request sharing a prefix with what a slot last held (the next turn
of a conversation) prefills only the rest.

Every program the loop can run is compiled by `warm_up`, ahead of time on worker threads: one `extend` per chunk
size, one cycle per (bucket, span), and the program that retires rows. Nothing compiles afterwards.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from eagle_jax.decoding import programs, schedule, session, speculative
from eagle_jax.decoding.rows import RowControls
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, TreeConfig
from eagle_jax.errors import EagleError
from eagle_jax.parallel import distributed, sharding

STATIC_SAMPLING = SamplingConfig()  # unused by rows with controls; one value keeps one program per shape


class QueueFull(Exception):
    """The waiting queue is at its limit; retry later."""


@dataclasses.dataclass
class Request:
    """A generation request. `on_tokens(new ids)` and `on_finish(reason)` are called from the engine thread;
    reason is "stop" (an eos id), "length" (its budget or the cache) or "cancelled"."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    on_tokens: Callable[[list[int]], None]
    on_finish: Callable[[str], None]
    cancelled: bool = False
    submitted: float = dataclasses.field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop generating (a client went away or a stop string was met); the slot is freed before the next cycle."""
        self.cancelled = True


@dataclasses.dataclass
class Stats:
    """Counters for /metrics (read without locking: each is a single Python value)."""

    requests: int = 0
    finished: int = 0
    rejected: int = 0
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
            [a.slot, a.request.prompt, a.request.max_tokens, dataclasses.asdict(a.request.sampling), a.request.seed]
            for a in self.admit
        ]
        return json.dumps({"cancel": self.cancel, "admit": admit}, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(message: bytes) -> SlotChanges:
        if not message:
            return SlotChanges()
        doc = json.loads(message)
        admit = (
            Admission(slot, Request(list(prompt), max_tokens, SamplingConfig(**sampling), seed, _ignore, _ignore))
            for slot, prompt, max_tokens, sampling, seed in doc["admit"]
        )
        return SlotChanges(tuple(doc["cancel"]), tuple(admit))

    @staticmethod
    def max_bytes(slots: int, capacity: int) -> int:
        """A bound on `to_bytes` of any plan (every slot admitting a prompt as long as the cache, ids < 10^7)."""
        return slots * (capacity * 8 + 256) + 64


@functools.partial(jax.jit, donate_argnames=("state",))
def retire(state: speculative.SpecState, rows: jax.Array) -> speculative.SpecState:
    """Mark rows [B] bool as done (their slots become free)."""
    return dataclasses.replace(state, done=state.done | rows)


def buckets(slots: int, mesh: Mesh | None) -> tuple[int, ...]:
    """The row counts a cycle is compiled for: powers of two below `slots`, and `slots`. On a mesh that splits
    the rows over devices every cycle runs every row (gathering rows would move them between devices)."""
    if mesh is not None and sharding.data_parallelism(mesh) > 1:
        return (slots,)
    return (*(1 << k for k in range((slots - 1).bit_length()) if 1 << k < slots), slots)


def check_hosts(mesh: Mesh | None) -> None:
    """A server on several processes decodes on one mesh over all their devices."""
    if distributed.is_multi_host() and mesh is None:
        n, d = jax.process_count(), jax.device_count()
        raise EagleError(
            f"a server on {n} processes needs one mesh over all their {d} devices (sizes multiplying to {d})", "mesh"
        )


class Batcher:
    """Row slots, a waiting queue and the engine thread that decodes them."""

    def __init__(
        self,
        tparams: dict,
        dparams: dict | None,
        cfg: speculative.DecodeConfig,
        envelopes: Callable[[int], TreeConfig],
        slots: int = 8,
        capacity: int = 2048,
        chunks: Sequence[int] = session.CHUNKS,
        max_queue: int = 64,
        speculate: bool = True,
        mesh: Mesh | None = None,
    ):
        tcfg, dcfg = cfg.tcfg, cfg.dcfg
        if capacity > tcfg.rope.max_position_embeddings:
            raise EagleError(
                f"{capacity} exceeds the target's {tcfg.rope.max_position_embeddings} positions; lower it", "capacity"
            )
        self.slots, self.capacity, self.chunks, self.max_queue = slots, capacity, tuple(chunks), max_queue
        self.envelope = {n: envelopes(n) if speculate else PLAIN for n in buckets(slots, mesh)}  # rows -> tree
        if not any(t.needs_head for t in self.envelope.values()):  # no tree grows from the head: leave it out
            dparams = dcfg = None
        self.tparams, self.dparams = tparams, dparams
        # each request samples as it asks (per-row controls) and each cycle takes its envelope's tree
        self.cfg = speculative.DecodeConfig(tcfg, dcfg, PLAIN, STATIC_SAMPLING)
        self.overhead = max(t.cache_overhead for t in self.envelope.values())
        check_hosts(mesh)
        self.multi_host = distributed.is_multi_host()
        dtype = tparams["embed"].dtype

        def empty() -> speculative.SpecState:
            state = speculative.empty_state(self.cfg, slots, capacity, dtype)
            return dataclasses.replace(state, controls=RowControls.of([STATIC_SAMPLING] * slots, [0] * slots))

        if mesh is None:
            self.state = empty()
        else:  # parameters are placed by their loader; the rows' state splits over data too (made in place)
            sharding.check_mesh(mesh, tcfg, dcfg, slots)
            self.state = jax.jit(empty, out_shardings=programs.spec_state_shardings(tcfg, dcfg, mesh, per_row=True))()
        self.rows: list[Request | None] = [None] * slots
        self.shown = np.zeros(slots, np.int64)  # tokens already handed to each row's request
        self.cached: list[list[int]] = [[] for _ in range(slots)]  # what each slot's caches hold
        self.queue: collections.deque[Request] = collections.deque()
        self.claimed = 0  # requests taken from the queue for free slots, not yet admitted
        self.wake = threading.Condition()
        self.stats = Stats()
        self.running = False
        self.thread: threading.Thread | None = None
        self.compiled = programs.Precompiled()

    # ------------------------------------------------------------ requests

    @property
    def max_prompt(self) -> int:
        """The longest prompt a row can take (its cache holds the prompt, one token and a cycle's tree)."""
        return self.capacity - self.overhead - 1

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
            taken = sum(r is not None and not r.cancelled for r in self.rows) + self.claimed  # cancelled: free
            room = self.max_queue + self.slots - taken - len(self.queue)
            if len(reqs) > room:
                self.stats.rejected += len(reqs)
                raise QueueFull(f"{len(self.queue)} requests are waiting and every slot is taken")
            self.queue.extend(reqs)
            self.stats.requests += len(reqs)
            self.wake.notify()

    @property
    def live(self) -> int:
        return sum(r is not None for r in self.rows)

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # ------------------------------------------------------------ programs

    def programs(self) -> list[str]:
        spans = schedule.all_spans(self.capacity)
        cycles = [f"cycle {t} rows {n} span {s}" for n, t in self.envelope.items() for s in spans]
        names = [f"extend {c}" for c in self.chunks] + cycles
        return names + ["retire"] + [f"broadcast {n} bytes" for n in self._message_sizes()]

    def _message_sizes(self) -> list[int]:
        """The sizes plans travel as between the processes of a multi-host server (none on one)."""
        if not self.multi_host:
            return []
        largest = distributed.message_size(SlotChanges.max_bytes(self.slots, self.capacity))
        return [distributed.MIN_MESSAGE << k for k in range((largest // distributed.MIN_MESSAGE).bit_length())]

    def warm_up(self, wait: bool = True) -> float:
        """Compile every program the loop can run, ahead of time on worker threads (nothing runs); with `wait`,
        until all are compiled (else a cycle waits for its own). Returns the seconds taken."""
        t0 = time.perf_counter()
        for size in self.chunks:
            piece = session.Piece(0, np.ones(size, np.int32), np.ones(size, np.int32), size, True)
            args = self._feed_args(0, piece, 1, RowControls.of([STATIC_SAMPLING], [0]))
            self.compiled.submit(f"extend {size}", speculative.extend, *args, cfg=self.cfg)
        for n, tree in self.envelope.items():
            for span in schedule.all_spans(self.capacity):
                name, args, static = self._cycle_call(tree, span, list(range(n)))
                self.compiled.submit(name, speculative.cycle, *args, **static)
        self.compiled.submit("retire", retire, self.state, np.zeros(self.slots, bool))
        self._outputs()
        for size in self._message_sizes():  # collectives: in one order on every process
            distributed.broadcast(bytes(size))
        if wait:
            self.compiled.wait()
        return time.perf_counter() - t0

    def _feed_args(self, slot: int, piece: session.Piece, limit: int, controls: RowControls) -> tuple:
        """`speculative.extend`'s arguments that feed a piece of a prompt into one slot's row (`controls`: its)."""
        start, n, limits, rows = (np.asarray([x], np.int32) for x in (piece.start, piece.n, limit, slot))
        fed = (start, piece.tokens[None], piece.follow[None], n, np.asarray([piece.final]), limits)
        return (self.tparams, self.dparams, self.state, *fed, jax.random.key(0), controls, rows)

    def bucket(self, live: int) -> int:
        """The rows a cycle computes for `live` live rows."""
        return min(b for b in self.envelope if b >= live)

    def _cycle_call(self, tree: TreeConfig, span: int, live: list[int]) -> tuple[str, tuple, dict]:
        """(name, arguments, static arguments) of `speculative.cycle` on the live rows, padded with idle ones to a
        bucket (every slot: the whole state)."""
        n = self.bucket(len(live))
        idle = [s for s in range(self.slots) if s not in live]
        rows = None if n == self.slots else np.asarray(sorted(live + idle[: n - len(live)]), np.int32)
        static = {"cfg": dataclasses.replace(self.cfg, tree=tree), "span": span}
        return f"cycle {tree} rows {n} span {span}", (self.tparams, self.dparams, self.state, rows), static

    def _cycle(self, tree: TreeConfig, span: int, live: list[int]) -> speculative.SpecState:
        name, args, static = self._cycle_call(tree, span, live)
        return self.compiled(name, speculative.cycle, *args, **static)[0]

    # ------------------------------------------------------------ the loop

    def _admit(self, req: Request, slot: int) -> None:
        """Prefill a request into a free slot (keeping what the slot's caches share with its prompt)."""
        keep = session.reusable(self.cached[slot], req.prompt)
        limit = min(req.max_tokens, self.capacity - self.overhead - len(req.prompt))
        controls = RowControls.of([req.sampling], [req.seed])
        for piece in session.pieces(req.prompt, keep, self.chunks):
            args = self._feed_args(slot, piece, limit, controls)
            self.state = self.compiled(f"extend {piece.tokens.shape[0]}", speculative.extend, *args, cfg=self.cfg)
        self.rows[slot], self.shown[slot], self.cached[slot] = req, 0, list(req.prompt)
        self.stats.prompt_tokens += len(req.prompt)
        self.stats.kept_tokens += keep

    def _finish(self, slot: int, reason: str) -> None:
        req = self.rows[slot]
        self.rows[slot] = None
        self.stats.finished += 1
        req.on_finish(reason)

    def plan(self) -> SlotChanges:
        """Decide what happens before the next cycle: cancelled rows go, waiting requests take the free slots
        (each the one whose caches share most with its prompt). Host-only: the queue and the rows."""
        cancel = tuple(s for s, r in enumerate(self.rows) if r is not None and r.cancelled)
        free = [s for s, r in enumerate(self.rows) if r is None or s in cancel]
        admit = []
        while self.queue and free:
            with self.wake:
                req = self.queue.popleft()
                self.claimed += not req.cancelled
            if req.cancelled:
                req.on_finish("cancelled")
                continue
            slot = max(free, key=lambda s: session.common_prefix(self.cached[s], req.prompt))
            free.remove(slot)
            admit.append(Admission(slot, req))
        return SlotChanges(cancel, tuple(admit))

    def apply(self, plan: SlotChanges) -> bool:
        """Carry out a plan, run one cycle, hand out tokens. Returns False when no row was running."""
        if plan.cancel:
            self.state = self.compiled("retire", retire, self.state, np.isin(np.arange(self.slots), plan.cancel))
            for slot in plan.cancel:
                self._finish(slot, "cancelled")
        for a in plan.admit:
            self._admit(a.request, a.slot)
            with self.wake:
                self.claimed = max(0, self.claimed - 1)  # now a live row (followers claim nothing)
        live = [s for s, r in enumerate(self.rows) if r is not None]
        if not live:
            return False
        tree = self.envelope[self.bucket(len(live))]
        needed = speculative.host_slots_needed(self.state, tree)
        span = schedule.attention_span(int(needed[live].max()), self.capacity)
        t0 = time.perf_counter()
        self.state = self._cycle(tree, span, live)
        counts, done, eos, out = self._outputs()
        self.stats.cycle_seconds += time.perf_counter() - t0
        self.stats.cycles += 1
        for slot in live:
            req = self.rows[slot]
            new = out[slot, self.shown[slot] : counts[slot]].tolist()
            self.stats.row_cycles += 1
            self.stats.accept_histogram[max(0, len(new) - 1)] += 1
            if new:
                self.shown[slot] = counts[slot]
                self.cached[slot] += new
                self.stats.generated_tokens += len(new)
                req.on_tokens(new)
            if done[slot]:
                self._finish(slot, "stop" if eos[slot] else "length")
        return True

    def _outputs(self) -> tuple[np.ndarray, ...]:
        s = self.state
        return distributed.host_value((s.counts, s.done, s.eos, s.out))

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
        jax.distributed.shutdown()  # together with process 0's engine

    def run(self) -> None:
        """The engine loop (runs until `stop`; idle, it steps every half second, which keeps a multi-host
        server's other processes listening)."""
        while self.running:
            if not self.step():
                with self.wake:
                    if self.running and not self.queue:
                        self.wake.wait(timeout=0.5)
        if self.multi_host:
            distributed.broadcast(None)  # the other processes stop following
            jax.distributed.shutdown()  # with theirs (a barrier): whatever ends this process next, they exit cleanly

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

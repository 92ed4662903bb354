"""A conversation kept on device: its caches live across turns, new tokens are prefilled in fixed chunks.

A `Session` holds one row's target (and draft) KV caches at a fixed capacity. Each turn gets the whole
conversation's token ids; the session keeps the longest prefix its caches already hold (the earlier
turns, the answers it generated) and prefills only the rest, in chunks of a few fixed sizes. So the
programs it runs do not depend on the conversation: one `extend` program per chunk size, and per attention span
of `schedule.all_spans` one cycle (an answer streams cycle by cycle), or for plain decoding one loop of cycles.
`warm_up` compiles exactly that set ahead of time, on worker threads (`programs.Precompiled`: nothing runs, and
a turn waits only for the programs it needs); afterwards no prompt length or number of turns compiles anything.

Output equals decoding the conversation from scratch (`speculative.generate` with the same tree and
seed): the caches hold the same tokens at the same positions, and each turn samples with the
same keys.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from eagle_jax.decoding import programs, schedule, speculative
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.errors import EagleError
from eagle_jax.parallel import sharding

CHUNKS = (256, 32)  # prefill chunk sizes: long prompts in large chunks, a turn's few new tokens in a small one


def chunk_plan(length: int, chunks: Sequence[int] = CHUNKS) -> list[int]:
    """Chunk sizes that cover `length` new tokens: the largest size that the rest fills, else the smallest
    size that holds it."""
    sizes = sorted(chunks, reverse=True)
    plan, left = [], length
    while left > 0:
        size = next((s for s in sizes if s <= left), None) or min(s for s in sizes if s >= left)
        plan.append(size)
        left -= size
    return plan


@dataclasses.dataclass(frozen=True)
class Piece:
    """One chunk of a prompt to feed: tokens [C] (valid up to n), the token after each (the draft's pairs),
    where it starts in the cache, and whether it is the prompt's last chunk."""

    start: int
    tokens: np.ndarray  # [C] int32
    follow: np.ndarray  # [C] int32
    n: int
    final: bool


def pieces(prompt: Sequence[int], keep: int, chunks: Sequence[int] = CHUNKS) -> list[Piece]:
    """prompt[keep:] cut into chunks (`chunk_plan`), padded to their sizes."""
    prompt = list(prompt)
    out, pos = [], keep
    for size in chunk_plan(len(prompt) - keep, chunks):
        piece = prompt[pos : pos + size]
        after = prompt[pos + 1 : pos + len(piece) + 1]  # the token after each (the root closes the last)
        tokens, follow = np.zeros(size, np.int32), np.zeros(size, np.int32)
        tokens[: len(piece)], follow[: len(after)] = piece, after
        out.append(Piece(pos, tokens, follow, len(piece), pos + size >= len(prompt)))
        pos += size
    return out


def reusable(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens of `prompt` caches holding `cached` can keep: the common prefix less one
    (the last kept pair must be read again), and at least one prompt token is fed."""
    return max(0, min(common_prefix(cached, prompt) - 1, len(prompt) - 1))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if differs.size else n


@dataclasses.dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens already in the caches
    prefill_s: float
    decode_s: float
    tokens: list[int]  # the answer
    accept_lengths: list[int]  # per cycle (all 0 for plain decoding)


class Session:
    """One conversation (one row) on one device, decoded as `cfg` says (its tree `PLAIN`: plain decoding)."""

    def __init__(
        self,
        tparams: dict,
        dparams: dict | None,
        cfg: DecodeConfig,
        capacity: int = 4096,
        chunks: Sequence[int] = CHUNKS,
        mesh: Mesh | None = None,
    ):
        if cfg.tree.needs_head and dparams is None:
            raise EagleError(f"the tree {cfg.tree} grows from a draft head: give one, or a tree with no head's part")
        target_capacity = cfg.tcfg.rope.max_position_embeddings
        if capacity > target_capacity:
            raise EagleError(f"capacity {capacity} exceeds the target's {target_capacity} positions; lower it")
        self.cfg, self.dparams = speculative.head_for(cfg, dparams)
        self.tparams, self.capacity, self.chunks = tparams, capacity, tuple(chunks)
        self.state = speculative.empty_state(self.cfg, 1, capacity, tparams["embed"].dtype)
        if mesh is not None:  # the caches split over `tensor` like the parameters; one row: no data axis
            if sharding.data_parallelism(mesh) > 1:
                raise EagleError("a conversation is one row: use a mesh with data=1 and fsdp=1 (e.g. tensor=N)")
            layout = programs.spec_state_shardings(self.cfg.tcfg, self.cfg.dcfg, mesh)
            self.state = jax.device_put(self.state, layout)
        self._key = jax.random.key(0)
        self.compiled = programs.Precompiled()
        self.cached: list[int] = []  # token ids the caches hold (positions 0..), the last answer included
        self.turns = 0

    @property
    def spans(self) -> list[int]:
        return schedule.all_spans(self.capacity)

    def programs(self) -> list[str]:
        """The compiled set: one prefill program per chunk size, one cycle (plain decoding: one loop) per span."""
        return [f"extend {c}" for c in self.chunks] + [self._loop(s)[0] for s in self.spans]

    def warm_up(self, wait: bool = True, first: int | None = None) -> float:
        """Compile the programs this session can run (the `first` few of them, in the order a conversation needs
        them: the smallest chunk and span first), ahead of time on worker threads; with `wait`, until they are
        compiled. Returns the seconds taken."""
        t0 = time.perf_counter()
        feeds = [Piece(0, np.ones(c, np.int32), np.ones(c, np.int32), c, True) for c in sorted(self.chunks)]
        extends = [(f"extend {p.n}", speculative.extend, self._feed(p, 1, self._key), {}) for p in feeds]
        state = (self.tparams, self.dparams, self.state)
        loops = [(*self._loop(span), state, {"span": span}) for span in self.spans]
        order = [extends[0], loops[0], *extends[1:], *loops[1:]]
        for name, fn, args, static in order[:first]:
            self.compiled.submit(name, fn, *args, cfg=self.cfg, **static)
        if wait:
            self.compiled.wait()
        return time.perf_counter() - t0

    def _feed(self, piece: Piece, limit: int, key: jax.Array) -> tuple:
        """`speculative.extend`'s arguments that feed one piece of a prompt."""
        start, n, limits = (np.array([x], np.int32) for x in (piece.start, piece.n, limit))
        rest = (piece.tokens[None], piece.follow[None], n, np.array([piece.final]), limits, key)
        return (self.tparams, self.dparams, self.state, start, *rest)

    def _extend(self, prompt: list[int], keep: int, limit: int, key: jax.Array) -> None:
        """Cut the caches to `keep` tokens and feed prompt[keep:] in chunks; the last chunk starts the turn."""
        for piece in pieces(prompt, keep, self.chunks):
            name = f"extend {piece.tokens.shape[0]}"
            self.state = self.compiled(name, speculative.extend, *self._feed(piece, limit, key), cfg=self.cfg)

    def _loop(self, span: int) -> tuple[str, Callable]:
        """The program that cycles attending over `span` slots: one cycle, so that a speculative answer streams
        cycle by cycle; for plain decoding as many as the span holds, in one on-device loop (a host round trip per
        token costs a small model as much as its step: `results/one_path/README.md`, chat)."""
        if self.cfg.tree.drafts:
            return f"cycle span {span}", speculative.cycle
        return f"decode loop span {span}", speculative.run_span

    def _cycle(self, span: int) -> speculative.SpecState:
        name, fn = self._loop(span)
        out = self.compiled(name, fn, self.tparams, self.dparams, self.state, cfg=self.cfg, span=span)
        return out[0] if self.cfg.tree.drafts else out

    def reply(self, prompt: Sequence[int], max_new_tokens: int, seed: int = 0) -> Iterator[list[int]]:
        """Answer the conversation `prompt` (all its token ids so far): yields new tokens as they are
        accepted; `last` then holds the turn's figures. The caches keep the prompt and the answer."""
        prompt = list(prompt)
        plan = schedule.plan([len(prompt)], max_new_tokens, self.cfg.tree.cache_overhead, self.capacity)
        keep = reusable(self.cached, prompt)
        self._key = jax.random.key(seed)
        t0 = time.perf_counter()
        self._extend(prompt, keep, plan.limits[0], self._key)
        jax.block_until_ready(self.state)
        t1 = time.perf_counter()
        shown, done = 0, False
        while not done:  # whole arrays come to the host: indexing on device would compile small programs
            span = schedule.attention_span(
                int(speculative.host_slots_needed(self.state, self.cfg.tree)[0]), self.capacity
            )
            self.state = self._cycle(span)
            counts, finished, out = jax.device_get((self.state.counts, self.state.done, self.state.out))
            done = bool(finished[0])
            if counts[0] > shown:
                yield out[0, shown : counts[0]].tolist()
                shown = int(counts[0])
        tokens = out[0, :shown].tolist()
        accepts = [int(a) for a in jax.device_get(self.state.accept_lengths)[:, 0] if a >= 0]
        self.cached = prompt + tokens
        self.turns += 1
        self.last = TurnStats(len(prompt), keep, t1 - t0, time.perf_counter() - t1, tokens, accepts)

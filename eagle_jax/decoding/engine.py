"""The engine: device rows, the programs that step them, and what lives beside each row on the host.

An `Engine` owns a `speculative.SpecState` of `slots` rows at a fixed cache capacity (laid out on a mesh when one
is given), the compiled program set and its one warm-up (`programs.Precompiled`: one `extend` per prefill chunk
size, one cycle per (bucket of live rows, attention span), and `retire`), the envelope (tree) for each number of
live rows, and a `Row` beside each device row: whom it serves, the tokens its caches hold, the tokens already
handed out. Its operations: `admit` a prompt into a row (an extend of the row that keeps what its caches already
share with the prompt, or the longest prefix the prefix cache holds, `decoding.prefix`), `cycle` the live rows
(plain decoding is the cycle with `tree.PLAIN`), `cancel` rows. A row offers its prompt to the prefix cache once
fed, and all its tokens when it ends (copied out before the engine's next operation).
The chat session, the server's batcher, one-shot and streamed generation (`generation`), the benchmark's runner and
the budget's measurement drive one; none runs a program itself.

A row may follow a grammar (`grammar.Matcher`, on the host beside the row): its root is drawn under the grammar's
mask, and each cycle runs as two programs, `speculative.cycle_draft` then `speculative.cycle_verify`, with the
masks of every tree node computed on the host in between (a plain step's single mask is known before its cycle:
one program). Chains the grammar forces are drafted as the context candidates of the row; the head drafts its
first level among the tokens the grammar allows after the root.

Sampling is per row (`per_row`: each admitted row's settings and seed as arrays, `decoding.rows`), or the static
rule of the settings with the key of the seed rows are admitted with (`admit_many` feeds them side by side, so a
batch draws as one: what `generation.generate` does).

A failure is never silent: when a program raises (compiling or running), the state it was given is gone (its
buffers are donated), so the engine rebuilds fresh empty rows and raises `EngineError` with the owners of the rows
that were running or being admitted: each caller ends those with the error. Rows that were free are free again
(their caches forgotten). When the rebuild fails too, the engine is `dead` and every later operation raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from eagle_jax.decoding import grammar as grammars
from eagle_jax.decoding import logprobs as lps
from eagle_jax.decoding import prefix, programs, schedule, speculative
from eagle_jax.decoding.emit import PAD_ID
from eagle_jax.decoding.rows import RowControls
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig, SpecState
from eagle_jax.decoding.tree import PLAIN, Tree, TreeConfig
from eagle_jax.errors import EagleError
from eagle_jax.parallel import distributed, sharding

CHUNKS = (256, 128, 32)  # prefill chunk sizes: long prompts in large chunks, a turn's few new tokens in a small one
CALL_COST = 32  # a call's fixed cost (reading every weight), in the positions it could compute instead
STATIC_SAMPLING = SamplingConfig()  # the static rule of rows with per-row controls: one value, one program per shape


def chunk_plan(length: int, chunks: Sequence[int] = CHUNKS) -> list[int]:
    """Chunk sizes, largest first, that cover `length` new tokens at the least cost: the positions they compute
    (padding included) and `CALL_COST` for each call. Whole largest chunks cover all but the last of them."""
    largest = max(chunks)
    whole, rest = divmod(length, largest)
    best: list[tuple[int, list[int]]] = [(0, [])]  # [rest + 1] (cost, plan) covering n tokens
    for n in range(1, rest + 1):
        best.append(min((best[max(0, n - s)][0] + CALL_COST + s, [s, *best[max(0, n - s)][1]]) for s in chunks))
    return [largest] * whole + sorted(best[rest][1], reverse=True)


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


@functools.partial(jax.jit, donate_argnames=("state",))
def retire(state: SpecState, rows: jax.Array) -> SpecState:
    """Mark rows [B] bool as done (their slots become free)."""
    return dataclasses.replace(state, done=state.done | rows)


def buckets(slots: int, mesh: Mesh | None) -> tuple[int, ...]:
    """The row counts a cycle is compiled for: powers of two below `slots`, and `slots`. On a mesh that splits
    the rows over devices every cycle runs every row (gathering rows would move them between devices)."""
    if mesh is not None and sharding.data_parallelism(mesh) > 1:
        return (slots,)
    return (*(1 << k for k in range((slots - 1).bit_length()) if 1 << k < slots), slots)


@dataclasses.dataclass
class Row:
    """The host's side of one device row: whom it serves while it runs, what its caches hold, and the grammar its
    answer follows (None: free text), after the tokens committed and the root. Later per-row state (a stop rule)
    belongs here."""

    owner: Any = None  # the caller's handle of the answer being generated (None: the row is free)
    running: bool = False
    cached: list[int] = dataclasses.field(default_factory=list)  # token ids the caches hold (positions 0..)
    shown: int = 0  # tokens of the current answer already handed out
    logprobs: bool = False  # the current answer records its tokens' logprobs
    plain: bool = False  # decoded without speculation: while it runs, every live row's cycles use `tree.PLAIN`
    grammar: grammars.Matcher | None = None


@dataclasses.dataclass(frozen=True)
class Step:
    """One live row's outcome of a cycle: its new tokens, and why it ended (None: it goes on)."""

    slot: int
    owner: Any
    tokens: list[int]
    finish: str | None  # "stop" (an eos id) or "length" (its budget or the cache)
    logprobs: list[lps.TokenLogprobs] | None = None  # one per new token, for a row admitted with `logprobs`
    sources: list[str] = dataclasses.field(default_factory=list)  # where each token came from (`SOURCES`)
    tree: TreeConfig = PLAIN  # the envelope the cycle ran with


class EngineError(EagleError):
    """A program of the engine failed; `owners` are the rows' owners that end with this error. The engine rebuilt
    its rows (unless `dead`: then it could not, and takes no more work)."""

    def __init__(self, message: str, owners: Sequence[Any] = (), dead: bool = False):
        super().__init__(message)
        self.owners, self.dead = tuple(owners), dead


def failure(exc: Exception) -> str:
    """An exception in a line: its class and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


@contextlib.contextmanager
def failing(owners: Sequence[Any] = ()) -> Iterator[None]:
    """Programs run (or compile) inside: an exception they raise comes out as `EngineError` for `owners` (the
    settings' own errors, `EagleError`, as they are)."""
    try:
        yield
    except EagleError:
        raise
    except Exception as exc:
        raise EngineError(f"the engine failed ({failure(exc)})", owners) from exc


class Engine:
    """Device rows, their programs and their host state: admit, cycle, cancel (module docstring)."""

    def __init__(
        self,
        tparams: dict,
        dparams: dict | None,
        cfg: DecodeConfig,
        slots: int = 1,
        capacity: int = 4096,
        chunks: Sequence[int] = CHUNKS,
        envelopes: Callable[[int], TreeConfig] | None = None,
        per_row: bool = False,
        loop: bool = False,
        mesh: Mesh | None = None,
        prefix_tokens: int | None = None,
        structured: bool = False,
    ):
        """`envelopes(n)`: the tree for n live rows (default `cfg.tree` for every n). `loop`: cycles of every row
        run as one on-device loop per attention span (no host round trip per token) instead of one at a time.
        `structured`: rows may follow grammars, and the warm-up compiles their programs too (after the others).
        `prefix_tokens`: None, a row keeps what its own caches share with its next prompt; 0, every prompt is fed
        whole; N, also a prefix cache across rows of up to N positions (`decoding.prefix`; one device)."""
        tcfg = cfg.tcfg
        # the static rule draws over the whole batch with one key: its cycles compute every row
        counts = buckets(slots, mesh) if per_row else (slots,)
        self.envelope = {n: envelopes(n) if envelopes else cfg.tree for n in counts}  # rows -> tree
        head = any(t.needs_head for t in self.envelope.values())  # no tree grows from the head: leave it out
        if head and dparams is None:
            tree = next(t for t in self.envelope.values() if t.needs_head)
            raise EagleError(f"the tree {tree} grows from a draft head: give one, or a tree with no head's part")
        if capacity > tcfg.rope.max_position_embeddings:
            raise EagleError(
                f"{capacity} exceeds the target's {tcfg.rope.max_position_embeddings} positions; lower it", "capacity"
            )
        dcfg = cfg.dcfg if head else None
        if mesh is None:  # host arrays (a loader's numpy) would be copied to the device by every program call
            tparams, dparams = jax.device_put((tparams, dparams))
        self.tparams, self.dparams = tparams, dparams if head else None
        sampling = STATIC_SAMPLING if per_row else cfg.sampling
        self.cfg = DecodeConfig(tcfg, dcfg, PLAIN, sampling, cfg.logprobs)  # what `extend` runs with (no tree)
        self.settings = {n: dataclasses.replace(self.cfg, tree=t) for n, t in self.envelope.items()}
        self.slots, self.capacity = slots, capacity
        self.chunks = tuple(c for c in chunks if c <= capacity) or (min(chunks),)  # none longer than the cache
        self.per_row, self.loop, self.mesh, self.structured = per_row, loop, mesh, structured
        self.overhead = max(t.cache_overhead for t in self.envelope.values())
        if mesh is not None:
            sharding.check_mesh(mesh, tcfg, dcfg, slots)
        self.compiled = programs.Precompiled()
        self.dead = False
        self.last_tree: Tree | None = None  # the last cycle's tree (None after a loop of cycles)
        self.rows = [Row() for _ in range(slots)]
        self.state = self._empty()
        if prefix_tokens and mesh is not None:
            raise EagleError("the prefix cache runs on one device; give 0 on a mesh", "prefix_tokens")
        self.keep_rows = prefix_tokens != 0
        self.index = prefix.Index(prefix.blocks_for(prefix_tokens)) if prefix_tokens else None
        self.pool = prefix.empty_pool(self.state, self.index.blocks) if self.index else None
        self.unoffered: list[tuple[int, list[int]]] = []  # rows' (slot, tokens) the prefix cache has not taken yet

    def _empty(self) -> SpecState:
        """Every row empty and done (what `extend` feeds prompts into), laid out as the programs take it."""
        dtype, slots, per_row = self.tparams["embed"].dtype, self.slots, self.per_row

        def empty() -> SpecState:
            state = speculative.empty_state(self.cfg, slots, self.capacity, dtype)
            controls = RowControls.of([STATIC_SAMPLING] * slots, [0] * slots) if per_row else None
            return dataclasses.replace(state, controls=controls)

        if self.mesh is None:
            return empty()
        layout = programs.spec_state_shardings(self.cfg.tcfg, self.cfg.dcfg, self.mesh, per_row, self.cfg.logprobs)
        return jax.jit(empty, out_shardings=layout)()  # made in place: rows split over data

    # ------------------------------------------------------------ rows

    @property
    def max_prompt(self) -> int:
        """The longest prompt a row can take (its cache holds the prompt, one token and a cycle's tree)."""
        return self.capacity - self.overhead - 1

    @property
    def live(self) -> list[int]:
        """The slots of running rows."""
        return [s for s, r in enumerate(self.rows) if r.running]

    def bucket(self, live: int) -> int:
        """The rows a cycle computes for `live` live rows."""
        return min(b for b in self.envelope if b >= live)

    def accept_lengths(self, slot: int) -> list[int]:
        """Accepted drafts per cycle of a row's current (or last) answer."""
        return [int(a) for a in distributed.host_value(self.state.accept_lengths)[:, slot] if a >= 0]

    # ------------------------------------------------------------ programs

    @property
    def spans(self) -> list[int]:
        return schedule.all_spans(self.capacity)

    def _looped(self, rows: int) -> bool:
        """Whether a cycle of `rows` live rows runs as an on-device loop (every slot, `loop`)."""
        return self.loop and rows == self.slots

    def tree(self, live: Sequence[int]) -> TreeConfig:
        """The envelope a cycle of the live rows runs with: their number's, or `tree.PLAIN` while a plain row runs."""
        return PLAIN if any(self.rows[s].plain for s in live) else self.envelope[self.bucket(len(live))]

    def _cycle_call(self, span: int, live: Sequence[int], plain: bool = False) -> tuple[str, Any, tuple, dict]:
        """(name, function, arguments, static arguments) of the program that cycles the live rows (`plain`: with
        `tree.PLAIN`), padded with idle ones to a bucket (every slot: the whole state, no row indices)."""
        n = self.bucket(len(live))
        cfg, state = self.cfg if plain else self.settings[n], (self.tparams, self.dparams, self.state)
        static = {"cfg": cfg, "span": span}
        if self._looped(n):
            return f"decode loop span {span}", speculative.run_span, state, static
        rows = self._rows_of(live)
        return f"cycle {cfg.tree} rows {n} span {span}", speculative.cycle, (*state, rows), static

    def _rows_of(self, live: Sequence[int]) -> np.ndarray | None:
        """The rows a cycle of the live ones computes (None: every slot): live, padded with idle ones to a bucket."""
        n = self.bucket(len(live))
        idle = [s for s in range(self.slots) if s not in live]
        return None if n == self.slots else np.asarray(sorted([*live, *idle[: n - len(live)]]), np.int32)

    def _constrained(self, span: int, live: Sequence[int], plain: bool = False) -> tuple[SpecState, Tree]:
        """One cycle of the live rows, some of which follow grammars: a plain step under the roots' masks, or the
        tree drafted (forced chains as its context candidates), masked node by node on the host, and verified
        (`plain`: with `tree.PLAIN`). `_constrained_calls` names the same programs for the warm-up."""
        n, rows = self.bucket(len(live)), self._rows_of(live)
        cfg = self.cfg if plain else self.settings[n]
        static, params = {"cfg": cfg, "span": span}, (self.tparams, self.dparams)
        matchers = [self.rows[s].grammar for s in (range(self.slots) if rows is None else rows)]
        vocab, tag = self.cfg.tcfg.vocab_size, f"{cfg.tree} rows {n} span {span}"
        if not cfg.tree.drafts:
            masks = np.stack([m.mask() if m else grammars.everything((), vocab) for m in matchers])[:, None]
            return self.compiled(f"cycle {tag} masked", speculative.cycle, *params, self.state, rows, masks, **static)
        forced = grammars.forced_chains(matchers, cfg.tree.context) if cfg.tree.context else None
        first = np.stack([m.mask() if m else grammars.everything((), vocab) for m in matchers])  # [R, W]
        first = first if cfg.tree.needs_head else None
        drafted = self.compiled(
            f"draft {tag}", speculative.cycle_draft, *params, self.state, rows, forced, first, **static
        )
        state, tr, wide = drafted
        tokens, parents = distributed.host_value((tr.tokens, tr.parents))  # [R, N]
        if forced is not None and cfg.tree.needs_head:  # rows forced nothing at the root: after the head's path?
            heads, k = cfg.tree.head_nodes, cfg.tree.context
            chains = [
                m.path_chain(t, p, heads, k) if m and not f else []
                for m, t, p, f in zip(matchers, tokens, parents, forced[1][:, 0], strict=True)
            ]
            if any(chains):
                tr, wide = self.compiled(
                    f"regraft {tag}", speculative.regraft, tr, wide, grammars.candidates(chains, k), cfg=cfg
                )
                tokens, parents = distributed.host_value((tr.tokens, tr.parents))
        masks = np.stack(
            [
                m.tree_masks(t, p) if m else grammars.everything(t.shape, vocab)
                for m, t, p in zip(matchers, tokens, parents, strict=True)
            ]
        )
        state = self.compiled(
            f"verify {tag}", speculative.cycle_verify, *params, state, tr, wide, masks, rows, **static
        )
        return state, tr

    def _constrained_calls(self, span: int, n: int, plain: bool = False) -> list[tuple[str, Any, tuple, dict]]:
        """The programs `_constrained` runs for n live rows, on arguments shaped as it passes them (no row's
        grammar forcing anything): what the warm-up compiles for rows that follow grammars."""
        rows = self._rows_of(range(n))
        cfg, r = self.cfg if plain else self.settings[n], n if rows is not None else self.slots
        static, params = {"cfg": cfg, "span": span}, (self.tparams, self.dparams)
        vocab, tag = self.cfg.tcfg.vocab_size, f"{cfg.tree} rows {n} span {span}"
        if not cfg.tree.drafts:
            masked = (*params, self.state, rows, grammars.everything((r, 1), vocab))
            return [(f"cycle {tag} masked", speculative.cycle, masked, static)]
        forced = grammars.forced_chains([None] * r, cfg.tree.context) if cfg.tree.context else None
        first = grammars.everything((r,), vocab) if cfg.tree.needs_head else None
        draft = (*params, self.state, rows, forced, first)
        state, tr, wide = jax.eval_shape(functools.partial(speculative.cycle_draft, **static), *draft)
        calls = [(f"draft {tag}", speculative.cycle_draft, draft, static)]
        if forced is not None and cfg.tree.needs_head:
            calls.append((f"regraft {tag}", speculative.regraft, (tr, wide, forced), {"cfg": cfg}))
        verify = (*params, state, tr, wide, grammars.everything(tr.tokens.shape, vocab), rows)
        return [*calls, (f"verify {tag}", speculative.cycle_verify, verify, static)]

    def _feed(
        self,
        fed: dict[int, Piece],
        limits: dict[int, int],
        sampling: SamplingConfig | None,
        seed: int,
        logprobs: bool = False,
        masks: dict[int, np.ndarray] | None = None,
    ) -> tuple:
        """`speculative.extend`'s arguments that feed pieces of prompts into rows (slot -> piece, padded to the
        largest): those rows alone with per-row sampling, else every row (the others fed nothing), as the static
        rule draws for every row. `logprobs`: the fed rows record theirs; `masks` (slot -> [W]): the tokens a
        row's root may be (every token for the others; none given: no mask argument)."""
        slots = sorted(fed) if self.per_row else list(range(self.slots))
        size = max(p.tokens.shape[0] for p in fed.values())
        idle = Piece(0, np.zeros(size, np.int32), np.zeros(size, np.int32), 0, False)
        each = [fed.get(s, idle) for s in slots]
        pad = lambda a: np.pad(a, (0, size - a.shape[0]))  # noqa: E731
        tokens, follow = (np.stack([pad(getattr(p, f)) for p in each]) for f in ("tokens", "follow"))  # [R, C]
        start, n = (np.asarray([getattr(p, f) for p in each], np.int32) for f in ("start", "n"))  # [R]
        final, limit = np.asarray([p.final for p in each]), np.asarray([limits.get(s, 0) for s in slots], np.int32)
        rows = None if len(slots) == self.slots else np.asarray(slots, np.int32)
        settings = [sampling or STATIC_SAMPLING] * len(slots)
        controls = RowControls.of(settings, [seed] * len(slots)) if self.per_row else None
        key = jax.random.key(0 if self.per_row else seed)  # per-row keys follow positions (`decoding.rows`)
        recording = np.asarray([logprobs and s in fed for s in slots])  # [R]
        args = (self.tparams, self.dparams, self.state, start, tokens, follow, n, final, limit, key, controls, rows)
        if not masks:
            return (*args, recording)
        vocab = self.cfg.tcfg.vocab_size
        return (*args, recording, np.stack([masks.get(s, grammars.everything((), vocab)) for s in slots]))  # [R, W]

    def _calls(self) -> list[tuple[str, Any, tuple, dict]]:
        """Every program, in the order a first answer needs them: the smallest chunk and span first."""
        feeds = self._feeds()
        extends = [
            (f"extend {p.n}", speculative.extend, self._feed({0: p}, {0: 1}, None, 0), {"cfg": self.cfg}) for p in feeds
        ]
        cycles = [self._cycle_call(span, range(n), plain) for n, plain in self._plans() for span in self.spans]
        retiring = ("retire", retire, (self.state, np.zeros(self.slots, bool)), {})
        copies = [("copy in", prefix.copy_in, self._copy_in_args(0, [0], []), {})] if self.index else []
        copies += [("copy out", prefix.copy_out, self._copy_out_args(0, []), {})] if self.index else []
        return [extends[0], cycles[0], *extends[1:], *cycles[1:], retiring, *copies, *self._structured_calls()]

    def _feeds(self) -> list[Piece]:
        """A whole prompt of each chunk size (what the warm-up compiles the extends for)."""
        return [Piece(0, np.ones(c, np.int32), np.ones(c, np.int32), c, True) for c in sorted(self.chunks)]

    def _structured_calls(self) -> list[tuple[str, Any, tuple, dict]]:
        """With `structured`, the programs of rows that follow grammars: masked extends and constrained cycles."""
        if not self.structured:
            return []
        feeds, root = self._feeds(), {0: grammars.everything((), self.cfg.tcfg.vocab_size)}
        extends = [
            (
                f"extend {p.n} masked",
                speculative.extend,
                self._feed({0: p}, {0: 1}, None, 0, masks=root),
                {"cfg": self.cfg},
            )
            for p in feeds
        ]
        cycles = [
            c for n, plain in self._plans() for span in self.spans for c in self._constrained_calls(span, n, plain)
        ]
        return extends + cycles

    def _plans(self) -> list[tuple[int, bool]]:
        """(rows, plain) of every cycle the engine can run: each envelope's, and with per-row settings (a server,
        whose rows may ask for plain decoding) their plain cycles too (elsewhere compiled on first use)."""
        drafting = [n for n in sorted(self.envelope) if self.per_row and self.envelope[n] != PLAIN]
        return [(n, False) for n in sorted(self.envelope)] + [(n, True) for n in drafting]

    def programs(self) -> list[str]:
        """The names of the compiled set."""
        return [name for name, *_ in self._calls()]

    def structured_programs(self) -> list[str]:
        """The names of the compiled set's programs for rows that follow grammars (last in the warm-up)."""
        return [name for name, *_ in self._structured_calls()]

    def warm_up(self, wait: bool = True, first: int | None = None) -> float:
        """Compile the programs the engine can run (the `first` few of them: `programs`), ahead of time on worker
        threads (nothing runs); with `wait`, until they are compiled (else an operation waits for its own).
        Returns the seconds taken."""
        t0 = time.perf_counter()
        for name, fn, args, static in self._calls()[:first]:
            self.compiled.submit(name, fn, *args, **static)
        self._outputs()  # reading rows back (a program of its own on several processes)
        if self.state.logprobs is not None:
            self._logprobs(0)
        if wait:
            self.compiled.wait()
        return time.perf_counter() - t0

    # ------------------------------------------------------------ operations

    @contextlib.contextmanager
    def _failing(self, touched: Sequence[int]) -> Iterator[None]:
        """Run programs; when one raises, rebuild the rows and raise `EngineError` for the touched and live rows."""
        if self.dead:
            raise EngineError("the engine failed and could not rebuild its rows", dead=True)
        owners = [r.owner for s, r in enumerate(self.rows) if r.running or s in touched]
        try:
            with failing(owners):
                yield
        except EngineError as exc:
            self.rows, self.unoffered = [Row() for _ in range(self.slots)], []
            try:
                self.state = self._empty()
                if self.index:
                    self.index.clear()
                    self.pool = prefix.empty_pool(self.state, self.index.blocks)
            except Exception as again:
                self.dead = True
                raise EngineError(f"{exc} and could not rebuild its rows", owners, True) from again
            raise EngineError(f"{exc}; its rows were rebuilt", owners) from exc.__cause__

    def admit(
        self,
        slot: int,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        owner: Any = None,
        logprobs: bool = False,
        plain: bool = False,
        grammar: grammars.Matcher | None = None,
    ) -> int:
        """Start a free row's answer to `prompt` (up to `max_tokens` new tokens, fewer where the cache ends), sampled
        as `sampling` says with `seed` (per-row engines; else the static rule), following `grammar` (a fresh
        matcher) when given: its caches keep what they share with the prompt, or take the longest prefix the prefix
        cache holds, and the rest is fed in chunks. With `logprobs` (settings that record them), its steps carry its
        tokens' logprobs. `plain`: decoded without speculation (`Row.plain`). Returns the prompt tokens kept."""
        grammar_of = {slot: grammar} if grammar is not None else None
        return self.admit_many({slot: prompt}, max_tokens, sampling, seed, {slot: owner}, logprobs, plain, grammar_of)[
            slot
        ]

    def admit_many(
        self,
        prompts: dict[int, Sequence[int]],
        max_tokens: int,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
        owners: dict[int, Any] | None = None,
        logprobs: bool = False,
        plain: bool = False,
        grammar_of: dict[int, grammars.Matcher] | None = None,
    ) -> dict[int, int]:
        """`admit` free rows (slot -> prompt, slot -> owner, slot -> grammar) at once: with the static rule their
        chunks are fed side by side, so each row's first token is its draw in one batch (what the cycles' draws are
        too). Returns the prompt tokens each row kept."""
        if logprobs and not self.cfg.logprobs:
            raise EagleError("this engine records no logprobs; build it with settings whose `logprobs` is > 0")
        prompts = {slot: list(p) for slot, p in prompts.items()}
        owners, grammar_of = owners or {}, grammar_of or {}
        sizes = schedule.plan([len(p) for p in prompts.values()], max_tokens, self.overhead, self.capacity)
        limits = dict(zip(prompts, sizes.limits.tolist()))
        keep = {slot: reusable(self.rows[slot].cached, p) if self.keep_rows else 0 for slot, p in prompts.items()}
        for slot in prompts:
            self.rows[slot] = Row(owners.get(slot), False, [], 0)
        with self._failing(list(prompts)):
            self._offer()
            for slot, p in prompts.items():
                blocks = self.index.lookup(p) if self.index else []
                hit = min(len(blocks) * prefix.BLOCK, len(p)) - 1  # the last kept pair is read again (`reusable`)
                if hit > keep[slot]:
                    self.state = self.compiled("copy in", prefix.copy_in, *self._copy_in_args(slot, p, blocks))
                    keep[slot] = hit
            fed = {slot: pieces(p, keep[slot], self.chunks) for slot, p in prompts.items()}
            masks = {slot: g.mask() for slot, g in grammar_of.items()}  # [W] the roots'
            # with per-row sampling a row's chunks are fed alone (one program per chunk size)
            groups = [{slot: f} for slot, f in fed.items()] if self.per_row else [fed]
            for group in groups:
                for i in range(max(map(len, group.values()))):
                    now = {slot: f[i] for slot, f in group.items() if i < len(f)}
                    size = max(p.tokens.shape[0] for p in now.values())
                    allowed = {s: masks[s] for s in now if s in masks}
                    args = self._feed(now, limits, sampling, seed, logprobs, allowed)
                    name = f"extend {size}{' masked' if allowed else ''}"
                    self.state = self.compiled(name, speculative.extend, *args, cfg=self.cfg)
            if grammar_of:
                roots = distributed.host_value(self.state.root)
                for slot, g in grammar_of.items():
                    g.advance([int(roots[slot])])
        for slot, p in prompts.items():
            self.rows[slot] = Row(
                owners.get(slot), True, p, 0, logprobs=logprobs, plain=plain, grammar=grammar_of.get(slot)
            )
            self.unoffered.append((slot, p))  # rows admitted next share its prompt already
        return keep

    def cycle(self) -> list[Step]:
        """One cycle of the live rows with the envelope for their number, attending over the span they need (plain
        rows with `loop`: as many cycles as that span holds): each one's new tokens, and its finish when it
        ended (its row is then free)."""
        live = self.live
        if not live:
            return []
        tree = self.tree(live)
        with self._failing(live):
            self._offer()
            needed = speculative.host_slots_needed(self.state, tree)
            span = schedule.attention_span(int(needed[live].max()), self.capacity)
            if any(self.rows[s].grammar is not None for s in live):
                self.state, self.last_tree = self._constrained(span, live, plain=tree == PLAIN)
            else:
                name, fn, args, static = self._cycle_call(span, live, plain=tree == PLAIN)
                out = self.compiled(name, fn, *args, **static)
                self.state, self.last_tree = (out, None) if fn is speculative.run_span else out  # (state, tree)
            counts, done, eos, tokens, sources = self._outputs()
            recorded = {s: self._logprobs(s) for s in live if self.rows[s].logprobs}
            roots = distributed.host_value(self.state.root) if any(self.rows[s].grammar for s in live) else None
        steps = []
        for slot in live:
            row = self.rows[slot]
            new = tokens[slot, row.shown : counts[slot]].tolist()
            logprobs = lps.tokens_of(recorded[slot], new, row.shown) if slot in recorded else None
            where = [speculative.SOURCES[i] for i in sources[slot, row.shown : counts[slot]]]
            row.shown, row.cached = int(counts[slot]), row.cached + new
            finish = ("stop" if eos[slot] else "length") if done[slot] else None
            if row.grammar is not None and not finish:
                row.grammar.advance([*new[1:], int(roots[slot])])  # the last root was consumed before
            steps.append(Step(slot, row.owner, new, finish, logprobs=logprobs, sources=where, tree=tree))
            if finish:
                row.owner, row.running, row.grammar = None, False, None
                self.unoffered.append((slot, row.cached))
        return steps

    def cancel(self, slots: Sequence[int]) -> list[Any]:
        """End running rows before their answers are done (their caches keep what they hold); their owners."""
        slots = [s for s in slots if self.rows[s].running]
        if not slots:
            return []
        with self._failing(slots):
            self.state = self.compiled("retire", retire, self.state, np.isin(np.arange(self.slots), slots))
        owners = [self.rows[s].owner for s in slots]
        for s in slots:
            self.rows[s].owner, self.rows[s].running, self.rows[s].grammar = None, False, None
        self.unoffered += [(s, self.rows[s].cached) for s in slots]
        return owners

    # ------------------------------------------------------------ the prefix cache

    def _copy_in_args(self, slot: int, prompt: Sequence[int], blocks: Sequence[int]) -> tuple:
        """`prefix.copy_in`'s arguments that copy pool blocks into a row about to take `prompt`."""
        ids, history = np.zeros(self.capacity // prefix.BLOCK, np.int32), np.full(self.capacity, PAD_ID, np.int32)
        ids[: len(blocks)], history[: len(prompt)] = blocks, prompt
        return self.state, self.pool, ids, np.int32(len(blocks)), np.int32(slot), history

    def _copy_out_args(self, slot: int, new: Sequence[tuple[int, int]]) -> tuple:
        """`prefix.copy_out`'s arguments that copy a row's blocks (index in the row, pool block) out."""
        sources, ids = (np.zeros(self.capacity // prefix.BLOCK, np.int32) for _ in range(2))
        for i, (j, block) in enumerate(new):
            sources[i], ids[i] = j, block
        return self.pool, self.state, np.int32(slot), sources, np.int32(len(new)), ids

    def _offer(self) -> None:
        """The prefix cache takes the full blocks of the rows offered (positions their caches hold: every token but
        the last) that it does not hold yet."""
        for slot, tokens in self.unoffered if self.index else ():
            new = self.index.insert(tokens[:-1])
            if new:
                self.pool = self.compiled("copy out", prefix.copy_out, *self._copy_out_args(slot, new))
        self.unoffered = []

    def _outputs(self) -> tuple[np.ndarray, ...]:
        s = self.state
        return distributed.host_value((s.counts, s.done, s.eos, s.out, s.sources))

    def _logprobs(self, slot: int) -> tuple[np.ndarray, ...]:
        """A row's logprob buffers on the host (`logprobs.row`)."""
        return distributed.host_value(lps.row(self.state.logprobs, np.int32(slot)))

"""One-shot and streamed generation of a batch of prompts: a client of an `engine.Engine` with one row per prompt.

The rows are admitted side by side and sampled with the static rule of the settings and the key of the seed, so a
batch draws as one (every row's draws depend on the seed and its row, not on the others' prompts). `generate`
runs cycles as on-device loops, one per attention span (no host round trip per cycle); `stream` runs them one at a
time and yields each one's tokens and tree. On a mesh the rows are split over `data` (idle rows fill the batch to
a multiple of it) and the parameters placed by their logical axes. Plain decoding is the same with `tree.PLAIN`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import jax
from jax.sharding import Mesh

from eagle_jax.decoding import engine as engines
from eagle_jax.decoding import speculative
from eagle_jax.decoding.grammar import Matcher
from eagle_jax.decoding.speculative import DecodeConfig, SpecResult, SpecState
from eagle_jax.decoding.tree import Tree
from eagle_jax.parallel import sharding


def engine_for(
    tparams,
    dparams,
    prompts: list[list[int]],
    max_new_tokens: int,
    cfg: DecodeConfig,
    capacity: int | None = None,
    mesh: Mesh | None = None,
    loop: bool = True,
) -> engines.Engine:
    """An engine with a row for each prompt (and idle rows to fill a mesh's `data`), whose cache holds the prompts'
    bucket, the budget and one cycle's tree unless `capacity` is given (`speculative.prepare`)."""
    capacity = speculative.prepare(prompts, max_new_tokens, cfg, capacity).capacity
    slots = len(prompts)
    if mesh is not None:
        slots += -slots % sharding.data_parallelism(mesh)
        tparams = sharding.place(tparams, sharding.target_shardings(cfg.tcfg, mesh))
        if dparams is not None and cfg.dcfg is not None:
            dparams = sharding.place(dparams, sharding.draft_shardings(cfg.dcfg, mesh))
    return engines.Engine(tparams, dparams, cfg, slots, capacity, loop=loop, mesh=mesh)


def cycles(engine: engines.Engine) -> Iterator[list[engines.Step]]:
    """Cycle the engine's admitted rows until every one is done: yields each cycle's (or loop's) steps."""
    while engine.live:
        yield engine.cycle()


def per_row(steps: list[engines.Step], rows: int) -> list[list[int]]:
    """The new tokens of rows 0..rows-1 in one cycle's steps."""
    new: list[list[int]] = [[] for _ in range(rows)]
    for step in steps:
        new[step.slot] = step.tokens
    return new


def generate(
    tparams,
    dparams,
    prompts: list[list[int]],
    max_new_tokens: int,
    cfg: DecodeConfig,
    seed: int = 0,
    capacity: int | None = None,
    *,
    mesh: Mesh | None = None,
    on_new: Callable[[list[list[int]]], None] | None = None,
    matchers: Sequence[Matcher | None] | None = None,
) -> SpecResult:
    """Up to max_new_tokens new tokens per prompt with `cfg` (its tree `tree.PLAIN`: plain decoding), on one device
    or a mesh; with `on_new(new tokens per row)` (one device), streamed cycle by cycle, else in on-device loops.
    Row r follows `matchers[r]` (a fresh grammar matcher; None: free text), cycle by cycle (the host masks each
    cycle). The result holds the seconds the admission (prefill) and the cycles took."""
    streamed = (on_new is not None or matchers is not None) and mesh is None
    engine = engine_for(tparams, dparams, prompts, max_new_tokens, cfg, capacity, mesh, loop=not streamed)
    tokens: list[list[int]] = [[] for _ in prompts]
    finish = ["length"] * len(prompts)
    grammar_of = {r: m for r, m in enumerate(matchers or ()) if m is not None}
    t0 = time.perf_counter()
    engine.admit_many(dict(enumerate(prompts)), max_new_tokens, seed=seed, grammar_of=grammar_of)
    jax.block_until_ready(engine.state)
    t1 = time.perf_counter()
    for steps in cycles(engine):
        for step in steps:
            tokens[step.slot] += step.tokens
            finish[step.slot] = "eos" if step.finish == "stop" else finish[step.slot]
        if streamed and on_new is not None:
            on_new(per_row(steps, len(prompts)))
    t2 = time.perf_counter()
    if on_new is not None and not streamed:
        on_new(tokens)
    accepts = [engine.accept_lengths(slot) for slot in range(len(prompts))]
    return SpecResult(tokens, accepts, finish, prefill_s=t1 - t0, decode_s=t2 - t1)


def stream(
    tparams,
    dparams,
    prompts: list[list[int]],
    max_new_tokens: int,
    cfg: DecodeConfig,
    seed: int = 0,
    capacity: int | None = None,
) -> Iterator[tuple[list[list[int]], Tree, SpecState]]:
    """`generate` one cycle at a time: yields (new tokens per row, the cycle's tree, the state after it)."""
    engine = engine_for(tparams, dparams, prompts, max_new_tokens, cfg, capacity, loop=False)
    engine.admit_many(dict(enumerate(prompts)), max_new_tokens, seed=seed)
    for steps in cycles(engine):
        yield per_row(steps, len(prompts)), engine.last_tree, engine.state

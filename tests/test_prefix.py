"""The prefix cache across rows: a prompt starts from the longest cached prefix (copied into its row), and answers
exactly as the whole prompt fed from scratch would, token for token and cycle for cycle."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding import engine as engines
from eagle_jax.decoding import prefix
from eagle_jax.decoding.prefix import BLOCK, Index
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.serving import batcher

ROOT = Path(__file__).resolve().parents[1]
TREE = DynamicTree(16, 4, 4)
CAPACITY, CHUNKS = 256, (64, 16)


# ---------------------------------------------------------------- the host index


def test_a_block_is_found_only_after_the_same_prefix():
    index = Index(8)
    a = list(range(100, 140))  # 2 full blocks and 8 tokens
    assert [j for j, _ in index.insert(a)] == [0, 1] and index.tokens == 2 * BLOCK
    assert index.lookup(a) == index.lookup(a[:32] + [1, 2]) and len(index.lookup(a)) == 2
    assert len(index.lookup(a[:31] + [7])) == 1  # differs in the second block's last token
    assert index.lookup([7] + a[1:]) == []  # the same second block after another first one
    assert index.insert(a) == []  # nothing new


def test_least_recently_used_blocks_go_first_and_a_chain_from_its_end():
    index = Index(4)
    a, b = list(range(0, 32)), list(range(500, 532))
    index.insert(a)
    index.insert(b)
    index.lookup(a)  # a is now more recent than b
    c = list(range(900, 916))
    index.insert(c)  # evicts b's last block, not its first
    assert len(index.lookup(a)) == 2 and len(index.lookup(b)) == 1 and len(index.lookup(c)) == 1


def test_a_prefix_longer_than_the_pool_keeps_its_start():
    index = Index(3)
    other = list(range(700, 716))
    index.insert(other)
    long = list(range(0, 5 * BLOCK))
    new = index.insert(long)
    assert [j for j, _ in new] == [0, 1, 2] and len({b for _, b in new}) == 3  # its own blocks are never evicted
    assert len(index.lookup(long)) == 3 and index.lookup(other) == []


def test_an_evicted_block_is_forgotten_before_it_is_reused():
    index = Index(2)
    a, b = list(range(0, 32)), list(range(300, 332))
    blocks_a = [blk for _, blk in index.insert(a)]
    new_b = index.insert(b)  # takes both of a's blocks
    assert sorted(blk for _, blk in new_b) == sorted(blocks_a)
    assert index.lookup(a) == [] and len(index.lookup(b)) == 2


def test_a_budget_beyond_memory_is_refused_naming_the_setting():
    with pytest.raises(EagleError) as err:
        prefix.check_budget(10**9, 1000, 2**30)
    assert err.value.setting == "prefix_tokens" and "lower it" in str(err.value)
    prefix.check_budget(1000, 1000, 2**30)


# ---------------------------------------------------------------- engines: exact answers


def _pair(kind: str):
    if kind == "eagle3":
        tcfg, tparams = loading.load_target(ROOT / "demo" / "target", jnp.float32)
        dcfg, dparams = loading.load_draft(ROOT / "demo" / "eagle3", tcfg, dtype=jnp.float32)
    else:
        tcfg, tparams = loading.load_target(ROOT / "tests" / "golden" / "target", jnp.float32)
        dcfg, dparams = loading.load_draft(ROOT / "tests" / "golden" / "eagle1", tcfg, dtype=jnp.float32)
    return tparams, dparams, DecodeConfig(tcfg, dcfg, TREE)


@pytest.fixture(scope="module", params=["eagle3", "eagle1"])
def engines_pair(request):
    """An engine with a prefix cache and one that feeds every prompt whole (the reference), same programs."""
    tparams, dparams, cfg = _pair(request.param)
    cached = engines.Engine(tparams, dparams, cfg, 2, CAPACITY, CHUNKS, per_row=True, prefix_tokens=64 * BLOCK)
    whole = engines.Engine(tparams, dparams, cfg, 2, CAPACITY, CHUNKS, per_row=True, prefix_tokens=0)
    return cached, whole


def answer(engine, slot, prompt, n, sampling=None, seed=0) -> tuple[int, list[int], list[int]]:
    """(prompt tokens kept, the answer, accepted drafts per cycle) of one row alone."""
    kept = engine.admit(slot, prompt, n, sampling, seed, owner=slot)
    tokens: list[int] = []
    while True:
        (step,) = [s for s in engine.cycle() if s.slot == slot]
        tokens += step.tokens
        if step.finish:
            return kept, tokens, engine.accept_lengths(slot)


def test_cached_prefixes_answer_as_whole_prompts(engines_pair):
    """A shared system prompt, a conversation's next turns, prompts that diverge mid-block and mid-chunk, and
    prompts that differ from a cached prefix in their last token only: each row (never the one that left the
    prefix) keeps the whole blocks it shares with a retired row less the last position (whose head pair is read
    again), and answers with the tokens and accepted drafts of the whole prompt fed from scratch."""
    cached, whole = engines_pair
    rng = np.random.default_rng(0)
    words = lambda n: rng.integers(3, 250, n).tolist()  # noqa: E731
    system = words(40)
    held: list[list[int]] = []  # what retired rows offered (every token but the last)
    pooled: list[bool] = []

    def check(prompt: list[int], from_pool: int, n: int = 12) -> list[int]:
        # the row whose own caches share least with the prompt: what it keeps comes from the pool
        slot = min((0, 1), key=lambda s: engines.common_prefix(cached.rows[s].cached, prompt))
        own = engines.reusable(cached.rows[slot].cached, prompt)
        kept, tokens, accepted = answer(cached, slot, prompt, n)
        assert (kept, tokens, accepted) == (max(from_pool, own), *answer(whole, 0, prompt, n)[1:])
        pooled.append(from_pool > own)
        held.append((prompt + tokens)[:-1])
        return tokens

    first = system + words(10)
    a1 = check(first, 0)  # nothing cached yet
    check(system + words(9), 2 * BLOCK - 1)  # the system prompt diverges mid-block (40 = 2.5 blocks)
    turn2 = first + a1 + words(5)  # the next turn: the first row's prompt and answer are cached
    a2 = check(turn2, (len(held[0]) // BLOCK) * BLOCK - 1)
    turn3 = turn2 + a2 + words(70)  # a long new part: fed in a 64-chunk and 16-chunks
    check(turn3, (len(held[2]) // BLOCK) * BLOCK - 1, n=20)
    convo = held[-1]
    check(convo[: 4 * BLOCK], 4 * BLOCK - 1)  # all of it cached: its last token fed again
    check(convo[: 4 * BLOCK - 1] + [convo[4 * BLOCK - 1] + 1], 3 * BLOCK - 1)  # only its last token differs
    check(convo[: 3 * BLOCK] + [convo[3 * BLOCK] + 1], 3 * BLOCK - 1)  # differs after whole blocks
    check(convo[:100] + [convo[100] + 1] + convo[101:130], 6 * BLOCK - 1)  # diverges mid-chunk (100 of 64 + 64)
    other = words(5 * BLOCK - 12)
    answered = other + check(other, 0)  # 5 whole blocks: the caches hold every position but the last one's
    check(answered + words(10), 4 * BLOCK - 1)
    assert sum(pooled) >= 5, pooled


def test_a_seeded_sample_is_the_same_with_the_cache(engines_pair):
    cached, whole = engines_pair
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 250, 70).tolist()
    sc = SamplingConfig(temperature=0.9, top_p=0.95)
    _, first, _ = answer(cached, 0, prompt, 16, sc, seed=11)
    again = prompt + first + rng.integers(3, 250, 4).tolist()
    kept, tokens, _ = answer(cached, 1, again, 16, sc, seed=11)
    assert kept > 4 * BLOCK and tokens == answer(whole, 0, again, 16, sc, seed=11)[1]
    assert tokens != answer(whole, 0, again, 16, sc, seed=12)[1]


def test_eviction_under_load_never_touches_a_running_row():
    """Eight requests over two rows with a pool of six blocks, sharing parts of their prompts: blocks are evicted
    and reused while rows run, and every answer is the whole prompt's."""
    tparams, dparams, cfg = _pair("eagle3")
    serve = batcher.Batcher(tparams, dparams, cfg, slots=2, capacity=CAPACITY, chunks=CHUNKS, prefix_tokens=6 * BLOCK)
    whole = engines.Engine(tparams, dparams, cfg, 2, CAPACITY, CHUNKS, per_row=True, prefix_tokens=0)
    rng = np.random.default_rng(3)
    bases = [rng.integers(3, 250, 50).tolist() for _ in range(2)]
    prompts = [bases[i % 2][: 20 + 10 * (i % 4)] + rng.integers(3, 250, 5).tolist() for i in range(8)]
    outs: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):
        serve.submit(batcher.Request(p, 10 + i, SamplingConfig(), 0, outs[i].extend, lambda why: None))
        serve.step()
    while serve.step():
        pass
    for i, p in enumerate(prompts):
        assert outs[i] == answer(whole, 0, p, 10 + i)[1], i
    index = serve.engine.index
    assert serve.stats.kept_tokens > 0 and index.evicted > 0 and index.tokens <= 6 * BLOCK, (serve.stats, index.evicted)


def test_a_budget_of_zero_feeds_every_prompt_whole(engines_pair):
    _, whole = engines_pair
    prompt = list(range(10, 60))
    answer(whole, 0, prompt, 4)
    assert whole.index is None and whole.admit(0, prompt, 4, owner=0) == 0
    whole.cancel([0])

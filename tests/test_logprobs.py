"""Logprobs of emitted tokens (`decoding.logprobs`): the target's raw log-softmax at each emitted token, taken from
the verification forward, equal for speculative and plain rows and to a direct forward of the whole sequence."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tiny import target_logprobs

from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.logprobs import TokenLogprobs
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree
from eagle_jax.io import loading
from eagle_jax.serving import batcher

DEMO = Path(__file__).resolve().parents[1] / "demo"
K = 5
ATOL = 2e-4  # float32 forwards over a tree and over a chain of one token differ in the last bits
QUESTIONS = ["How do I make a cup of tea?", "Why is the sky blue?", "Write a short poem about the sea."]
GREEDY = SamplingConfig(temperature=0.0)


@pytest.fixture(scope="module")
def demo():
    tcfg, tparams = loading.load_target(DEMO / "target", jnp.float32)
    dcfg, dparams = loading.load_draft(DEMO / "eagle3", tcfg, dtype=jnp.float32)
    tok = loading.load_tokenizer(DEMO / "target")
    prompts = [loading.encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return tcfg, tparams, dcfg, dparams, prompts


def answers(engine: Engine, prompts, max_tokens: int, wanted) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """Every prompt's greedy answer on its own row, with the logprobs its steps carried (None: none asked)."""
    for slot, (prompt, want) in enumerate(zip(prompts, wanted)):
        engine.admit(slot, prompt, max_tokens, GREEDY, owner=slot, logprobs=want)
    tokens = [[] for _ in prompts]
    logprobs = [[] if want else None for want in wanted]
    while engine.live:
        for step in engine.cycle():
            tokens[step.slot] += step.tokens
            if wanted[step.slot]:
                assert step.logprobs is not None and len(step.logprobs) == len(step.tokens)
                logprobs[step.slot] += step.logprobs
            else:
                assert step.logprobs is None
    return list(zip(tokens, logprobs))


def assert_close(got: list[TokenLogprobs], tokens: list[int], chosen, top_ids, top) -> None:
    """`got` against expected chosen logprobs [T] and top-K ids and logprobs [T, K] (ids may swap where logprobs tie
    within the tolerance)."""
    assert [t.token for t in got] == tokens
    np.testing.assert_allclose([t.logprob for t in got], chosen, atol=ATOL)
    for t, ids, values in zip(got, top_ids, top):
        np.testing.assert_allclose([lp for _, lp in t.top], values, atol=ATOL)
        expected = dict(zip(ids.tolist(), values.tolist()))
        for i, lp in t.top:
            assert i in expected or lp <= values[-1] + ATOL, (i, lp, expected)


def engine(demo, tree, slots: int) -> Engine:
    tcfg, tparams, dcfg, dparams, _ = demo
    head = tree.needs_head
    cfg = DecodeConfig(tcfg, dcfg if head else None, tree, logprobs=K)
    return Engine(tparams, dparams if head else None, cfg, slots, capacity=256, chunks=(64, 16), per_row=True)


@pytest.mark.parametrize("tree", [DynamicTree(16, 4, 4), DynamicTree(16, 4, 4, context=4)], ids=["head", "context"])
def test_speculative_rows_carry_plain_decodings_logprobs(demo, tree):
    """Greedy answers, speculative (rows of a batch, one of which does not ask) and plain: the same tokens and the
    same logprobs of each token and its top alternatives."""
    prompts = demo[-1]
    wanted = [True, False, True]
    spec = answers(engine(demo, tree, len(prompts)), prompts, 40, wanted)
    plain = answers(engine(demo, PLAIN, len(prompts)), prompts, 40, wanted)
    for (tokens, got), (plain_tokens, expected) in zip(spec, plain):
        assert tokens == plain_tokens
        if expected is not None:
            chosen = [t.logprob for t in expected]
            ids = np.asarray([[i for i, _ in t.top] for t in expected])
            top = np.asarray([[lp for _, lp in t.top] for t in expected])
            assert_close(got, tokens, chosen, ids, top)


def test_logprobs_are_the_targets_log_softmax_over_the_whole_sequence(demo):
    """Each emitted token's logprob and top-K equal the log-softmax of one causal target forward over prompt +
    answer, at the position before the token (raw: before temperature; the rows sample at temperature 0.7)."""
    tcfg, tparams, *_, prompts = demo
    eng = engine(demo, DynamicTree(16, 4, 4), len(prompts))
    for slot, prompt in enumerate(prompts):
        eng.admit(slot, prompt, 32, SamplingConfig(temperature=0.7), seed=slot, owner=slot, logprobs=True)
    got = [[] for _ in prompts]
    while eng.live:
        for step in eng.cycle():
            got[step.slot] += step.logprobs
    for prompt, row in zip(prompts, got):
        tokens = [t.token for t in row]
        assert_close(row, tokens, *target_logprobs(tparams, tcfg, prompt, tokens, K))


def test_a_plan_tells_every_process_which_rows_record_logprobs():
    """A multi-host server's plan (`batcher.SlotChanges`) carries whether each admitted row records logprobs: every
    process must feed the same rows the same way."""
    asks = batcher.Request([1, 2], 4, GREEDY, 0, print, print, on_logprobs=print)
    plain = batcher.Request([3], 4, GREEDY, 0, print, print)
    plan = batcher.SlotChanges((1,), (batcher.Admission(0, asks), batcher.Admission(2, plain)))
    back = batcher.SlotChanges.from_bytes(plan.to_bytes())
    assert [(a.slot, a.request.prompt, a.request.on_logprobs is not None) for a in back.admit] == [
        (0, [1, 2], True),
        (2, [3], False),
    ]

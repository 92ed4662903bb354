"""The acceptance rule and its statistics on hand-made trees and histograms, and the benchmark's figures."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import acceptance
from eagle_jax.decoding.tree import Tree, ancestor_mask


def hand_tree() -> Tree:
    """root(10) -> a(11) -> c(13) -> e(15); root -> b(12) -> d(14)   (nodes 0..5 in recorded order)"""
    parents = jnp.asarray([[0, 0, 0, 1, 2, 3]])
    tokens = jnp.asarray([[10, 11, 12, 13, 14, 15]])
    mask = ancestor_mask(parents, 3)
    return Tree(tokens, parents, jnp.sum(mask, -1) - 1, mask)


def test_accept_follows_the_targets_choices():
    tr = hand_tree()
    # the target's token after each node: root -> 12 (b), b -> 14 (d), d -> 99 (bonus)
    choice = jnp.asarray([[12, 0, 14, 0, 99, 0]])
    n, path, bonus = acceptance.accept(tr, choice, 4)
    assert (int(n[0]), np.asarray(path[0]).tolist(), int(bonus[0])) == (2, [0, 2, 4, 0], 99)
    # root -> 11 (a), a -> 13 (c), c -> 15 (e), e -> 7: the whole deepest branch and its bonus
    n, path, bonus = acceptance.accept(tr, jnp.asarray([[11, 13, 0, 15, 0, 7]]), 4)
    assert (int(n[0]), np.asarray(path[0]).tolist(), int(bonus[0])) == (3, [0, 1, 3, 5], 7)
    # nothing agrees: accept 0 drafts, the root's choice is the bonus
    n, path, bonus = acceptance.accept(tr, jnp.asarray([[5, 13, 14, 15, 0, 0]]), 4)
    assert (int(n[0]), np.asarray(path[0]).tolist(), int(bonus[0])) == (0, [0, 0, 0, 0], 5)


def test_histogram_and_n_alpha_by_hand():
    lengths = [0, 0, 1, 2, 2, 3, 3, 3, 3, 1]
    hist = acceptance.accept_histogram(lengths, 4)
    assert hist == [2, 2, 2, 4, 0]
    # reached depth >= n: 10, 8, 6, 4, 0 cycles -> alpha_n = reached[n] / reached[n - 1]
    assert acceptance.n_alpha(hist) == [8 / 10, 6 / 8, 4 / 6, 0.0]
    assert acceptance.n_alpha([3, 0, 0]) == [0.0, None]  # depth 2 never reached


def test_benchmark_summary_by_hand():
    from infer.benchmark import summarise

    def turn(qid, batch, spec_tokens, accepts, plain_tokens):
        return {
            "question_id": qid,
            "batch": batch,
            "category": "c",
            "file": "f",
            "mismatch": False,
            "spec": {"tokens": [1] * spec_tokens, "accept_lengths": accepts},
            "plain": {"tokens": [1] * plain_tokens},
        }

    def timing(tokens, cycles, seconds, decode_s, plain_tokens, plain_s, plain_decode_s):
        return {
            "spec": {
                "tokens": tokens,
                "cycles": cycles,
                "seconds": seconds,
                "decode_s": decode_s,
                "prefill_s": seconds - decode_s,
            },
            "plain": {
                "tokens": plain_tokens,
                "cycles": plain_tokens - 1,
                "seconds": plain_s,
                "decode_s": plain_decode_s,
                "prefill_s": plain_s - plain_decode_s,
            },
        }

    records = [turn(1, 0, 30, [2] * 10, 30), turn(2, 1, 10, [1, 1, 0, 0, 3], 10)]
    timings = {0: timing(30, 10, 1.0, 0.8, 30, 2.0, 1.8), 1: timing(10, 5, 0.5, 0.4, 10, 1.0, 0.9)}
    s = summarise(records, timings, 3)
    assert s["tau"] == round(40 / 15, 4)
    assert s["tokens_per_s_spec"] == round(40 / 1.5, 2) and s["tokens_per_s_plain"] == round(40 / 3.0, 2)
    assert s["speedup"] == round((40 / 1.5) / (40 / 3.0), 4)
    # c = cycle time / plain step time - 1: (1.2 s / 15 cycles) / (2.7 s / 38 steps) - 1
    assert s["c"] == round((1.2 / 15) / (2.7 / 38) - 1, 4)
    assert s["accept_histogram"] == [2, 2, 10, 1]
    assert s["n_alpha"] == [round(13 / 15, 4), round(11 / 13, 4), round(1 / 11, 4)]
    # question ids repeat across files (each set numbers its own): questions and mismatches are per file
    other = dict(turn(1, 1, 10, [1, 1, 0, 0, 3], 10), file="g", mismatch=True)
    s = summarise([records[0], other], timings, 3)
    assert s["questions"] == 2 and s["mismatches"] == 1 and s["mismatched_questions"] == ["g:1"]

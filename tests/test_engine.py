"""Speculative engine: parity with the official implementation, losslessness, batching, compiles."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import FAMILIES, plain_generate, tiny_draft, tiny_target, with_eos

from eagle_jax.decoding import generation, programs, speculative
from eagle_jax.decoding import tree as trees
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import DynamicTree, NoDraft, StaticTree
from eagle_jax.io import loading
from eagle_jax.models import kv_cache, quantize

SETTINGS = {"t60_d7_k10": DynamicTree(60, 7, 10), "t16_d4_k4": DynamicTree(16, 4, 4)}


@pytest.fixture(scope="module")
def heads(golden_dir, golden_target):
    tcfg, _ = golden_target
    return {kind: loading.load_draft(golden_dir / kind, tcfg) for kind in ("eagle3", "eagle1")}


def leaf_paths(tr: trees.Tree) -> np.ndarray:
    """Upstream's retrieve indices [B, N, D+2]: root-to-leaf node lists, leaves in ascending node order,
    padded with -1 (columns past a leaf's depth and rows past the last leaf)."""
    mask, depths, parents = np.asarray(tr.mask), np.asarray(tr.depths), np.asarray(tr.parents)
    b, n = depths.shape
    out = -np.ones((b, n, int(depths.max()) + 1), np.int64)
    for row in range(b):
        leaves = [j for j in range(n) if not np.any(parents[row, 1:] == j)]
        for r, leaf in enumerate(leaves):
            for node in np.flatnonzero(mask[row, leaf]):
                out[row, r, depths[row, node]] = node
    return out


@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_golden_parity(head, setting, heads, golden_target, reference):
    """Every cycle's tree, the accept lengths and the output equal the official implementation's.

    The four golden prompts run as one batch: each row's trees are compared while the row runs.
    """
    tcfg, tparams = golden_target
    dcfg, dparams = heads[head]
    spec = SETTINGS[setting]
    prompts = [reference[f"p{i}.input_ids"].tolist() for i in range(4)]
    tokens = [[] for _ in prompts]
    acc = [[] for _ in prompts]
    for c, (new, tr, state) in enumerate(
        generation.stream(tparams, dparams, prompts, 64, speculative.DecodeConfig(tcfg, dcfg, spec))
    ):
        paths = leaf_paths(tr)
        for i in range(4):
            if not new[i]:
                continue
            pre = f"{head}.{setting}.p{i}."
            rows, cols = reference[pre + "cycle_retrieve_shape"][c]
            np.testing.assert_array_equal(tr.tokens[i], reference[pre + "cycle_draft_tokens"][c], f"{pre} cycle {c}")
            np.testing.assert_array_equal(tr.depths[i], reference[pre + "cycle_tree_position_ids"][c])
            np.testing.assert_array_equal(
                paths[i, :rows, :cols], reference[pre + "cycle_retrieve_indices"][c, :rows, :cols]
            )
            assert np.all(np.asarray(paths[i, rows:]) == -1) and np.all(np.asarray(paths[i, :, cols:]) == -1)
            if c == 0:
                np.testing.assert_array_equal(tr.mask[i], reference[pre + "tree0.tree_mask"][0, 0] > 0)
                np.testing.assert_array_equal(paths[i, :rows, :cols], reference[pre + "tree0.retrieve_indices"])
            tokens[i] += new[i]
            acc[i].append(int(state.accept_lengths[c, i]))
    for i, prompt in enumerate(prompts):
        pre = f"{head}.{setting}.p{i}."
        gold_acc = reference[pre + "accept_length"].tolist()
        assert tokens[i] == reference[pre + "output_ids"][len(prompt) : len(prompt) + 64].tolist()
        assert tokens[i] == reference[f"p{i}.greedy_ids"][len(prompt) : len(prompt) + 64].tolist()
        # every cycle equals upstream's; our last one may be cut short by the 64-token limit
        n = len(acc[i])
        assert acc[i][:-1] == gold_acc[: n - 1] and acc[i][-1] <= gold_acc[n - 1]


def test_while_loop_equals_stream(heads, golden_target, reference):
    tcfg, tparams = golden_target
    dcfg, dparams = heads["eagle3"]
    spec = SETTINGS["t16_d4_k4"]
    prompt = reference["p2.input_ids"].tolist()
    res = generation.generate(tparams, dparams, [prompt], 40, speculative.DecodeConfig(tcfg, dcfg, spec))
    streamed = list(generation.stream(tparams, dparams, [prompt], 40, speculative.DecodeConfig(tcfg, dcfg, spec)))
    assert res.tokens[0] == [t for new, _, _ in streamed for t in new[0]]
    assert len(res.tokens[0]) == 40
    assert res.cycles == [len(streamed)]
    hist = res.accept_histogram(spec.max_depth)
    assert sum(hist) == res.cycles[0] and res.tau == 40 / res.cycles[0]
    alphas = res.n_alpha(spec.max_depth)
    assert alphas[0] is not None and 0 <= alphas[0] <= 1


def _plain(tparams, tcfg, prompts, n):
    return plain_generate(tparams, tcfg, prompts, n).tokens


ENVELOPES = [
    DynamicTree(60, 7, 10),
    DynamicTree(16, 4, 4),
    DynamicTree(8, 2, 3),
    DynamicTree(2, 1, 1),
    DynamicTree(30, 5, 6),
    StaticTree(),
    StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
]


def _lossless_cases():
    """Seeded random (architecture, head, envelope, tied, batch) combinations covering every family and head."""
    rng = np.random.default_rng(27)
    cases = []
    for n, (family, kind) in enumerate(itertools.product(FAMILIES, ("eagle3", "eagle1"))):
        env = ENVELOPES[n % len(ENVELOPES)] if n < len(ENVELOPES) else ENVELOPES[rng.integers(len(ENVELOPES))]
        cases.append((family, kind, env, bool(rng.integers(2)), 1 if n % 3 == 0 else 4, int(rng.integers(100))))
    return cases


@pytest.mark.parametrize("family,kind,envelope,tied,batch,seed", _lossless_cases())
def test_greedy_lossless(family, kind, envelope, tied, batch, seed):
    """Speculative greedy output equals plain greedy output (batch 4: prompts of different lengths)."""
    tcfg, tparams = tiny_target(family, seed=seed, vocab=48, tied=tied)
    dcfg, dparams = tiny_draft(kind, tcfg, seed=seed + 1, draft_vocab=32 if kind == "eagle3" else None)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 48, size=n).tolist() for n in (9, 3, 1, 17)][:batch]
    res = generation.generate(tparams, dparams, prompts, 24, speculative.DecodeConfig(tcfg, dcfg, envelope))
    assert res.tokens == _plain(tparams, tcfg, prompts, 24)
    assert all(0 <= a <= envelope.max_depth for row in res.accept_lengths for a in row)
    assert sum(a for row in res.accept_lengths for a in row) > 0  # some drafts were accepted


def _rows_of(s: speculative.SpecState, rows: list[int]) -> dict[str, np.ndarray]:
    """What a state holds for some rows: their values and their rows of both caches."""
    out = {n: np.asarray(getattr(s, n))[rows] for n in ("root", "draft_hidden", "history", "out", "counts", "done")}
    out["accept_lengths"] = np.asarray(s.accept_lengths)[:, rows]
    for name in ("target_cache", "draft_cache"):
        c = getattr(s, name)
        out |= {f"{name}.lengths": np.asarray(c.lengths)[rows], f"{name}.k": np.asarray(c.k)[:, rows]}
        out[f"{name}.v"] = np.asarray(c.v)[:, rows]
    return out


@pytest.mark.parametrize("envelope", [DynamicTree(8, 3, 2), DynamicTree(5, 4, 1, context=3)])  # compact, write_path
def test_a_cycle_of_some_rows_equals_theirs_in_a_cycle_of_all(envelope):
    """`cycle(..., rows)` computes only those rows: they end as in a cycle of every row, and the rest is untouched."""
    tcfg, tparams = tiny_target(seed=5, vocab=48)
    dcfg, dparams = tiny_draft("eagle3", tcfg, seed=6, draft_vocab=32)
    cfg = speculative.DecodeConfig(tcfg, dcfg, envelope)
    prompts = [[5, 6, 7, 5, 6] * 2, [9, 3], [4] * 7, [11, 12, 13, 11, 12, 13, 11]]
    engine = generation.engine_for(tparams, dparams, prompts, 12, cfg, capacity=64)
    engine.admit_many(dict(enumerate(prompts)), 12)
    state = speculative.cycle(tparams, dparams, engine.state, cfg=cfg)[0]  # rows with caches of different lengths
    rest, moved = _rows_of(state, [0, 2]), _rows_of(state, [1, 3])  # (the cycles donate the state)
    every = _rows_of(speculative.cycle(tparams, dparams, jax.tree.map(jnp.copy, state), cfg=cfg)[0], [1, 3])
    some = speculative.cycle(tparams, dparams, state, jnp.asarray([3, 1], jnp.int32), cfg=cfg)[0]
    assert not np.array_equal(moved["out"], every["out"])  # those rows moved on
    for rows, want in (([1, 3], every), ([0, 2], rest)):
        for name, value in _rows_of(some, rows).items():  # floats: as computed in a batch of another size
            tol = 1e-4 if value.dtype.kind == "f" and rows == [1, 3] else 0
            np.testing.assert_allclose(value, want[name], rtol=tol, atol=tol, err_msg=name)


def test_growing_attention_spans_are_lossless(monkeypatch):
    """300 new tokens for rows of different lengths cross spans 128 -> 256 -> 384. The programs each decoder
    compiles attend over exactly those spans (seen in the forwards they trace); speculative output equals plain
    greedy, streamed or looped, and plain greedy in segments equals one whole-cache loop."""
    traced = []  # the attention span of every forward traced, target and draft
    window_mask = kv_cache.window_mask
    monkeypatch.setattr(kv_cache, "window_mask", lambda c, m, span: traced.append(span) or window_mask(c, m, span))
    jax.clear_caches()  # trace afresh
    monkeypatch.setattr(programs, "_COMPILED", {})
    tcfg, tparams = tiny_target("llama", seed=7, vocab=48)
    dcfg, dparams = tiny_draft("eagle3", tcfg, seed=8, draft_vocab=32)
    prompts = [[5, 6, 7, 8, 9] * 6, [3, 1]]  # bucket 32; capacity 384 (32 + 300 + one tree, rounded up)
    want = _plain(tparams, tcfg, prompts, 300)
    assert sorted(set(traced)) == [128, 256, 384]
    traced.clear()
    tree = DynamicTree(8, 4, 2)
    assert (
        generation.generate(tparams, dparams, prompts, 300, speculative.DecodeConfig(tcfg, dcfg, tree)).tokens == want
    )
    assert sorted(set(traced)) == [128, 256, 384]
    traced.clear()
    streamed = [[] for _ in prompts]
    for new, _, _ in generation.stream(tparams, dparams, prompts, 300, speculative.DecodeConfig(tcfg, dcfg, tree)):
        for row, toks in zip(streamed, new):
            row.extend(toks)
    assert streamed == want
    assert sorted(set(traced)) == [128, 256, 384]  # the streamed cycle
    cfg = speculative.DecodeConfig(tcfg)
    p = speculative.prepare(prompts, 300, cfg)
    state = speculative.prefill(
        tparams, None, p.tokens, p.lengths, p.limits, jax.random.key(0), cfg=cfg, capacity=p.capacity
    )
    whole = speculative.run_span(tparams, None, state, cfg=cfg)
    assert [np.asarray(whole.out)[r, :300].tolist() for r in range(2)] == want


def test_bf16_engine_equals_bf16_plain(heads, golden_target, reference):
    """bf16 weights through plain decoding and the engine (logits in float32): identical greedy outputs, drafts
    still accepted."""
    tcfg, tparams = golden_target
    dcfg, dparams = heads["eagle3"]

    def bf16(tree):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    tparams, dparams = bf16(tparams), bf16(dparams)
    prompts = [reference[f"p{i}.input_ids"].tolist() for i in range(4)]
    want = plain_generate(tparams, tcfg, prompts, 32).tokens
    res = generation.generate(
        tparams, dparams, prompts, 32, speculative.DecodeConfig(tcfg, dcfg, DynamicTree(16, 4, 4))
    )
    assert res.tokens == want and res.tau > 2
    from eagle_jax.models import target

    out = target.forward(
        tparams,
        tcfg,
        jnp.asarray([prompts[0]]),
        jnp.arange(len(prompts[0]))[None],
        target.init_cache(tcfg, 1, len(prompts[0]), jnp.bfloat16),
    )
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    # accumulated in float32, not bf16 products cast up: finer than bf16's resolution (2^-8 relative)
    exact = np.asarray(out.hidden, np.float32) @ np.asarray(tparams["lm_head"], np.float32)
    np.testing.assert_allclose(np.asarray(out.logits), exact, rtol=1e-5, atol=1e-5)


def test_eos_and_budget_per_row():
    """Rows stop at their own eos (kept) and never pass max_new_tokens; finished rows stop changing."""
    tcfg, tparams = tiny_target("llama", seed=3, vocab=48)
    dcfg, dparams = tiny_draft("eagle3", tcfg, seed=4)
    prompts = [[5, 6, 7], [9, 1, 2, 3, 4, 30]]
    eos = _plain(tparams, tcfg, prompts, 30)[0][7]
    tcfg_eos = with_eos(tcfg, (eos,))
    expected = _plain(tparams, tcfg_eos, prompts, 30)
    assert expected[0][-1] == eos and len(expected[0]) <= 8
    res = generation.generate(
        tparams, dparams, prompts, 30, speculative.DecodeConfig(tcfg_eos, dcfg, DynamicTree(16, 4, 4))
    )
    assert res.tokens == expected
    assert res.stop_reasons[0] == "eos"


def _joint_counts(tokens: list[list[int]], vocab: int, n: int) -> np.ndarray:
    idx = np.array([sum(t[i] * vocab ** (n - 1 - i) for i in range(n)) for t in tokens])
    return np.bincount(idx, minlength=vocab**n)


def _exact_joint(tparams, tcfg, prompt, sc: SamplingConfig, n: int) -> np.ndarray:
    """P(first n new tokens) under the processed target distribution, from one forward over all V^(n-1) prefixes."""
    from eagle_jax.decoding.sampling import processed_probs
    from eagle_jax.models import target

    v, p = tcfg.vocab_size, len(prompt)
    prefixes = np.array(list(itertools.product(range(v), repeat=n - 1)), np.int32).reshape(-1, n - 1)  # [V^(n-1), n-1]
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    out = target.forward(
        tparams,
        tcfg,
        seqs,
        np.broadcast_to(np.arange(seqs.shape[1]), seqs.shape),
        target.init_cache(tcfg, len(seqs), seqs.shape[1]),
    )
    probs = np.asarray(processed_probs(out.logits[:, p - 1 :], sc), np.float64)  # [V^(n-1), n, V]
    joint = probs[:, -1, :]  # P(t_n | prompt, prefix)
    for i in range(n - 1):
        joint = joint * probs[np.arange(len(prefixes)), i, prefixes[:, i]][:, None]
    joint = joint.reshape(-1)  # index = prefix * V + t_n, i.e. base-V digits t_1 .. t_n
    return joint / joint.sum()


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit, cells with expected < 5 pooled."""
    from scipy import stats

    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


def test_sampling_lossless():
    """The joint law of the first 3 tokens under speculative sampling equals the target's.

    4000 rows sample in one batched run; the exact law comes from the target over all 8^3 sequences.
    Power: moving 0.05 of probability mass between two cells of probability ~0.1 (total variation
    0.05) gives a chi-square noncentrality of N * sum(delta^2 / p) = 4000 * 0.05 = 200 over ~100
    degrees of freedom, rejected at the 1e-3 level with power ~1; a wrong acceptance rule (a
    residual not renormalised, the draft's law leaking in) moves far more mass. The last assertion
    checks that the same samples reject the law at another temperature.
    """
    sc = SamplingConfig(0.7, top_p=0.9)
    vocab, n_rows, n_tok = 8, 4000, 3
    tcfg, tparams = tiny_target("llama", seed=11, vocab=vocab, hidden=32)
    tparams = jax.tree.map(lambda x: x * 0.5 if x.ndim >= 2 else x, tparams)  # softer target distributions
    dcfg, dparams = tiny_draft("eagle3", tcfg, seed=12, draft_vocab=6)
    prompt = [1, 4, 2]
    exact = _exact_joint(tparams, tcfg, prompt, sc, n_tok)
    res = generation.generate(
        tparams,
        dparams,
        [prompt] * n_rows,
        n_tok,
        speculative.DecodeConfig(tcfg, dcfg, DynamicTree(8, 3, 3), sc),
        seed=5,
        capacity=32,  # the prompt's bucket and a tree (the default, 128, would attend over unused slots)
    )
    assert sum(a > 0 for row in res.accept_lengths for a in row) > n_rows // 4  # drafts do get accepted
    counts = _joint_counts(res.tokens, vocab, n_tok)
    assert _chi2_pvalue(counts, exact) > 1e-3
    # the same check rejects a wrong law (the power claimed above)
    wrong = _exact_joint(tparams, tcfg, prompt, SamplingConfig(0.5), n_tok)
    assert _chi2_pvalue(counts, wrong) < 1e-6


def _teacher_forced_laws(tparams, tcfg, prompts, tokens, sc: SamplingConfig) -> np.ndarray:
    """laws[r, i]: the target's processed law of emitted token i of row r given everything before it [R, n, V]."""
    from eagle_jax.decoding.sampling import processed_probs
    from eagle_jax.models import target

    rows = [list(p) + list(t) for p, t in zip(prompts, tokens)]
    width = max(map(len, rows))
    seqs = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        seqs[r, : len(row)] = row
    out = target.forward(
        tparams,
        tcfg,
        jnp.asarray(seqs),
        jnp.broadcast_to(jnp.arange(width), seqs.shape),
        target.init_cache(tcfg, len(rows), width),
    )
    probs = np.asarray(processed_probs(out.logits, sc), np.float64)  # [R, W, V]
    return np.stack([probs[r, len(p) - 1 : len(p) - 1 + len(t)] for r, (p, t) in enumerate(zip(prompts, tokens))])


def _rank_test(laws: np.ndarray, tokens: np.ndarray, bins: int = 4) -> float:
    """p-value that every emitted token follows its law: tokens fall in rank bins (0, 1, 2, 3+ by probability,
    ties by id); bin indicators minus bin probabilities are martingale differences, so their sum D with
    covariance sum(diag(q) - q q^T) gives a chi-square with bins - 1 degrees of freedom."""
    from scipy import stats

    rank = np.argsort(np.argsort(-laws, axis=-1, kind="stable"), axis=-1)  # [R, n, V]
    bin_of = np.minimum(rank, bins - 1)
    observed = np.eye(bins)[np.take_along_axis(bin_of, tokens[..., None], axis=-1)[..., 0]].reshape(-1, bins)
    expected = np.stack([np.sum(laws * (bin_of == k), axis=-1) for k in range(bins)], axis=-1).reshape(-1, bins)
    diff = (observed - expected).sum(0)[:-1]
    cov = (np.diag(expected.sum(0)) - expected.T @ expected)[:-1, :-1]
    return float(stats.chi2.sf(diff @ np.linalg.solve(cov, diff), bins - 1))


def _draft_test(laws: np.ndarray, tokens: np.ndarray, cycles: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """p-value that the drafts are accepted as often as the target's law says, no more and no less.

    At every node on an accepted path the target's next token lands among the node's children with
    probability q = law(children's tokens) (the tree is drafted before the target draws); indicators minus
    q are martingale differences, so z = sum(I - q) / sqrt(sum q (1 - q)) is standard normal.
    cycles: per cycle (tree tokens [R, N], tree parents [R, N], tokens emitted before it [R])."""
    from scipy import stats

    hits, probs = [], []
    n = tokens.shape[1]
    for tree_tokens, parents, before in cycles:
        is_child = np.arange(parents.shape[1]) > 0
        for r in range(tokens.shape[0]):
            node, k = 0, int(before[r])  # the cycle's root is emitted token `before[r]`
            while k + 1 < n:
                children = np.flatnonzero((parents[r] == node) & is_child & (tree_tokens[r] >= 0))  # used slots
                kids = tree_tokens[r, children]
                if not len(kids):
                    break
                hits.append(tokens[r, k + 1] in kids)
                probs.append(laws[r, k + 1, kids].sum())
                accepted = children[kids == tokens[r, k + 1]]
                if not len(accepted):
                    break  # the next token is this cycle's bonus
                node, k = int(accepted[0]), k + 1
    hits, probs = np.asarray(hits, np.float64), np.asarray(probs)
    z = (hits - probs).sum() / np.sqrt((probs * (1 - probs)).sum())
    return float(2 * stats.norm.sf(abs(z)))


SAMPLING_CASES = {
    "eagle3-dynamic": ("eagle3", DynamicTree(8, 3, 3), SamplingConfig(1.0)),
    "eagle1-static": (
        "eagle1",
        StaticTree(((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
        SamplingConfig(0.8, top_p=0.9),
    ),
    "eagle3-narrow-topk": ("eagle3", DynamicTree(12, 4, 2), SamplingConfig(1.0, top_k=5)),
    "eagle3-int8-target": ("eagle3+int8", DynamicTree(8, 3, 3), SamplingConfig(0.8)),  # the int8 target's law
    # candidates from the context, alone and grafted onto a tree (one-token matches: nearly every cycle has some);
    # at low temperatures the target repeats itself and its first candidate is taken in ~18% of the cycles
    "context-alone": ("eagle3", NoDraft(context=4, min_match=1), SamplingConfig(0.3)),
    "eagle3-dynamic+context": ("eagle3", DynamicTree(8, 3, 3, context=4, min_match=1), SamplingConfig(0.5, top_p=0.95)),
}
PROMPTS = [[1, 4, 2], [7, 3, 9, 9, 1, 5, 2], [2, 11, 6, 8, 3]]  # a batch of different prompt lengths
ROWS, NEW = 2400, 16
CAPACITY = 48  # cache slots: a prompt bucket, NEW tokens and a tree (the default rounds up to 128, and attending
# over the unused slots would be most of a cycle's time here)


def _sampling_models(kind: str):
    """kind: the head's, + a quantisation method for the target (e.g. eagle3+int8)."""
    head, _, method = kind.partition("+")
    tcfg, tparams = tiny_target("llama", seed=11, vocab=16, hidden=32)
    tparams = jax.tree.map(lambda x: x * 0.5 if x.ndim >= 2 else x, tparams)  # soft target distributions
    dcfg, dparams = tiny_draft(head, tcfg, seed=12, draft_vocab=12 if head == "eagle3" else None)
    if method:
        tcfg, tparams = quantize.quantize_target(tcfg, tparams, method)
    return tcfg, tparams, dcfg, dparams


def _prompts(rows: int) -> list[list[int]]:
    return [PROMPTS[r % len(PROMPTS)] for r in range(rows)]


def _streamed_sample(models, tree, sc, rows: int, seed: int):
    """(tokens [R, NEW], per-cycle (tree tokens, tree parents, tokens emitted before)) of a streamed run."""
    tcfg, tparams, dcfg, dparams = models
    tokens, cycles = [[] for _ in range(rows)], []
    for new, tr, _ in generation.stream(
        tparams,
        dparams,
        _prompts(rows),
        NEW,
        speculative.DecodeConfig(tcfg, dcfg, tree, sc),
        seed=seed,
        capacity=CAPACITY,
    ):
        cycles.append((np.asarray(tr.tokens), np.asarray(tr.parents), np.array([len(t) for t in tokens])))
        for row, toks in zip(tokens, new):
            row.extend(toks)
    return np.asarray(tokens), cycles


def _law_p_values(models, tree, sc, seed: int = 3) -> tuple[float, float]:
    tokens, cycles = _streamed_sample(models, tree, sc, ROWS, seed)
    assert len(cycles) >= 4 and tokens.shape == (ROWS, NEW)
    if isinstance(tree, NoDraft):  # the context's first candidate is taken in a good share of the cycles
        taken = [
            tokens[r, before[r] + 1] == tree_tokens[r, 1]
            for tree_tokens, _, before in cycles
            for r in range(ROWS)
            if before[r] + 1 < NEW
        ]
        assert np.mean(taken) > 0.1, np.mean(taken)
    laws = _teacher_forced_laws(models[1], models[0], _prompts(ROWS), tokens, sc)
    return _rank_test(laws, tokens), _draft_test(laws, tokens, cycles)


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_keeps_the_targets_law(case):
    """2400 rows of 16 sampled tokens over 8+ cycles, prompts of three lengths: every token follows the target's
    law given its prefix (`_rank_test`), and drafts are accepted exactly as often as that law says
    (`_draft_test`; `test_sampling_tests_reject_a_subtle_bias` shows its power)."""
    kind, tree, sc = SAMPLING_CASES[case]
    p_rank, p_draft = _law_p_values(_sampling_models(kind), tree, sc)
    assert p_rank > 1e-3 and p_draft > 1e-3, (p_rank, p_draft)


def test_sampling_tests_reject_a_subtle_bias(monkeypatch):
    """An engine that accepts a drafted token with probability ~ 1.1 p instead of p (at each node an extra coin
    of probability 0.1 p(token) accepts the first child it falls on: here the context's first candidate)
    fails the draft test."""
    from eagle_jax.decoding.sampling import processed_probs

    kind, tree, sc = SAMPLING_CASES["context-alone"]
    real_forward = speculative._forward

    def biased_forward(tparams, s, tr, **kw):  # the target's choice at a node becomes the coin's child
        fwd, choice = real_forward(tparams, s, tr, **kw)
        n = tr.tokens.shape[1]
        probs = processed_probs(fwd.logits, sc)  # [B, N, V] the target's law after each node
        at_parent = jnp.take_along_axis(probs, tr.parents[..., None], axis=1)  # [B, N, V] law at the parent
        p_token = jnp.take_along_axis(at_parent, jnp.maximum(tr.tokens, 0)[..., None], axis=2)[..., 0]  # [B, N]
        coin = jax.random.uniform(jax.random.fold_in(s.key, s.cycle + 99), tr.tokens.shape) < 0.1 * p_token
        coin = coin & (jnp.arange(n) > 0) & (tr.tokens >= 0)  # drafted nodes (not unused context slots)
        child_of = (tr.parents[:, None, :] == jnp.arange(n)[None, :, None]) & coin[:, None, :]  # [B, parent, child]
        extra = jnp.take_along_axis(tr.tokens, jnp.argmax(child_of, axis=-1), axis=1)
        return fwd, jnp.where(jnp.any(child_of, axis=-1), extra, choice)

    models = _sampling_models(kind)
    monkeypatch.setattr(speculative, "_forward", biased_forward)
    jax.clear_caches()
    programs.forget()  # compiled afresh, biased
    try:
        _, p_draft = _law_p_values(models, tree, sc)
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # no biased program outlives this test
        programs.forget()
    assert p_draft < 1e-5, p_draft


def test_seeds_reproduce_samples():
    """A seed gives the same sample in the while loop and when streamed; another seed gives another."""
    kind, tree, sc = SAMPLING_CASES["eagle3-dynamic"]
    tcfg, tparams, dcfg, dparams = models = _sampling_models(kind)

    def looped(seed: int) -> list[list[int]]:
        return generation.generate(
            tparams,
            dparams,
            _prompts(6),
            NEW,
            speculative.DecodeConfig(tcfg, dcfg, tree, sc),
            seed=seed,
            capacity=CAPACITY,
        ).tokens

    assert looped(21) == looped(21) == _streamed_sample(models, tree, sc, 6, 21)[0].tolist()
    assert looped(22) != looped(21)


def test_no_compile_after_warmup(heads, golden_target):
    """A second prompt length and more cycles in the same cache compile nothing (a larger cache does)."""
    tcfg, tparams = golden_target
    dcfg, dparams = heads["eagle3"]
    cfg = speculative.DecodeConfig(tcfg, dcfg, DynamicTree(16, 4, 4))
    generation.generate(tparams, dparams, [[1, 5, 9, 3]], 20, cfg)
    before = set(programs._COMPILED)
    generation.generate(tparams, dparams, [[1, 5, 9, 3, 7, 8, 11]], 40, cfg)
    assert set(programs._COMPILED) == before
    generation.generate(tparams, dparams, [[1, 5, 9, 3]], 20, cfg, capacity=256)
    assert set(programs._COMPILED) > before


def test_each_emitted_token_is_marked_by_the_node_it_came_from(heads, golden_target, reference):
    """The source the state records for each emitted token (`SpecState.sources`) is the one of the node the cycle's
    tree holds it at, found by walking the tree from the root along the emitted tokens: the root is the target's
    own token, a node of the head's part a head draft, a grafted node a context draft. A repetitive prompt makes
    the context branch accept drafts too."""
    tcfg, tparams = golden_target
    dcfg, dparams = heads["eagle3"]
    tree = DynamicTree(4, 2, 1, context=6, min_match=1)  # the answers fall into loops the context branch follows
    prompts = [reference["p0.input_ids"].tolist(), [5, 6, 7, 8, 9] * 6]
    before, seen = np.zeros(2, int), set()
    for _, tr, state in generation.stream(tparams, dparams, prompts, 96, speculative.DecodeConfig(tcfg, dcfg, tree)):
        counts, out, sources = jax.device_get((state.counts, state.out, state.sources))
        tokens, parents = np.asarray(tr.tokens), np.asarray(tr.parents)
        for row in range(2):
            node, expected = 0, ["target"]
            for token in out[row, before[row] + 1 : counts[row]]:
                node = next(j for j in range(1, tokens.shape[1]) if parents[row, j] == node and tokens[row, j] == token)
                expected.append("head" if node < tree.head_nodes else "context")
            got = [speculative.SOURCES[s] for s in sources[row, before[row] : counts[row]]]
            assert got == expected[: len(got)], (row, got, expected)
            seen |= set(got)
        before = counts
    assert seen == {"target", "head", "context"}

"""The golden Llama target against the official reference, and the cache / batching / tree-mask
invariants that speculative decoding relies on: every way of feeding tokens equals one causal forward."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decoding import schedule
from eagle_jax.errors import EagleError
from eagle_jax.models import kv_cache, target
from eagle_jax.models.config import default_eagle3_layers

TOL = 1e-4
N_PROMPTS = 4
EAGLE3_LAYERS = default_eagle3_layers(8)  # the golden target's EAGLE-3 feature layers: (2, 4, 5)


@functools.partial(jax.jit, static_argnames=("cfg", "feature_layers"))
def fwd(params, cfg, tokens, positions, cache, mask=None, offset=0, feature_layers=EAGLE3_LAYERS):
    return target.forward(params, cfg, tokens, positions, cache, mask, offset, feature_layers)


@pytest.fixture(scope="module")
def model(golden_target):
    cfg, params = golden_target
    return cfg, jax.tree.map(jnp.asarray, params)


BUCKET = 64


def full(model, tokens) -> target.TargetOutput:
    """One causal forward of tokens [B, T] from an empty cache (the reference for everything below).

    Rows are right-padded to one bucket length so that one compiled function serves every call; the
    padding cannot change a causal forward's real positions, and the outputs are cut back to T.
    """
    cfg, params = model
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    assert t <= BUCKET
    padded = np.zeros((b, BUCKET), np.int32)
    padded[:, :t] = tokens
    positions = jnp.broadcast_to(jnp.arange(BUCKET), (b, BUCKET))
    out = fwd(params, cfg, jnp.asarray(padded), positions, target.init_cache(cfg, b, BUCKET))
    return target.TargetOutput(out.logits[:, :t], out.hidden[:, :t], out.features[:, :t], out.cache)


def close(actual, expected, what, tol=TOL):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol, err_msg=what)


def prompt(reference, i) -> np.ndarray:
    return reference[f"p{i}.input_ids"].astype(np.int32)


# ---------------------------------------------------------------- golden reference


@pytest.mark.parametrize("i", range(N_PROMPTS))
def test_golden_reference(model, reference, i):
    cfg, _ = model
    assert EAGLE3_LAYERS == (2, 4, 5)
    out = full(model, prompt(reference, i)[None])
    h = cfg.hidden_size
    close(out.logits[0], reference[f"p{i}.logits"], f"p{i} logits")
    close(out.hidden[0], reference[f"p{i}.hidden_final_norm"], f"p{i} final norm")
    close(out.features[0], reference[f"p{i}.eagle3_fused"], f"p{i} eagle3 fused")
    for j, layer in enumerate(EAGLE3_LAYERS):
        close(
            out.features[0, :, j * h : (j + 1) * h],
            reference[f"p{i}.hidden_layer{layer}_input"],
            f"p{i} input of layer {layer}",
        )


def test_golden_greedy_prefix(model, reference):
    """The first greedy tokens of the reference follow from our logits (argmax of the last position)."""
    for i in range(N_PROMPTS):
        ids = reference[f"p{i}.greedy_ids"].astype(np.int32)
        n = len(prompt(reference, i))
        out = full(model, ids[None, : n + 8])
        np.testing.assert_array_equal(np.argmax(out.logits[0, n - 1 : n + 7], -1), ids[n : n + 8])


def test_explicit_feature_layers(model, reference):
    cfg, params = model
    ids = jnp.asarray(prompt(reference, 1))[None]
    t = ids.shape[1]
    args = (params, cfg, ids, jnp.arange(t)[None], target.init_cache(cfg, 1, t))
    default, sub = fwd(*args), fwd(*args, feature_layers=(5, 2))
    close(
        sub.features[0],
        np.concatenate([reference["p1.hidden_layer5_input"], reference["p1.hidden_layer2_input"]], -1),
        "features of layers (5, 2)",
    )
    close(sub.logits, default.logits, "logits do not depend on the feature layers", tol=0)
    assert sub.features.shape[-1] == 2 * cfg.hidden_size


# ---------------------------------------------------------------- cached decoding


def test_prefill_then_decode_equals_full_forward(model, reference):
    """Prefill 10 tokens, a chunk of 5, then one token per call (advancing the cache after each call):
    every row equals the corresponding row of one full forward. Capacity > length (unused slots masked)."""
    cfg, params = model
    ids = reference["p3.greedy_ids"].astype(np.int32)[:48]
    ref = full(model, ids[None])
    cache = target.init_cache(cfg, 1, 64)
    logits, hidden, features = [], [], []
    chunks = [(0, 10), (10, 15)] + [(t, t + 1) for t in range(15, len(ids))]
    for start, stop in chunks:
        out = fwd(params, cfg, jnp.asarray(ids[None, start:stop]), jnp.arange(start, stop)[None], cache)
        cache = kv_cache.advance(out.cache, jnp.array([stop - start]))
        logits.append(out.logits[0])
        hidden.append(out.hidden[0])
        features.append(out.features[0])
    assert int(cache.lengths[0]) == len(ids)
    close(np.concatenate(logits), ref.logits[0], "cached logits")
    close(np.concatenate(hidden), ref.hidden[0], "cached hidden")
    close(np.concatenate(features), ref.features[0], "cached features")


def test_attention_span_equals_whole_cache(model, reference):
    """Attending over the first `span` slots only (target.prefill spans the prompt) gives the
    whole-cache forward's outputs and cache entries; decoding on with a span gives the full
    forward's logits. Spans outside [1, capacity] are refused."""
    cfg, params = model
    ids = reference["p3.greedy_ids"].astype(np.int32)[:24]
    ref = full(model, ids[None])
    out = target.prefill(params, cfg, jnp.asarray(ids[None, :20]), 40, EAGLE3_LAYERS)
    wide = fwd(params, cfg, jnp.asarray(ids[None, :20]), jnp.arange(20)[None], target.init_cache(cfg, 1, 40))
    assert out.cache.capacity == 40 and int(out.cache.lengths[0]) == 0
    close(out.hidden[0], wide.hidden[0], "prefill hidden")
    close(out.features[0], wide.features[0], "prefill features")
    close(out.cache.k, wide.cache.k, "prefill keys")
    cache = kv_cache.set_lengths(out.cache, jnp.array([20]))
    step = target.forward(params, cfg, jnp.asarray(ids[None, 20:]), jnp.arange(20, 24)[None], cache, span=24)
    close(step.logits[0], ref.logits[0, 20:], "logits over a 24-slot span")
    with pytest.raises(EagleError, match="attention span 41 must lie in"):
        target.forward(params, cfg, jnp.asarray(ids[None, 20:]), jnp.arange(20, 24)[None], cache, span=41)


def test_attention_span_schedule():
    assert [schedule.attention_span(n, 1000) for n in (1, 128, 129, 300, 600)] == [128, 128, 256, 512, 1000]
    assert schedule.attention_span(5, 64) == 64
    for capacity in (1, 64, 128, 129, 384, 1000):
        assert schedule.all_spans(capacity) == sorted(
            {schedule.attention_span(n, capacity) for n in range(1, capacity + 1)}
        )


def test_uncommitted_entries_are_overwritten(model, reference):
    """Without `advance`, a second call writes over the first: a rejected token leaves no trace."""
    cfg, params = model
    ids = prompt(reference, 2)
    ref = full(model, ids[None])
    cache = target.init_cache(cfg, 1, 32)
    out = fwd(params, cfg, jnp.asarray(ids[None, :20]), jnp.arange(20)[None], cache)
    cache = kv_cache.advance(out.cache, jnp.array([20]))
    wrong = fwd(params, cfg, jnp.asarray([[7]]), jnp.array([[20]]), cache)  # not committed
    out = fwd(params, cfg, jnp.asarray(ids[None, 20:]), jnp.arange(20, len(ids))[None], wrong.cache)
    close(out.logits[0], ref.logits[0, 20:], "logits after an uncommitted write")


# ---------------------------------------------------------------- batching


def _padded_batch(reference, pad=0):
    rows = [prompt(reference, i) for i in range(N_PROMPTS)]
    lengths = np.array([len(r) for r in rows], np.int32)
    tokens = np.full((len(rows), lengths.max()), pad, np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return rows, lengths, tokens


def test_batch_of_different_lengths(model, reference):
    """Right-padded rows of different lengths in one call, then per-row lengths (`set_lengths`) and two
    decode steps at per-row positions: every real position equals that row run alone."""
    cfg, params = model
    rows, lengths, tokens = _padded_batch(reference, pad=5)  # a real token id: padding must not leak
    b, t = tokens.shape
    cache = target.init_cache(cfg, b, t + 4)
    out = fwd(params, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), cache)
    for i, n in enumerate(lengths):
        close(out.logits[i, :n], reference[f"p{i}.logits"], f"row {i} logits in a padded batch")
        close(out.hidden[i, :n], reference[f"p{i}.hidden_final_norm"], f"row {i} hidden in a padded batch")
        close(out.features[i, :n], reference[f"p{i}.eagle3_fused"], f"row {i} features in a padded batch")

    cache = kv_cache.set_lengths(out.cache, jnp.asarray(lengths))
    greedy = [reference[f"p{i}.greedy_ids"].astype(np.int32) for i in range(b)]
    for step in range(2):
        nxt = jnp.asarray([[g[n + step]] for g, n in zip(greedy, lengths)])
        pos = jnp.asarray(lengths + step)[:, None]
        out = fwd(params, cfg, nxt, pos, cache)
        cache = kv_cache.advance(out.cache, jnp.ones(b, jnp.int32))
        for i, n in enumerate(lengths):
            alone = full(model, greedy[i][None, : n + step + 1])
            close(out.logits[i, 0], alone.logits[0, -1], f"row {i} decode step {step} logits")
            close(out.hidden[i, 0], alone.hidden[0, -1], f"row {i} decode step {step} hidden")
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + 2)


# ---------------------------------------------------------------- tree verification

# A tree of 8 nodes (root 0): parents[i] < i. Depths: 0, 1, 1, 2, 2, 2, 3, 3.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 5]


def _paths(parents):
    paths = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def _tree_mask(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i, path in enumerate(_paths(parents)):
        mask[i, path] = True
    return mask


def _tree_setup(model, reference):
    """Two rows with different prefixes (padded prefill + set_lengths), each with its own tree tokens."""
    cfg, params = model
    rows, lengths, tokens = _padded_batch(reference)
    pick = [1, 2]
    lengths, tokens = lengths[pick], tokens[pick][:, : lengths[pick].max()]
    b, t = tokens.shape
    n = len(PARENTS)
    cache = target.init_cache(cfg, b, t + n + 4)
    out = fwd(params, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), cache)
    cache = kv_cache.set_lengths(out.cache, jnp.asarray(lengths))
    tree_tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (b, n)).astype(np.int32)
    depth = np.array([len(p) - 1 for p in _paths(PARENTS)])
    positions = lengths[:, None] + depth[None]
    mask = np.broadcast_to(_tree_mask(PARENTS), (b, n, n))
    prefixes = [rows[i] for i in pick]
    return cache, prefixes, tree_tokens, positions, mask


def test_tree_mask_equals_causal_paths(model, reference):
    """One forward over the tree with the ancestor mask = for each node, a causal run of prefix + its path."""
    cfg, params = model
    cache, prefixes, tree_tokens, positions, mask = _tree_setup(model, reference)
    out = fwd(params, cfg, jnp.asarray(tree_tokens), jnp.asarray(positions), cache, jnp.asarray(mask))
    for b, prefix in enumerate(prefixes):
        for node, path in enumerate(_paths(PARENTS)):
            alone = full(model, np.concatenate([prefix, tree_tokens[b, path]])[None])
            close(out.logits[b, node], alone.logits[0, -1], f"row {b} node {node} logits")
            close(out.hidden[b, node], alone.hidden[0, -1], f"row {b} node {node} hidden")
            close(out.features[b, node], alone.features[0, -1], f"row {b} node {node} features")


def test_tree_in_two_calls_with_offset(model, reference):
    """The tree written in two calls (the second at offset 4, seeing the first call's uncommitted entries
    through a [B, T, W=8] mask) equals the single call."""
    cfg, params = model
    cache, _, tree_tokens, positions, mask = _tree_setup(model, reference)
    one = fwd(params, cfg, jnp.asarray(tree_tokens), jnp.asarray(positions), cache, jnp.asarray(mask))
    first = fwd(
        params, cfg, jnp.asarray(tree_tokens[:, :4]), jnp.asarray(positions[:, :4]), cache, jnp.asarray(mask[:, :4, :4])
    )
    second = fwd(
        params,
        cfg,
        jnp.asarray(tree_tokens[:, 4:]),
        jnp.asarray(positions[:, 4:]),
        first.cache,
        jnp.asarray(mask[:, 4:, :]),
        offset=4,
    )
    close(np.concatenate([first.logits, second.logits], 1), one.logits, "two-call tree logits")


def test_accept_path_then_decode(model, reference):
    """Accepting a root-to-leaf path (kv_cache.compact + advance) leaves the cache as if the path had been
    decoded causally: the next token's logits equal a full forward of prefix + path + next."""
    cfg, params = model
    cache, prefixes, tree_tokens, positions, mask = _tree_setup(model, reference)
    out = fwd(params, cfg, jnp.asarray(tree_tokens), jnp.asarray(positions), cache, jnp.asarray(mask))
    accepted = [[0, 2, 5, 7], [0, 1, 3]]  # per-row paths of different lengths, padded with their last node
    width = max(map(len, accepted))
    src = jnp.asarray([p + [p[-1]] * (width - len(p)) for p in accepted])
    cache = kv_cache.compact(out.cache, src)
    cache = kv_cache.advance(cache, jnp.asarray([len(p) for p in accepted]))
    nxt = np.array([[11], [12]], np.int32)
    pos = np.array([[len(prefixes[b]) + len(accepted[b])] for b in range(2)])
    step = fwd(params, cfg, jnp.asarray(nxt), jnp.asarray(pos), cache)
    for b, prefix in enumerate(prefixes):
        alone = full(model, np.concatenate([prefix, tree_tokens[b, accepted[b]], nxt[b]])[None])
        close(step.logits[b, 0], alone.logits[0, -1], f"row {b} logits after accepting {accepted[b]}")

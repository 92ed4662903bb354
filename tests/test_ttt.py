"""EAGLE-3 training objective (TTT): parity with the official code, a plain reference, the vocab map.

- Golden: `ttt.npz` holds one forward/backward of the unmodified official traineagle3 objective on the
  golden target and head (see golden/README.md); losses, accuracies, masks and gradients must match.
- Plain: a deliberately literal float64 numpy version (Python loops over steps and positions, an
  explicit key list per query) checks the same objective on a random tiny head with and without a
  vocabulary map, with padded rows and a rope_theta other than 10000, and on the golden head with its
  config's theta changed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.errors import EagleError
from eagle_jax.io import official
from eagle_jax.models import draft
from eagle_jax.models.config import DraftConfig, RopeConfig, default_eagle3_layers
from eagle_jax.training import objective

STATIC = ("dcfg", "steps", "step_weight")
loss_fn = jax.jit(objective.ttt_loss, static_argnames=STATIC)
grad_fn = jax.jit(objective.ttt_value_and_grad, static_argnames=STATIC)


@pytest.fixture(scope="module")
def golden_ttt(golden_dir):
    return dict(np.load(golden_dir / "ttt.npz"))


@pytest.fixture(scope="module")
def golden_head(golden_dir, golden_target):
    return official.load_head(golden_dir / "eagle3", golden_target[0])


def _batch(z: dict) -> tuple:
    names = ("hidden_states", "target_logits", "input_ids", "attention_mask", "loss_mask")
    return tuple(jnp.asarray(z[n]) for n in names)


def _flat_get(tree, name: str):
    for part in name.split("."):
        tree = tree[int(part)] if isinstance(tree, list) else tree[part]
    return np.asarray(tree)


# ---------------------------------------------------------------- golden parity


def test_target_batch_matches_official(golden_target, golden_ttt):
    tcfg, tparams = golden_target
    z = golden_ttt
    features, logits = jax.jit(objective.target_batch, static_argnums=(1, 4))(
        tparams, tcfg, jnp.asarray(z["input_ids"]), jnp.asarray(z["attention_mask"]), default_eagle3_layers(8)
    )
    np.testing.assert_allclose(features, z["hidden_states"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(logits, z["target_logits"], atol=1e-4, rtol=0)


def test_ttt_matches_official(golden_target, golden_head, golden_ttt):
    dcfg, dparams = golden_head
    z = golden_ttt
    total, metrics, grads = grad_fn(dparams, dcfg, golden_target[1]["embed"], *_batch(z))

    np.testing.assert_allclose(metrics["plosses"], z["plosses"], rtol=1e-5)
    np.testing.assert_allclose(total, z["total_loss"], rtol=1e-5)
    np.testing.assert_allclose(objective.accuracies(metrics), z["acces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(metrics["acces"], z["acces"], rtol=1e-6)
    np.testing.assert_array_equal(metrics["n_counted"], z["step_n_counted"])
    np.testing.assert_array_equal(metrics["loss_mask_sum"], z["step_loss_mask_sum"])
    masks = objective.position_masks(dparams, dcfg, jnp.asarray(z["target_logits"]), jnp.asarray(z["loss_mask"]))
    np.testing.assert_array_equal(masks, z["step_position_mask"])

    # gradients: exactly the 13 trainable tensors, each within 1e-5 of its norm
    ours = {theirs: (name, transposed) for name, (theirs, transposed) in official.official_names(dcfg).items()}
    assert sorted(map(str, z["param_names"])) == sorted(k for k in ours if k not in ("d2t", "t2d"))
    assert "d2t" not in grads and "t2d" not in grads
    norms = []
    for theirs, ref_norm in zip(map(str, z["param_names"]), z["grad_norms"]):
        name, transposed = ours[theirs]
        g = _flat_get(grads, name)
        g = g.T if transposed else g
        ref = z[f"grad.{theirs}"]
        assert np.abs(g - ref).max() <= 1e-5 * np.linalg.norm(ref), theirs
        norms.append(np.linalg.norm(g.astype(np.float64)))
        np.testing.assert_allclose(norms[-1], ref_norm, rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(np.sum(np.square(norms))), z["grad_norm_total"], rtol=1e-5)

    # the "rope base from config" variant of the official run (theta = 10000 here, so identical)
    assert dcfg.rope.theta == 10000.0
    np.testing.assert_allclose(metrics["plosses"], z["ropecfg.plosses"], rtol=1e-5)
    np.testing.assert_allclose(objective.accuracies(metrics), z["ropecfg.acces"], atol=1e-9)
    np.testing.assert_allclose(total, z["ropecfg.total_loss"], rtol=1e-5)
    np.testing.assert_allclose(norms, z["ropecfg.grad_norms"], rtol=1e-5)
    np.testing.assert_allclose(np.sqrt(np.sum(np.square(norms))), z["ropecfg.grad_norm_total"], rtol=1e-5)
    assert objective.simulated_tau(metrics["acces"]) == pytest.approx(1 + np.sum(np.cumprod(z["acces"])), rel=1e-6)


def test_rope_theta_comes_from_head_config(golden_dir, golden_target, golden_ttt, tmp_path):
    """A head whose config says rope_theta = 1e6 trains with base 1e6 (upstream hard-codes 10000)."""
    cfg = json.loads((golden_dir / "eagle3" / "config.json").read_text())
    cfg["rope_theta"] = 1e6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(golden_dir / "eagle3" / "model.safetensors", tmp_path)
    dcfg, dparams = official.load_head(tmp_path, golden_target[0])
    assert dcfg.rope.theta == 1e6
    z = golden_ttt
    embed = golden_target[1]["embed"]
    total, metrics = loss_fn(dparams, dcfg, embed, *_batch(z))
    ref = plain_ttt(_np64(dparams), dcfg, np.asarray(embed, np.float64), *(np.asarray(x) for x in _batch(z)))
    np.testing.assert_allclose(metrics["plosses"], ref["plosses"], rtol=2e-5)
    np.testing.assert_allclose(objective.accuracies(metrics), ref["acces"], atol=1e-9)
    np.testing.assert_allclose(total, ref["total"], rtol=2e-5)
    assert abs(float(total) / float(z["total_loss"]) - 1) > 1e-3  # differs from the hard-coded base


# ---------------------------------------------------------------- plain float64 reference


def _np64(tree):
    return jax.tree.map(
        lambda x: np.asarray(x, np.float64) if np.issubdtype(x.dtype, np.floating) else np.asarray(x), tree
    )


def plain_ttt(
    P: dict,
    c: DraftConfig,
    embed,
    features,
    target_logits,
    input_ids,
    attention_mask,
    loss_mask,
    steps: int = 7,
    step_weight: float = 0.8,
) -> dict:
    """The objective as written in golden/README.md, one (step, row, position) at a time, in float64."""
    B, T = input_ids.shape
    V = target_logits.shape[-1]
    L = P["layers"][0]
    nh, nkv, hd, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    t2d = P["t2d"] if c.has_vocab_map else np.ones(V, bool)
    columns = [v for v in range(V) if t2d[v]]

    def rms(x, w):
        return w * (x / np.sqrt(np.mean(x * x) + eps))

    def rope(x, pos):  # x [heads, hd]
        angles = pos / c.rope.theta ** (np.arange(0, hd, 2) / hd)
        angles = np.concatenate([angles, angles])
        rotated = np.concatenate([-x[:, hd // 2 :], x[:, : hd // 2]], axis=1)
        return x * np.cos(angles) + rotated * np.sin(angles)

    def softmax(x):
        e = np.exp(x - x.max())
        return e / e.sum()

    def silu(x):
        return x / (1 + np.exp(-x))

    h = {(b, t): features[b, t] @ P["fc"] for b in range(B) for t in range(T)}
    keys = {}  # (b, step, t) -> (k [nkv, hd], v [nkv, hd])
    plosses, acces, counted, gaps = [], [], [], []
    for j in range(steps):
        queries = {}
        for b in range(B):
            for t in range(T):
                tok = input_ids[b, t + j + 1] if t + j + 1 < T else 0
                x = np.concatenate([rms(embed[tok], L["input_norm"]), rms(h[b, t], L["hidden_norm"])])
                queries[b, t] = rope((x @ L["q"]).reshape(nh, hd), t + j)
                keys[b, j, t] = (rope((x @ L["k"]).reshape(nkv, hd), t + j), (x @ L["v"]).reshape(nkv, hd))
        new_h = {}
        for b in range(B):
            for t in range(T):
                seen = [keys[b, 0, s] for s in range(t + 1) if attention_mask[b, s]]
                seen += [keys[b, i, t] for i in range(1, j + 1)]
                out = np.zeros((nh, hd))
                for n in range(nh):
                    g = n // (nh // nkv)
                    weights = softmax(np.array([queries[b, t][n] @ k[g] for k, _ in seen]) / np.sqrt(hd))
                    out[n] = sum(w * v[g] for w, (_, v) in zip(weights, seen))
                a = h[b, t] + out.reshape(-1) @ L["o"]
                m = rms(a, L["mlp_norm"])
                new_h[b, t] = a + (silu(m @ L["mlp"]["gate"]) * (m @ L["mlp"]["up"])) @ L["mlp"]["down"]
        h = new_h
        loss = correct = n_counted = lm_sum = 0.0
        for b in range(B):
            for t in range(T):
                logits = rms(h[b, t], P["norm"]) @ P["lm_head"]
                logq = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
                tgt = target_logits[b, t + j + 1] if t + j + 1 < T else np.zeros(V)
                p = softmax(tgt[columns].astype(np.float64))
                lm = loss_mask[b, t + j] if t + j < T else 0
                mask = float(t2d[np.argmax(tgt)]) * lm
                loss -= mask * np.sum(p * logq)
                correct += mask * (np.argmax(logq) == np.argmax(p))
                n_counted += mask
                lm_sum += lm
                if mask:
                    top2 = np.sort(logits)[-2:]
                    gaps.append(top2[1] - top2[0])
        plosses.append(loss / (B * T))
        acces.append(correct / (lm_sum + 1e-6))
        counted.append(n_counted)
    total = sum(step_weight**j * plosses[j] for j in range(steps))
    return dict(
        plosses=np.array(plosses), acces=np.array(acces), n_counted=np.array(counted), total=total, min_gap=min(gaps)
    )


def _random_head(rng: np.random.Generator, draft_vocab_size: int) -> tuple[DraftConfig, dict]:
    c = DraftConfig(
        kind="eagle3",
        hidden_size=16,
        intermediate_size=24,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=50.0),
        vocab_size=40,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=16,
    )
    specs = draft.param_specs(c)

    def init(spec):
        if spec.init == "ones":
            return (1 + 0.2 * rng.standard_normal(spec.shape)).astype(np.float32)
        return (0.4 * rng.standard_normal(spec.shape)).astype(np.float32)

    params = {k: v for k, v in specs.items() if k not in ("d2t", "t2d")}
    params = jax.tree.map(init, params, is_leaf=lambda x: hasattr(x, "init"))
    if c.has_vocab_map:
        counts = rng.integers(1, 50, c.vocab_size)
        counts[0] = 1000  # id 0 (the argmax of a zero target row) is in the draft vocabulary
        params["d2t"], params["t2d"] = objective.build_vocab_map(counts, c.draft_vocab_size)
    return c, params


@pytest.mark.parametrize("draft_vocab_size", [12, 40], ids=["vocab_map", "full_vocab"])
def test_matches_plain_reference(draft_vocab_size):
    rng = np.random.default_rng(7)
    c, params = _random_head(rng, draft_vocab_size)
    B, T, V = 3, 10, c.vocab_size
    lengths = np.array([10, 7, 4])
    real = np.arange(T)[None, :] < lengths[:, None]
    input_ids = np.where(real, rng.integers(1, V, (B, T)), 0)
    attention_mask = real.astype(np.int64)
    loss_mask = (real & (rng.random((B, T)) < 0.8)).astype(np.int64)
    loss_mask[:, 0] = 0
    target_logits = 2 * rng.standard_normal((B, T, V)).astype(np.float32)
    boost = rng.random((B, T)) < 0.5  # half the rows peak inside the draft vocabulary
    target_logits[..., params.get("t2d", slice(None))] += 3 * boost[..., None]
    embed = rng.standard_normal((V, c.hidden_size)).astype(np.float32)
    features = rng.standard_normal((B, T, 3 * c.target_hidden_size)).astype(np.float32)
    args = (features, target_logits, input_ids, attention_mask, loss_mask)

    ref = plain_ttt(_np64(params), c, embed.astype(np.float64), *args, steps=5, step_weight=0.7)
    assert ref["min_gap"] > 1e-4 and ref["n_counted"].min() > 0  # argmaxes are safe in float32

    # one compiled pass also differentiates the frozen inputs: embedding, target features and logits
    def loss(embed, features, target_logits):
        return objective.ttt_loss(params, c, embed, features, target_logits, *args[2:], steps=5, step_weight=0.7)

    (total, metrics), frozen = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        jnp.asarray(embed), jnp.asarray(features), jnp.asarray(target_logits)
    )
    np.testing.assert_allclose(metrics["plosses"], ref["plosses"], rtol=1e-5)
    np.testing.assert_allclose(total, ref["total"], rtol=1e-5)
    np.testing.assert_allclose(objective.accuracies(metrics), ref["acces"], atol=1e-9)
    np.testing.assert_array_equal(metrics["n_counted"], ref["n_counted"])
    assert all(not np.any(np.asarray(g)) for g in frozen)

    _, one = loss_fn(params, c, jnp.asarray(embed), *map(jnp.asarray, args), steps=1)
    np.testing.assert_allclose(one["plosses"], ref["plosses"][:1], rtol=1e-5)

    # read out only at the loss positions (one group, or one per sequence as on a data=3 mesh; padded to a quarter
    # of a group), as training does: the same loss, counts and gradients as reading out everywhere
    everywhere = grad_fn(params, c, embed, *args, steps=5, step_weight=0.7)
    for groups in (1, B):
        loss_at = objective.loss_positions(loss_mask, groups)
        assert np.sum(loss_at == B // groups * T) > 0 and loss_at.size < B * T  # padding slots and a saving
        compact = grad_fn(params, c, embed, *args, loss_at, steps=5, step_weight=0.7)
        np.testing.assert_allclose(compact[0], everywhere[0], rtol=1e-6)
        np.testing.assert_allclose(compact[1]["plosses"], ref["plosses"], rtol=1e-5)
        for name in ("n_correct", "n_counted", "loss_mask_sum"):
            np.testing.assert_array_equal(compact[1][name], everywhere[1][name])
        for got, want in zip(jax.tree.leaves(compact[2]), jax.tree.leaves(everywhere[2])):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- vocabulary map and metrics


def test_build_vocab_map_ties_and_formula():
    counts = np.array([0, 5, 3, 5, 0, 3, 1, 3])
    d2t, t2d = objective.build_vocab_map(counts, 4)
    # counts 5 (ids 1, 3) then three ids with 3: ties go to the lower id (2 before 5 and 7)
    assert np.flatnonzero(t2d).tolist() == [1, 2, 3, 5]
    assert d2t.dtype == np.int32 and t2d.dtype == np.bool_
    assert (d2t + np.arange(4)).tolist() == [1, 2, 3, 5]

    # with first occurrences, ties follow Counter.most_common (insertion order), as upstream
    stream = [7, 3, 1, 5, 1, 2, 3, 7, 1, 5, 3, 2, 1, 3, 1, 6]  # 1:5, 3:4, then 7, 5, 2: 2 each
    used = sorted(k for k, _ in Counter(stream).most_common(4))
    counts = np.bincount(stream, minlength=8)
    first_seen = np.array([stream.index(v) if v in stream else len(stream) for v in range(8)])
    d2t, t2d = objective.build_vocab_map(counts, 4, first_seen)
    assert used == [1, 3, 5, 7] and np.flatnonzero(t2d).tolist() == used
    assert (d2t + np.arange(4)).tolist() == used
    assert np.flatnonzero(objective.build_vocab_map(counts, 4)[1]).tolist() == [1, 2, 3, 5]  # by id instead


def test_build_vocab_map_fewer_seen_tokens_than_draft_vocab():
    with pytest.raises(EagleError, match="only 3 distinct tokens"):
        objective.build_vocab_map(np.array([0, 4, 0, 1, 2, 0]), 4)
    d2t, t2d = objective.build_vocab_map(np.array([0, 4, 0, 1, 2, 0]), 3)
    assert np.flatnonzero(t2d).tolist() == [1, 3, 4] and d2t.tolist() == [1, 2, 2]


def test_draft_columns_follow_the_head_map(golden_head):
    dcfg, dparams = golden_head
    np.testing.assert_array_equal(objective.draft_columns(dparams, dcfg), np.flatnonzero(np.asarray(dparams["t2d"])))
    no_map = dataclasses.replace(dcfg, draft_vocab_size=dcfg.vocab_size)
    np.testing.assert_array_equal(objective.draft_columns({}, no_map), np.arange(dcfg.vocab_size))


def test_simulated_tau():
    assert float(objective.simulated_tau(jnp.array([1.0, 0.5, 0.5]))) == pytest.approx(2.75)
    assert float(objective.simulated_tau(jnp.zeros(7))) == 1.0


def test_ttt_rejects_eagle1_config(golden_dir, golden_target):
    c1, p1 = official.load_head(golden_dir / "eagle1", golden_target[0])
    with pytest.raises(EagleError, match="EAGLE-3"):
        objective.ttt_loss(p1, c1, None, None, None, jnp.zeros((1, 4), jnp.int32), None, None)


@pytest.mark.parametrize("steps", [1, 3])
def test_ttt_flops_agree_with_the_compilers_count(golden_target, steps):
    """`ttt_flops` (the training log's model FLOPs) against XLA's cost analysis of the compiled step on unpadded
    sequences, within 5%, once the masked half of the attention that XLA computes is added (every TTT step is
    counted: they are unrolled)."""
    from eagle_jax.models.config import eagle3_head_like
    from eagle_jax.models.params import abstract_params

    tcfg = golden_target[0]
    dcfg = eagle3_head_like(tcfg, 256)
    b, t, h = 2, 256, tcfg.hidden_size  # long enough for attention to matter (about a fifth)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    i32 = jax.ShapeDtypeStruct((b, t), jnp.int32)
    targets = objective.Targets(f32(1, b * t, 256), jax.ShapeDtypeStruct((1, b * t), jnp.int32))
    step = jax.jit(lambda p, *a: objective.ttt_value_and_grad(p, dcfg, *a, steps=steps))
    compiled = step.lower(
        abstract_params(draft.param_specs(dcfg)), f32(tcfg.vocab_size, h), f32(b, t, 3 * h), targets, i32, i32, i32
    ).compile()
    cost = compiled.cost_analysis()
    counted = (cost[0] if isinstance(cost, list) else cost)["flops"]
    masked = 3 * 4 * dcfg.num_heads * dcfg.head_dim * b * steps * (t * t - t * (t + 1) / 2)  # XLA multiplies them too
    assert objective.ttt_flops(dcfg, steps, np.full(b, t)) + masked == pytest.approx(counted, rel=0.05)

"""Weight-only int8 targets (`models.quantize`, qwix): speculation stays lossless against the quantised target
(greedy here; sampling in test_engine's int8 case), on one device and on a mesh; the weights are int8 with one
scale per output column and the memory plan counts them so; bad methods and targets are refused in one line."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from procs import finish, launch
from tiny import plain_generate, tiny_draft, tiny_target

from cli import plan
from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.tree import DynamicTree, StaticTree
from eagle_jax.errors import EagleError
from eagle_jax.models import quantize, target
from eagle_jax.parallel import sharding
from eagle_jax.parallel.memory import abstract, device_bytes

CASES = [  # family, head, envelope, tied
    ("llama", "eagle3", DynamicTree(16, 4, 4), False),
    ("qwen2", "eagle1", StaticTree(), True),
]


def _int8(family: str, tied: bool, seed: int = 3):
    tcfg, tparams = tiny_target(family, seed=seed, vocab=48, tied=tied)
    return (tcfg, tparams), quantize.quantize_target(tcfg, tparams, "int8")


@pytest.mark.parametrize("family,kind,envelope,tied", CASES)
def test_speculation_is_lossless_against_the_int8_target(family, kind, envelope, tied):
    (tcfg, tparams), (qcfg, qparams) = _int8(family, tied)
    dcfg, dparams = tiny_draft(kind, tcfg, seed=4, draft_vocab=32 if kind == "eagle3" else None)
    prompts = [[5, 9, 2, 7, 11, 3, 8, 1, 4], [6, 2], [30, 31, 32, 30, 31, 32, 30, 31]]
    want = plain_generate(qparams, qcfg, prompts, 24).tokens
    res = generation.generate(qparams, dparams, prompts, 24, speculative.DecodeConfig(qcfg, dcfg, envelope))
    assert res.tokens == want
    assert sum(a for row in res.accept_lengths for a in row) > 0  # the float head drafts for the int8 target

    q = qparams["layers"][0]["q"]  # int8 values, a scale per output column, the dequantised weight close
    w = np.asarray(tparams["layers"][0]["q"])
    assert q.qvalue.dtype == jnp.int8 and q.scale.shape == (1, w.shape[1]) and q.scale.dtype == w.dtype
    assert np.abs(np.asarray(q.qvalue)).max() == 127
    np.testing.assert_allclose(np.asarray(q.qvalue) * np.asarray(q.scale), w, atol=float(np.abs(w).max()) / 200)
    assert ("lm_head" in qparams) != tied and not isinstance(qparams["embed"], qwix.QArray)
    ids = jnp.asarray([prompts[0]])
    logits = [
        target.forward(p, c, ids, jnp.arange(ids.shape[1])[None], target.init_cache(c, 1, 16, jnp.float32)).logits
        for c, p in ((tcfg, tparams), (qcfg, qparams))
    ]
    gap = float(jnp.abs(logits[0] - logits[1]).max())
    assert 0 < gap < 0.2 * float(jnp.abs(logits[0]).max())  # quantised, and near the float target (tiny, random)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_every_float_dtype_quantises_alike(dtype):
    """The same int8 values from a weight in any floating dtype, a scale in that dtype, dequantised within a step
    of the weight (half a step, and the rounding of scale and product in bf16)."""
    w = jax.random.normal(jax.random.key(0), (64, 48), jnp.float32) * 0.05
    q = quantize.weight(w.astype(dtype))
    want = quantize.weight(w)
    assert q.scale.dtype == dtype and np.mean(np.asarray(q.qvalue) == np.asarray(want.qvalue)) > 0.9
    step = np.asarray(want.scale, np.float32)
    error = np.abs(np.asarray(qwix.dequantize(q), np.float32) - np.asarray(w.astype(dtype), np.float32))
    assert (error <= step).all(), float((error / step).max())


def test_int8_on_a_mesh_equals_one_device():
    tcfg, tparams = tiny_target("llama", 0, vocab=64, hidden=64, heads=8, kv_heads=4)
    qcfg, qparams = quantize.quantize_target(tcfg, tparams, "int8")
    dcfg, dparams = tiny_draft("eagle3", tcfg, 1, draft_vocab=48)
    cfg = speculative.DecodeConfig(qcfg, dcfg, DynamicTree(8, 2, 3))
    prompts = [[3, 9, 4], [7, 1, 1, 5, 2, 8], [2, 6], [12, 13, 14, 15]]
    mesh = sharding.make_mesh("tensor=4,data=2", jax.devices()[:8])
    placed = sharding.place(qparams, sharding.target_shardings(qcfg, mesh))
    assert placed["layers"][0]["q"].scale.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    got = generation.generate(placed, dparams, prompts, 8, cfg, mesh=mesh)
    assert got.tokens == generation.generate(qparams, dparams, prompts, 8, cfg).tokens


def test_the_memory_plan_counts_int8_weights():
    """Bytes as `infer.plan` counts them (abstract weights placed on a mesh, here of one device)."""
    tcfg, _ = tiny_target("llama", 0, vocab=64, hidden=64, heads=8, kv_heads=4, tied=False)
    cfgs = (tcfg, dataclasses.replace(tcfg, quantize="int8"))
    mesh = sharding.make_mesh("tensor=1", jax.devices()[:1])
    specs = {c.quantize: target.param_specs(c, jnp.bfloat16) for c in cfgs}
    sizes = {c.quantize: device_bytes(abstract(specs[c.quantize], sharding.target_shardings(c, mesh))) for c in cfgs}
    is_q = lambda x: isinstance(x, qwix.QArray)  # noqa: E731
    covered = [q.qvalue.shape for q in jax.tree.leaves(specs["int8"], is_leaf=is_q) if is_q(q)]
    assert len(covered) == 7 * tcfg.num_layers + 1  # q k v o gate up down per layer, and the lm_head
    weights, columns = sum(a * b for a, b in covered), sum(b for _, b in covered)
    assert sizes[None] - sizes["int8"] == weights - 2 * columns  # bf16 -> int8, and a bf16 scale per column


def test_bad_methods_and_targets_are_refused():
    tcfg, tparams = tiny_target("llama", 0, vocab=48)
    with pytest.raises(EagleError, match="'int4' is not a method here; choose from int8") as err:
        quantize.quantize_target(tcfg, tparams, "int4")
    assert err.value.setting == "quantize"
    moe, _ = tiny_target("mixtral", 0, vocab=48)
    with pytest.raises(EagleError, match="int8 covers dense targets only"):
        quantize.check(moe, "int8")


def test_the_command_names_the_flag(golden_dir):
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    code, _, err = finish(
        launch(["--target", str(golden_dir / "target"), "--no-spec", "--prompt-ids", "5,6", "--quantize", "int4"], env)
    )
    assert (
        code == 2 and err.strip().splitlines()[-1] == "error: --quantize: 'int4' is not a method here; choose from int8"
    )


def test_the_plan_command_plans_int8_weights(capsys, golden_dir):
    """infer.plan --quantize int8 on the golden target: its layers' weights planned as int8 (the tied embedding
    stays float32); a training plan with a quantised target is refused."""
    args = ["--target", str(golden_dir / "target"), "--mesh", "tensor=4,data=2", "--batch", "2", "--max-len", "128"]
    args += ["--dtype", "fp32", "--draft-vocab-size", "512"]
    resident = {}
    for extra in ([], ["--quantize", "int8"]):
        assert plan.main(args + extra) == 0
        resident[bool(extra)] = float(re.search(r"target parameters +([0-9.]+) MiB", capsys.readouterr().out)[1])
    assert 0.2 < resident[True] / resident[False] < 0.8, resident
    assert plan.main(args + ["--train", "--quantize", "int8"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "error: --quantize: training reads a float target: leave --quantize out of --train"
    )


def test_a_quantised_store_loads_as_quantised_at_load_time(tmp_path, golden_dir):
    """convert --quantize int8 stores the int8 weights once; loading them needs the flag, and gives what
    quantising at load time gives."""
    from eagle_jax.io import convert, loading, store

    out = convert.convert(golden_dir / "target", None, tmp_path / "store", progress=False, quantize="int8")
    assert store.read_manifest(out).target_quantize == "int8"
    cfg, params = loading.load_target(out, quantize="int8")
    want_cfg, want = loading.load_target(golden_dir / "target", quantize="int8")
    assert cfg == want_cfg and jax.tree.structure(params) == jax.tree.structure(want)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
    with pytest.raises(EagleError, match=r"the target is stored quantised \(int8\): load it so") as err:
        loading.load_target(out)
    assert err.value.setting == "quantize"

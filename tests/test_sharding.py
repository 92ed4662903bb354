"""Sharding on 8 virtual CPU devices: sharded generation equals unsharded, the TTT loss equals the
single-device loss, mesh errors, multi-host detection and the compiled memory plan."""

from __future__ import annotations

import dataclasses
import re
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import plain_generate, tiny_draft, tiny_target

from cli import plan
from eagle_jax.decoding import generation, programs, speculative
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.parallel import distributed, sharding
from eagle_jax.training import objective, step

SPEC = DynamicTree(8, 2, 3)
MESHES = ["tensor=4,data=2", "tensor=8", "data=8"]


@pytest.fixture(scope="module")
def models():
    """8 heads and 4 kv heads: tensor=4 splits the kv heads, tensor=8 replicates them."""
    tcfg, tparams = tiny_target("llama", 0, vocab=64, hidden=64, heads=8, kv_heads=4)
    dcfg, dparams = tiny_draft("eagle3", tcfg, 1, draft_vocab=48)
    return tcfg, tparams, dcfg, dparams


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 64, size=int(rng.integers(3, 14))).tolist() for _ in range(8)]


@pytest.fixture(scope="module")
def unsharded(models, prompts):
    tcfg, tparams, dcfg, dparams = models
    return {
        b: generation.generate(tparams, dparams, prompts[:b], 24, speculative.DecodeConfig(tcfg, dcfg, SPEC))
        for b in (1, 8)
    }


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mesh_text", MESHES)
def test_speculative_sharded_equals_unsharded(mesh_text, batch, models, prompts, unsharded):
    tcfg, tparams, dcfg, dparams = models
    mesh = sharding.make_mesh(mesh_text)
    got = generation.generate(
        tparams, dparams, prompts[:batch], 24, speculative.DecodeConfig(tcfg, dcfg, SPEC), mesh=mesh
    )
    want = unsharded[batch]
    assert got.tokens == want.tokens
    assert got.accept_lengths == want.accept_lengths
    assert got.stop_reasons == want.stop_reasons


def test_sampling_on_a_mesh_equals_unsharded(models, prompts):
    """A seeded speculative sample is the same on tensor=4,data=2 as on one device (random bits do not depend on
    the layout), and differs from another seed's."""
    tcfg, tparams, dcfg, dparams = models
    sc = SamplingConfig(1.0, top_p=0.9)
    want = generation.generate(tparams, dparams, prompts, 16, speculative.DecodeConfig(tcfg, dcfg, SPEC, sc), seed=4)
    got = generation.generate(
        tparams,
        dparams,
        prompts,
        16,
        speculative.DecodeConfig(tcfg, dcfg, SPEC, sc),
        seed=4,
        mesh=sharding.make_mesh("tensor=4,data=2"),
    )
    assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths
    assert (
        generation.generate(
            tparams, dparams, prompts, 16, speculative.DecodeConfig(tcfg, dcfg, SPEC, sc), seed=5
        ).tokens
        != want.tokens
    )


def test_plain_sharded_equals_unsharded(models, prompts):
    """Three rows on data=2 (one idle pad row), kv heads split over tensor=4."""
    tcfg, tparams, _, _ = models
    want = plain_generate(tparams, tcfg, prompts[:3], 16)
    got = generation.generate(
        tparams,
        None,
        prompts[:3],
        16,
        speculative.DecodeConfig(tcfg, None, PLAIN),
        mesh=sharding.make_mesh("tensor=4,data=2"),
    )
    assert got.tokens == want.tokens and got.stop_reasons == want.stop_reasons


def test_placements(models):
    tcfg, _, dcfg, _ = models
    rows = ("data", "fsdp")
    split = programs.spec_state_shardings(tcfg, dcfg, sharding.make_mesh("tensor=4,data=2"))
    assert split.target_cache.k.spec == P(None, rows, "tensor", None, None)
    assert split.draft_cache.v.spec == P(None, rows, "tensor", None, None)
    assert split.out.spec == P(rows, None) and split.accept_lengths.spec == P(None, rows) and split.key.spec == P()
    replicated_kv = programs.cache_shardings(tcfg.num_kv_heads, sharding.make_mesh("tensor=8"))
    assert replicated_kv.k.spec == P(None, rows, None, None, None)
    tsh = sharding.target_shardings(tcfg, sharding.make_mesh("tensor=8"))
    assert tsh["layers"][0]["q"].spec == P(None, "tensor")
    assert tsh["layers"][0]["k"].spec == P(None, None)  # 4 kv heads < tensor=8: replicated, not cut inside a head
    assert tsh["layers"][0]["mlp"]["down"].spec == P("tensor", None)
    assert tsh["embed"].spec == P("tensor", None)


def test_ttt_loss_sharded_equals_single_device(models):
    """data=2, fsdp=2, tensor=2, 3 TTT steps: the loss agrees to rtol 1e-5 (f32; only the reduction order
    differs), the accuracy counts exactly and the gradients to atol 5e-5 (they are ~1e-2 and
    sum terms that cancel, so the order of the sharded reductions shows at ~1e-5)."""
    tcfg, tparams, dcfg, dparams = models
    rng = np.random.default_rng(1)
    b, t = 4, 16
    ids = rng.integers(1, tcfg.vocab_size, size=(b, t)).astype(np.int32)
    attn = (np.arange(t)[None, :] < np.array([16, 12, 9, 16])[:, None]).astype(np.int32)
    loss_mask = attn * (np.arange(t)[None, :] >= 3)

    def step(tparams, dparams, ids, attn, loss_mask):
        features, logits = objective.target_batch(tparams, tcfg, ids, attn, dcfg.feature_layers(tcfg))
        return objective.ttt_value_and_grad(
            dparams, dcfg, tparams["embed"], features, logits, ids, attn, loss_mask, steps=3
        )

    want = jax.jit(step)(tparams, dparams, ids, attn, loss_mask)
    mesh = sharding.make_mesh("data=2,fsdp=2,tensor=2")
    sharding.check_mesh(mesh, tcfg, dcfg, b)
    tsh, dsh = sharding.target_shardings(tcfg, mesh), sharding.draft_shardings(dcfg, mesh)
    rows = NamedSharding(mesh, sharding.partition_spec(("batch", None)))
    sharded = jax.jit(step, in_shardings=(tsh, dsh, rows, rows, rows))
    args = (
        sharding.place(tparams, tsh),
        sharding.place(dparams, dsh),
        *(sharding.put(x, rows) for x in (ids, attn, loss_mask)),
    )
    got = sharded(*args)
    assert args[0]["layers"][0]["q"].sharding.spec == P("fsdp", "tensor")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_array_equal(got[1]["n_correct"], want[1]["n_correct"])
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-4, atol=5e-5), got[2], want[2])


# ---------------------------------------------------------------- mesh errors


@pytest.mark.parametrize(
    "text, message",
    [
        ("tensor=4,model=2", "bad mesh entry 'model=2'"),
        ("tensor=x", "bad mesh entry 'tensor=x'"),
        ("tensor=0", "bad mesh entry 'tensor=0'"),
        ("tensor", "bad mesh entry 'tensor'"),
        ("tensor=2,tensor=4", "axis tensor is given twice"),
        ("tensor=3", "tensor=3 does not divide the 8 devices"),
        ("data=2,tensor=2", "needs 4 devices but 8 are available"),
    ],
)
def test_mesh_parser_errors(text, message):
    with pytest.raises(EagleError, match=message):
        sharding.make_mesh(text)


def test_mesh_parser_accepts():
    assert sharding.parse_mesh(" data=2, tensor=4 ") == {"data": 2, "fsdp": 1, "tensor": 4}
    assert dict(sharding.make_mesh("fsdp=8").shape) == {"data": 1, "fsdp": 8, "tensor": 1}


@pytest.mark.parametrize(
    "change, mesh_text, message",
    [
        (
            dict(num_heads=6, num_kv_heads=2, head_dim=8),
            "tensor=4,data=2",
            r"tensor=4 does not divide heads=6 of the target",
        ),
        (
            dict(num_heads=12, num_kv_heads=6, head_dim=8),
            "tensor=4,data=2",
            r"tensor=4 does not divide kv_heads=6 of the target",
        ),
        (dict(vocab_size=60), "tensor=8", r"tensor=8 does not divide vocab=60 of the target"),
        (dict(intermediate_size=100), "tensor=8", r"tensor=8 does not divide mlp=100 of the target"),
        (dict(hidden_size=36, num_heads=4, num_kv_heads=4, head_dim=9), "fsdp=8", r"fsdp=8 does not divide embed=36"),
    ],
)
def test_model_dimension_errors(change, mesh_text, message, models):
    tcfg = dataclasses.replace(models[0], **change)
    with pytest.raises(EagleError, match=message):
        sharding.check_mesh(sharding.make_mesh(mesh_text), tcfg)


def test_batch_and_draft_errors(models):
    tcfg, _, dcfg, _ = models
    with pytest.raises(EagleError, match=r"mesh data=8 does not divide batch=6 of the inputs"):
        sharding.check_mesh(sharding.make_mesh("data=8"), tcfg, dcfg, batch=6)
    with pytest.raises(EagleError, match=r"mesh data=2,fsdp=2 does not divide batch=6"):
        sharding.check_mesh(sharding.make_mesh("data=2,fsdp=2,tensor=2"), tcfg, dcfg, batch=6)
    with pytest.raises(EagleError, match=r"tensor=8 does not divide draft_vocab=20 of the draft head"):
        sharding.check_mesh(sharding.make_mesh("tensor=8"), tcfg, dataclasses.replace(dcfg, draft_vocab_size=20))
    # fewer kv heads than tensor: replicated, not an error
    sharding.check_mesh(sharding.make_mesh("tensor=8"), dataclasses.replace(tcfg, num_kv_heads=2), dcfg, batch=1)


# ---------------------------------------------------------------- multi-host start


@pytest.mark.parametrize(
    "env, reason, kwargs",
    [
        ({}, None, None),
        ({"TPU_WORKER_HOSTNAMES": "t1v-0"}, None, None),
        ({"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1,t1v-2,t1v-3"}, "TPU_WORKER_HOSTNAMES lists 4 TPU hosts", {}),
        ({"TPU_PROCESS_ADDRESSES": "a:8476,b:8476"}, "TPU_PROCESS_ADDRESSES lists 2 TPU hosts", {}),
        ({"MEGASCALE_NUM_SLICES": "2"}, "MEGASCALE_NUM_SLICES=2", {}),
        ({"MEGASCALE_NUM_SLICES": "1"}, None, None),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.2:8080"}, "MEGASCALE_COORDINATOR_ADDRESS", {}),
        ({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234"}, "JAX_COORDINATOR_ADDRESS", {}),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, "SLURM job with SLURM_NTASKS=4", {}),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None, None),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI job with OMPI_COMM_WORLD_SIZE=2", {}),
        (
            {"COORDINATOR_ADDRESS": "h0:1234", "NUM_PROCESSES": "2", "PROCESS_ID": "1"},
            "COORDINATOR_ADDRESS with 2 processes",
            {"coordinator_address": "h0:1234", "num_processes": 2, "process_id": 1},
        ),
        ({"COORDINATOR_ADDRESS": "h0:1234", "NUM_PROCESSES": "1", "PROCESS_ID": "0"}, None, None),
        ({"EAGLE_JAX_DISTRIBUTED": "1"}, "EAGLE_JAX_DISTRIBUTED=1", {}),
        ({"EAGLE_JAX_DISTRIBUTED": "0", "TPU_WORKER_HOSTNAMES": "a,b"}, None, None),
    ],
)
def test_maybe_initialize(env, reason, kwargs, monkeypatch):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    assert distributed.maybe_initialize(env) == reason
    assert calls == ([] if kwargs is None else [kwargs])


def test_maybe_initialize_once_and_errors(monkeypatch):
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: pytest.fail("initialised twice"))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    assert distributed.maybe_initialize({"TPU_WORKER_HOSTNAMES": "a,b"}) is None
    for env, message in [
        ({"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2"}, "PROCESS_ID is not"),
        ({"COORDINATOR_ADDRESS": "h:1", "NUM_PROCESSES": "2", "PROCESS_ID": "2"}, r"PROCESS_ID=2 must lie"),
        ({"SLURM_JOB_ID": "1", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' must be"),
        ({"EAGLE_JAX_DISTRIBUTED": "yes"}, "must be 0 or 1"),
    ]:
        with pytest.raises(EagleError, match=message):
            distributed.detect(env)


# ---------------------------------------------------------------- memory plan


def test_plan_cli(capsys, golden_dir):
    """The golden target (4 heads, 2 kv heads) on tensor=4,data=2: kv heads replicated, exact resident bytes."""
    assert (
        plan.main(
            [
                "--target",
                str(golden_dir / "target"),
                "--mesh",
                "tensor=4,data=2",
                "--batch",
                "4",
                "--max-len",
                "128",
                "--dtype",
                "fp32",
                "--draft-vocab-size",
                "512",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # k and v [8 layers, 4/2 rows, 128 slots, 2 kv heads (replicated), 32] f32 (+ lengths [4/2] int32)
    assert re.search(rf"target KV cache +{(2 * 8 * 2 * 128 * 2 * 32 * 4 + 8) / 2**20:.2f} MiB", out)
    assert "prefill (128-token prompts):" in out and "generation loop (cycles):" in out
    assert "TPU v6e-8  8 x 32 GiB: fits" in out
    assert "TPU v5p-8  4 x 95 GiB: fits" in out and "plan it with --devices 4" in out


def test_plan_programs(models):
    tcfg, tparams, dcfg, _ = models
    p = programs.plan_inference(
        tcfg, dcfg, sharding.make_mesh("tensor=8"), batch=1, max_len=128, dtype=np.float32, tree=SPEC
    )
    resident = dict(p.resident)
    # vocab, heads and MLP are split 8 ways; norms are replicated
    assert resident["target parameters"] < sum(x.size * 4 for x in jax.tree.leaves(tparams)) / 4
    for prog in p.programs:
        assert prog.arguments >= resident["target parameters"] and prog.temporaries > 0 and prog.refused is None
    assert p.peak == max(prog.peak for prog in p.programs)


def test_plan_training(models):
    tcfg, _, dcfg, _ = models
    p = step.plan_training(tcfg, dcfg, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch=4, seq_len=16, ttt_steps=1)
    resident = dict(p.resident)
    vocab_map = 48 * 4 + 64  # d2t int32 [48], t2d bool [64], replicated
    assert resident["optimizer state"] >= 2 * (resident["draft parameters (f32 master)"] - vocab_map)
    assert p.programs[0].peak > resident["target parameters (frozen)"]
    offline = step.plan_training(
        tcfg, dcfg, sharding.make_mesh("data=2,fsdp=2,tensor=2"), batch=4, seq_len=16, ttt_steps=1, offline=True
    )
    held = dict(offline.resident)
    assert "target parameters (frozen)" not in held  # from stored features: the readout only
    assert held["target readout (frozen)"] < resident["target parameters (frozen)"]
    assert {k: v for k, v in held.items() if "target" not in k} == {
        k: v for k, v in resident.items() if "target" not in k
    }


def test_plan_configs(tmp_path, golden_dir, monkeypatch):
    """Dimensions from a preset (built-in public values when its checkpoints are absent), a store, an HF directory."""
    from eagle_jax.io.convert import convert

    monkeypatch.delenv("EAGLE_JAX_MODELS", raising=False)
    tcfg, dcfg, tree, dtype = plan.model_configs("llama3.3-70b-eagle3", models=str(tmp_path))
    assert (tcfg.num_layers, tcfg.num_heads, tcfg.num_kv_heads, tcfg.vocab_size) == (80, 64, 8, 128256)
    assert (dcfg.kind, dcfg.draft_vocab_size, dcfg.hidden_size) == ("eagle3", 32000, 8192)
    assert tree.num_nodes == 60 and dtype == "bf16"
    out = convert(golden_dir / "target", golden_dir / "eagle3", tmp_path / "store", progress=False)
    tcfg, dcfg, _, _ = plan.model_configs(str(out))
    assert (tcfg.num_layers, dcfg.kind, dcfg.draft_vocab_size) == (8, "eagle3", 256)
    tcfg, dcfg, _, _ = plan.model_configs(str(golden_dir / "target"), draft_vocab=512)
    assert (dcfg.kind, dcfg.draft_vocab_size, dcfg.intermediate_size) == ("eagle3", 512, tcfg.intermediate_size)


def test_plan_names_one_model(capsys, golden_dir):
    """The plan takes the model flags every command takes: one of --config (a preset) and --target (a folder)."""
    assert plan.main(["--batch", "2"]) == 2
    assert plan.main(["--config", "llama3.3-70b-eagle3", "--target", str(golden_dir / "target")]) == 2
    assert capsys.readouterr().err.count("name one model to plan: --config PRESET or --target FOLDER") == 2


def test_plan_tpu_needs_libtpu(capsys, golden_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "libtpu", None)  # as on a machine without the package
    assert plan.main(["--target", str(golden_dir / "target"), "--tpu", "v6e-8"]) == 2
    assert "--tpu: v6e-8 compiles with libtpu, which is not installed" in capsys.readouterr().err


def test_train_cli_plan(capsys, golden_dir):
    """`python -m train.eagle3 --plan` prints the compiled memory plan of a training step."""
    from train import eagle3

    assert (
        eagle3.main(
            [
                "--plan",
                "--target",
                str(golden_dir / "target"),
                "--mesh",
                "fsdp=8",
                "--batch-size",
                "8",
                "--max-length",
                "32",
                "--ttt-steps",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "optimizer state" in out and "peak per device" in out and "TPU v6e-8" in out

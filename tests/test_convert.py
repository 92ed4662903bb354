"""Stores and converters: torch -> orbax -> torch round trips, restores onto a mesh, --verify, generation parity."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.tree import DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.io import convert, official, store
from eagle_jax.parallel import sharding

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("eagle3", "eagle1")
OFFICIAL_FILES = ["config.json", "model.safetensors", "pytorch_model.bin"]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, golden_dir) -> dict[str, Path]:
    """The golden target with each golden head, converted once (float32, as in the files)."""
    root = tmp_path_factory.mktemp("stores")
    return {k: convert.convert(golden_dir / "target", golden_dir / k, root / k, progress=False) for k in KINDS}


def _assert_same_official(got_dir: Path, gold_dir: Path, cast=None) -> None:
    """Same keys, shapes, dtypes and values in model.safetensors and pytorch_model.bin (gold optionally cast)."""
    gold, got = load_file(gold_dir / "model.safetensors"), load_file(got_dir / "model.safetensors")
    assert sorted(got) == sorted(gold)
    for name, g in gold.items():
        want = g.astype(cast) if cast is not None and np.issubdtype(g.dtype, np.floating) else g
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        np.testing.assert_array_equal(got[name], want, name)
    gold_bin = torch.load(gold_dir / "pytorch_model.bin", weights_only=True)
    got_bin = torch.load(got_dir / "pytorch_model.bin", weights_only=True)
    assert sorted(got_bin) == sorted(gold_bin)
    for name, g in gold_bin.items():
        want = g.to(torch.bfloat16) if cast is not None and g.is_floating_point() else g
        assert got_bin[name].dtype == want.dtype and got_bin[name].shape == want.shape, name
        assert torch.equal(got_bin[name], want), name


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_exact(kind, stores, golden_dir, tmp_path):
    files = official.export_store_head(stores[kind], tmp_path / "head")
    assert files == OFFICIAL_FILES
    _assert_same_official(tmp_path / "head", golden_dir / kind)
    assert json.loads((tmp_path / "head" / "config.json").read_text()) == json.loads(
        (golden_dir / kind / "config.json").read_text()
    )
    if kind == "eagle3":  # the official dtypes of the vocabulary maps
        maps = load_file(tmp_path / "head" / "model.safetensors")
        assert maps["d2t"].dtype == np.int64 and maps["t2d"].dtype == np.bool_


def test_store_holds_configs_and_tokenizer(stores, golden_dir):
    m = store.read_manifest(stores["eagle3"])
    assert m.target_config == json.loads((golden_dir / "target" / "config.json").read_text())
    assert m.generation_config == json.loads((golden_dir / "target" / "generation_config.json").read_text())
    assert m.draft_config == json.loads((golden_dir / "eagle3" / "config.json").read_text())
    assert (m.draft_kind, m.target_dtype, m.draft_dtype) == ("eagle3", "float32", "float32")
    tok = store.tokenizer_dir(stores["eagle3"])
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tok / name).read_bytes() == (golden_dir / "target" / name).read_bytes()


def test_bf16_cli_round_trip(golden_dir, tmp_path):
    """The two CLIs in bf16: every float cast once, maps kept exact, config dtype updated."""
    env_cmd = [sys.executable, "-m"]
    conv = subprocess.run(
        env_cmd
        + [
            "convert.torch_to_orbax",
            "--target",
            str(golden_dir / "target"),
            "--draft",
            str(golden_dir / "eagle3"),
            "--out",
            str(tmp_path / "s"),
            "--dtype",
            "bf16",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stderr
    assert "target bfloat16, eagle3 head bfloat16" in conv.stdout
    back = subprocess.run(
        env_cmd + ["convert.orbax_to_torch", "--draft", str(tmp_path / "s"), "--out", str(tmp_path / "h")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert back.returncode == 0, back.stderr
    _assert_same_official(tmp_path / "h", golden_dir / "eagle3", cast=jnp.bfloat16)
    assert json.loads((tmp_path / "h" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_save_draft_exports_like_the_original(golden_dir, golden_target, tmp_path):
    """The training path: a head saved with store.save_draft exports to the official files."""
    tcfg, _ = golden_target
    for kind in KINDS:
        _, params = official.load_head(golden_dir / kind, tcfg)
        raw = json.loads((golden_dir / kind / "config.json").read_text())
        saved = store.save_draft(tmp_path / f"{kind}-run", raw, params)
        with pytest.raises(EagleError, match="holds no target"):
            store.load_target_store(saved)
        official.export_store_head(saved, tmp_path / f"{kind}-official")
        _assert_same_official(tmp_path / f"{kind}-official", golden_dir / kind)


def test_a_store_named_by_a_relative_path_loads(golden_dir, golden_target, tmp_path, monkeypatch):
    """`convert.orbax_to_torch --draft runs/x/head` from the run's parent folder, as the README does."""
    tcfg, _ = golden_target
    _, params = official.load_head(golden_dir / "eagle3", tcfg)
    store.save_draft(tmp_path / "run" / "head", json.loads((golden_dir / "eagle3" / "config.json").read_text()), params)
    monkeypatch.chdir(tmp_path)
    _, loaded = store.load_draft_store(Path("run/head"), tcfg)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)))


@pytest.mark.parametrize("mesh_text", ["data=2,tensor=4", "tensor=8"])
def test_restore_onto_mesh(mesh_text, stores, golden_dir, golden_target):
    """Each leaf arrives with the sharding of its logical axes; values equal the host restore."""
    mesh = sharding.make_mesh(mesh_text)
    tcfg, host = store.load_target_store(stores["eagle3"])
    _, placed = store.load_target_store(stores["eagle3"], mesh=mesh)
    shardings = sharding.target_shardings(tcfg, mesh)
    for (path, x), want, ref in zip(
        jax.tree_util.tree_leaves_with_path(placed), jax.tree.leaves(shardings), jax.tree.leaves(host)
    ):
        assert x.sharding.is_equivalent_to(want, x.ndim), jax.tree_util.keystr(path)
        assert x.addressable_shards[0].data.shape == want.shard_shape(x.shape)
        np.testing.assert_array_equal(np.asarray(x), ref)
    tensor = mesh.shape["tensor"]
    assert placed["embed"].addressable_shards[0].data.shape == (tcfg.vocab_size // tensor, tcfg.hidden_size)
    dcfg, dplaced = store.load_draft_store(stores["eagle3"], tcfg, mesh=mesh)
    _, dhost = official.load_head(golden_dir / "eagle3", tcfg)
    assert dplaced["lm_head"].addressable_shards[0].data.shape == (dcfg.hidden_size, dcfg.draft_vocab_size // tensor)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, dplaced), dhost)


def _streamed(tparams, tcfg, dparams, dcfg, prompt: list[int], n: int) -> tuple[list[int], list[int]]:
    """(tokens, accept lengths) of a streamed generation (the compiles test_engine's parity tests share)."""
    tokens, accepts = [], []
    for new, _, state in generation.stream(
        tparams, dparams, [prompt], n, speculative.DecodeConfig(tcfg, dcfg, DynamicTree(16, 4, 4)), capacity=256
    ):
        tokens += new[0]
        accepts.append(int(state.accept_lengths[len(accepts), 0]))
    return tokens, accepts


@pytest.mark.parametrize("kind", KINDS)
def test_generation_from_store_equals_directories(kind, stores, golden_dir, golden_target, reference):
    tcfg, tparams = golden_target
    dcfg, dparams = official.load_head(golden_dir / kind, tcfg)
    scfg, stparams = store.load_target_store(stores[kind])
    sdcfg, sdparams = store.load_draft_store(stores[kind], scfg)
    assert (scfg, sdcfg) == (tcfg, dcfg)
    prompt = reference["p1.input_ids"].tolist()
    from_dirs = _streamed(tparams, tcfg, dparams, dcfg, prompt, 24)
    assert _streamed(stparams, scfg, sdparams, sdcfg, prompt, 24) == from_dirs
    assert from_dirs[0] == reference["p1.greedy_ids"][len(prompt) : len(prompt) + 24].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_verify_against_torch(kind, stores, golden_dir):
    diffs = convert.verify(stores[kind], golden_dir / "target", golden_dir / kind)
    assert set(diffs) == {"target_logits", "draft_outputs", "draft_logits"}
    assert max(diffs.values()) < 1e-4, diffs


def test_head_rope_theta_reaches_inference(golden_dir, tmp_path):
    """A head whose config says rope_theta 500000 (the target's is 10000): the JAX draft forward rotates with the
    head's own base, as the torch reference built from that config does (10000 would differ by ~1e-1)."""
    head = tmp_path / "head"
    shutil.copytree(golden_dir / "eagle3", head)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0}))
    stored = convert.convert(golden_dir / "target", head, tmp_path / "store", progress=False)
    diffs = convert.verify(stored, golden_dir / "target", head)
    assert max(diffs["draft_outputs"], diffs["draft_logits"]) < 1e-4, diffs


def test_store_errors(stores, golden_dir, tmp_path):
    with pytest.raises(EagleError, match="already exists"):
        convert.convert(golden_dir / "target", golden_dir / "eagle3", stores["eagle3"], progress=False)
    with pytest.raises(EagleError, match="EAGLE1 head but EAGLE3 was requested"):
        store.load_draft_store(stores["eagle1"], kind="eagle3")
    broken = tmp_path / "broken"
    shutil.copytree(stores["eagle3"], broken)
    for data in ("d", "ocdbt.process_0"):
        shutil.rmtree(broken / "target" / data, ignore_errors=True)
    with pytest.raises(EagleError, match="broken.target: .*the store may be incomplete") as err:
        store.load_target_store(broken)
    assert "\n" not in str(err.value)


def test_convert_refuses_a_head_for_another_target(golden_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(golden_dir / "eagle3", other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "convert.torch_to_orbax",
            "--target",
            str(golden_dir / "target"),
            "--draft",
            str(other),
            "--out",
            str(tmp_path / "s"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "does not fit the target" in out.stderr
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------- bad --out: one line, exit code 2, no file changed


@pytest.fixture
def workspace(stores, golden_dir, tmp_path) -> Path:
    """A copy of the golden target and head, a store of them, a user's folder and a user's file."""
    for name in ("target", "eagle3"):
        shutil.copytree(golden_dir / name, tmp_path / "models" / name)
    shutil.copytree(stores["eagle3"], tmp_path / "store")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me\n")
    (tmp_path / "file").write_text("a file\n")
    return tmp_path


INPUT, STRANGER, NOT_EMPTY = "is or holds the input", "which this command did not write", "is not empty"
CONVERT_BAD_OUT = {
    "--overwrite the target": (
        "torch_to_orbax",
        ["--target", "{w}/models/target", "--out", "{w}/models/target"],
        INPUT,
    ),
    "--overwrite the folder holding the inputs": (
        "torch_to_orbax",
        ["--target", "{w}/models/target", "--draft", "{w}/models/eagle3", "--out", "{w}/models"],
        INPUT,
    ),
    "--overwrite the store read from": ("orbax_to_torch", ["--draft", "{w}/store", "--out", "{w}/store"], INPUT),
    "--overwrite a user's folder": ("orbax_to_torch", ["--draft", "{w}/store", "--out", "{w}/mine"], STRANGER),
    "--out a file": ("torch_to_orbax", ["--target", "{w}/models/target", "--out", "{w}/file"], "is a file"),
    "--out without --overwrite": (
        "orbax_to_torch",
        ["--draft", "{w}/store", "--out", "{w}/mine", "--no-overwrite"],
        NOT_EMPTY,
    ),
    "gguf --out a file": ("gguf_to_hf", ["--gguf", "{w}/file", "--out", "{w}/file"], "is a file"),
    "gguf --out the folder holding the input": ("gguf_to_hf", ["--gguf", "{w}/file", "--out", "{w}"], INPUT),
}


@pytest.mark.parametrize("case", list(CONVERT_BAD_OUT))
def test_bad_out_is_refused_and_nothing_changes(case, workspace, capsys):
    import importlib

    from badinput import assert_refused, snapshot

    module, args, expected = CONVERT_BAD_OUT[case]
    args = [a.format(w=workspace) for a in args]
    if module != "gguf_to_hf":
        args = [a for a in args if a != "--no-overwrite"] + ([] if "--no-overwrite" in args else ["--overwrite"])
    before = snapshot(workspace)
    code = importlib.import_module(f"convert.{module}").main(args)
    assert_refused(code, capsys.readouterr().err, expected)
    assert snapshot(workspace) == before


def test_overwrite_replaces_its_own_output(stores, tmp_path, capsys):
    from convert import orbax_to_torch

    out = tmp_path / "head"
    assert orbax_to_torch.main(["--draft", str(stores["eagle3"]), "--out", str(out)]) == 0
    (out / "model.safetensors").write_bytes(b"stale")
    assert orbax_to_torch.main(["--draft", str(stores["eagle3"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").read_bytes() != b"stale"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temporary or old copy left

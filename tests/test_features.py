"""Stored target features (`train.features`) and training from them (`train.eagle3 --features`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from convdata import chain_conversations, next_token_table, write_jsonl
from safetensors.numpy import load_file

from eagle_jax.training import features, trainer
from train import eagle3
from train import features as features_cli

SETTINGS = dict(batch_size=8, max_length=64, ttt_steps=3, lr=1e-2, draft_vocab_size=64, warmup=2, log_every=1)


@pytest.fixture(scope="module")
def conversations(golden_target, workdir) -> Path:
    return write_jsonl(workdir / "train.jsonl", chain_conversations(next_token_table(*golden_target), 40, 40, seed=0))


def extract(target_dir: Path, data: Path, out: Path, **kw) -> dict:
    fc = features.FeaturesConfig(str(target_dir), (str(data),), str(out), max_length=64, shard_size=16, **kw)
    return features.extract(fc)


@pytest.fixture(scope="module")
def stores(target_dir, conversations, workdir) -> dict[str, Path]:
    """Stores of the conversations in fp32 and bf16."""
    out = {}
    for dtype in features.DTYPES:
        out[dtype] = workdir / f"feats-{dtype}"
        extract(target_dir, conversations, out[dtype], dtype=dtype)
    return out


def run(target_dir: Path, data: Path, out: Path, store: Path | None = None, mesh: str | None = None) -> list[dict]:
    """Four steps (on fsdp over the 8 devices unless `mesh`) -> metrics.jsonl."""
    rc = trainer.RunConfig(
        str(target_dir), (str(data),), str(out), steps=4, features=store and str(store), mesh=mesh, **SETTINGS
    )
    trainer.train(rc)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_from_stored_features_equals_training_with_the_target(target_dir, conversations, stores, tmp_path):
    """The same batches, losses, accuracies and gradient norms (float32 store, and another mesh than the online
    run's fsdp=8: within 1e-5 relative; bf16 store: losses within 1%), and the same head after the steps (float32
    store)."""
    online = run(target_dir, conversations, tmp_path / "online")
    head = load_file(str(tmp_path / "online" / "export" / "model.safetensors"))
    for dtype, rtol, mesh in (("fp32", 1e-5, "data=2,fsdp=2,tensor=2"), ("bf16", 1e-2, None)):
        offline = run(target_dir, conversations, tmp_path / f"{dtype}-{mesh}", stores[dtype], mesh)
        assert [r["step"] for r in offline] == [1, 2, 3, 4]
        for a, b in zip(online, offline):
            np.testing.assert_allclose(b["loss"], a["loss"], rtol=rtol, err_msg=dtype)
            np.testing.assert_allclose(b["plosses"], a["plosses"], rtol=rtol, err_msg=dtype)
            np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=10 * rtol, err_msg=dtype)
            if dtype == "fp32":
                assert b["acc"] == pytest.approx(a["acc"], abs=1e-9)
        if dtype == "fp32":
            mine = load_file(str(tmp_path / f"{dtype}-{mesh}" / "export" / "model.safetensors"))
            for k in head:
                # 1% of one update at lr 1e-2: Adam divides float noise on tiny gradients by tiny second moments
                np.testing.assert_allclose(mine[k], head[k], rtol=0, atol=1e-4, err_msg=k)


def shard_arrays(store: Path) -> dict[str, np.ndarray]:
    return {f"{d.name}/{f.name}": np.load(f) for d in sorted(store.glob("shard-*")) for f in sorted(d.glob("*.npy"))}


def test_a_damaged_or_half_written_shard_is_redone(target_dir, conversations, stores, tmp_path):
    """A rerun keeps the intact shards, redoes a shard of the wrong size (and those after it) and removes
    half-written ones; the result equals an undisturbed store."""
    want = shard_arrays(stores["bf16"])
    store = tmp_path / "feats"
    shutil.copytree(stores["bf16"], store)
    index = json.loads((store / "index.json").read_text())
    index["complete"] = False
    (store / "index.json").write_text(json.dumps(index))
    with (store / "shard-00001" / "hidden.npy").open("r+b") as f:
        f.truncate(1000)  # a shard cut short
    shutil.copytree(store / "shard-00000", store / ".shard-00003")  # a shard being written when killed
    with pytest.raises(Exception, match="not complete"):
        features.FeatureStore(store)
    before = (store / "shard-00000" / "features.npy").stat().st_mtime_ns
    extract(target_dir, conversations, store, dtype="bf16")
    assert (store / "shard-00000" / "features.npy").stat().st_mtime_ns == before  # kept, not redone
    assert sorted(p.name for p in store.iterdir()) == [
        "index.json",
        "readout.npz",
        *sorted(features.FeatureStore(store).index["shards"][i]["name"] for i in range(3)),
    ]
    got = shard_arrays(store)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.fixture
def main_lines(capsys):
    """A CLI's main in this process -> (exit code, its last stderr line)."""

    def call(main, *args) -> tuple[int, str]:
        code = main([str(a) for a in args])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "\r" not in line]
        return code, lines[-1]

    return call


def test_features_of_another_target_data_or_length_are_refused(main_lines, target_dir, conversations, stores, tmp_path):
    other_target = tmp_path / "other-target"
    shutil.copytree(target_dir, other_target, symlinks=True)
    config = json.loads((other_target / "config.json").read_text())
    (other_target / "config.json").unlink()  # a link to the golden file: replaced, not written through
    (other_target / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    other_data = write_jsonl(
        tmp_path / "other.jsonl", [json.loads(line) for line in conversations.read_text().splitlines()][:-1]
    )
    incomplete = tmp_path / "incomplete"
    shutil.copytree(stores["fp32"], incomplete)
    index = json.loads((incomplete / "index.json").read_text())
    (incomplete / "index.json").write_text(json.dumps({**index, "complete": False}))
    tiny = ["--batch-size", 8, "--ttt-steps", 3, "--draft-vocab-size", 64]
    cases = [
        ([other_target, conversations, 64, stores["fp32"]], "another target"),
        ([target_dir, other_data, 64, stores["fp32"]], "another data"),
        ([target_dir, conversations, 48, stores["fp32"]], "max length: 64 there, 48 here"),
        ([target_dir, conversations, 64, incomplete], "not complete; run the python -m train.features command"),
        ([target_dir, conversations, 64, tmp_path], "not a features folder"),
    ]
    for (target, data, length, store), expected in cases:
        out = tmp_path / "run"
        code, line = main_lines(
            eagle3.main,
            "--target",
            target,
            "--data",
            data,
            "--out",
            out,
            "--max-length",
            length,
            "--features",
            store,
            *tiny,
        )
        assert code == 2 and line.startswith("error:") and expected in line, (expected, line)


def test_extraction_refuses_what_it_did_not_write_and_other_settings(
    main_lines, target_dir, conversations, stores, tmp_path
):
    from badinput import snapshot

    strange = tmp_path / "mine"
    strange.mkdir()
    (strange / "notes.txt").write_text("keep me\n")
    store = tmp_path / "feats"
    shutil.copytree(stores["bf16"], store)
    base = ["--target", target_dir, "--data", conversations, "--max-length", 64]
    cases = [
        ([*base, "--out", strange], "not a features folder"),
        ([*base, "--out", store, "--dtype", "fp32"], "another dtype (bf16, now fp32)"),
        (
            ["--target", target_dir, "--data", conversations, "--max-length", 48, "--out", store],
            "another max_length (64, now 48)",
        ),
        ([*base, "--out", conversations], "is a file"),
        ([*base, "--out", tmp_path / "new", "--dtype", "fp16"], "invalid choice: 'fp16'"),
    ]
    before = snapshot(tmp_path)
    for args, expected in cases:
        code, line = main_lines(features_cli.main, *args)
        assert code == 2 and line.startswith("error:") and expected in line, (expected, line)
    assert snapshot(tmp_path) == before


def test_bytes_per_token_is_what_a_store_holds(stores, golden_target):
    """The README's figure: features (3 Ht) and hidden state (Ht) in the storage dtype, argmax, id, loss mask."""
    tcfg = golden_target[0]
    for dtype, store in stores.items():
        index = json.loads((store / "index.json").read_text())
        rows = sum(len(np.load(d / "input_ids.npy")) for d in store.glob("shard-*"))
        stored = sum(s["bytes"] for s in index["shards"]) - sum(
            (d / "offsets.npy").stat().st_size + 5 * 128
            for d in store.glob("shard-*")  # 128-byte .npy headers
        )
        assert index["bytes_per_token"] == features.bytes_per_token(tcfg, dtype) == stored // rows
        assert rows == index["tokens"] + index["conversations"]  # one padding row per conversation

"""EAGLE-3 head training on the golden target: learning, sharded equivalence, export, CLI errors, regeneration."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from convdata import (
    chain_conversations,
    next_token_table,
    write_jsonl,
)
from safetensors.numpy import load_file
from tiny import plain_generate

from eagle_jax.io import loading, store
from eagle_jax.models import draft, params
from eagle_jax.models.config import eagle3_head_like
from eagle_jax.training import data, objective, trainer
from eagle_jax.training import regenerate as regeneration
from train import eagle3

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--batch-size",
    "8",
    "--max-length",
    "64",
    "--ttt-steps",
    "3",
    "--lr",
    "1e-2",
    "--draft-vocab-size",
    "256",
    "--warmup",
    "3",
]


def cli_env(tmp: Path, devices: int = 1) -> dict:
    """The environment of a CLI run on `devices` CPU devices: this session's XLA flags, a compilation cache."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}".strip(),
        "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def run_module(module: str, args: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def chain_data(golden_target, workdir) -> tuple[Path, Path]:
    """(training file of 256 conversations, held-out file of 4) with answers drawn from the target."""
    table = next_token_table(*golden_target)
    train = write_jsonl(workdir / "train.jsonl", chain_conversations(table, 256, 40, seed=0))
    held = write_jsonl(workdir / "heldout.jsonl", chain_conversations(table, 4, 40, seed=1))
    return train, held


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_run_learns_measures_tau_and_exports(target_dir, chain_data, workdir, golden_dir):
    out = workdir / "run"
    train, held = chain_data
    res = run_module(
        "train.eagle3",
        [
            "--target",
            target_dir,
            "--data",
            train,
            "--out",
            out,
            "--steps",
            30,
            *TINY,
            "--log-every",
            1,
            "--save-every",
            10,
            "--tau-prompts",
            held,
            "--tau-every",
            30,
            "--tau-tree",
            "5/4/1",
        ],
        cli_env(workdir),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert all(len(r["acc"]) == 3 and r["tokens_per_s"] > 0 and np.isfinite(r["loss"]) for r in rows)
    loss = np.array([r["loss"] for r in rows])
    acc0 = np.array([r["acc"][0] for r in rows])
    # observed: loss 5.0 -> 3.6, acc_0 0.03 -> 0.33 (averages of the first / last 5 steps)
    assert loss[-5:].mean() < 0.85 * loss[:5].mean()
    assert acc0[-5:].mean() > acc0[:5].mean() + 0.15
    assert all(abs(r["tau_sim"] - float(objective.simulated_tau(np.array(r["acc"])))) < 1e-6 for r in rows)
    taus = read_jsonl(out / "tau.jsonl")
    assert [t["step"] for t in taus] == [0, 30] and taus[1]["tau"] > taus[0]["tau"]  # engine on held-out prompts
    tokenizer = data.chat_tokenizer(target_dir)
    (length,) = {len(ex.input_ids) for ex in data.load_examples([train], tokenizer, 64, 1024)[0]}  # all alike
    assert [t["tokens_seen"] for t in taus] == [0, 30 * 8 * length]

    # export: exactly the official keys, shapes and dtypes (those of the golden head for this target)
    exported = load_file(str(out / "export" / "model.safetensors"))
    official = load_file(str(golden_dir / "eagle3" / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in exported.items()} == {k: (v.shape, v.dtype) for k, v in official.items()}
    assert sorted(p.name for p in (out / "export").iterdir()) == [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
    ]
    tcfg = loading.target_config(target_dir)
    dcfg, head = loading.load_draft(out / "export", tcfg)
    assert dcfg == eagle3_head_like(tcfg, 256)
    saved_map = np.load(out / "vocab_map.npz")
    np.testing.assert_array_equal(head["d2t"], saved_map["d2t"])
    np.testing.assert_array_equal(head["t2d"], saved_map["t2d"])
    counts = saved_map["counts"]
    assert counts[saved_map["t2d"]].min() >= counts[~saved_map["t2d"]].max()  # the most frequent answer tokens
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_init_from_an_official_head(target_dir, golden_target, workdir, golden_dir):
    """--init-head starts from the golden head and keeps its vocabulary map."""
    out = workdir / "init"
    greedy = write_jsonl(
        workdir / "greedy.jsonl", chain_conversations(next_token_table(*golden_target), 64, 40, 2, greedy=True)
    )
    args = [
        "--target",
        target_dir,
        "--data",
        greedy,
        "--out",
        out,
        "--steps",
        2,
        *TINY[:-4],
        "--lr",
        "1e-6",
        "--log-every",
        1,
        "--init-head",
        golden_dir / "eagle3",
    ]
    res = run_module("train.eagle3", args, cli_env(workdir))
    assert res.returncode == 0, res.stderr[-3000:]
    first = read_jsonl(out / "metrics.jsonl")[0]
    assert first["acc"][0] > 0.8  # on data like its own training data; a fresh head starts near 0
    official = load_file(str(golden_dir / "eagle3" / "model.safetensors"))
    exported = load_file(str(out / "export" / "model.safetensors"))
    for key in ("d2t", "t2d"):
        np.testing.assert_array_equal(np.load(out / "vocab_map.npz")[key], official[key])
        np.testing.assert_array_equal(exported[key], official[key])


def test_export_formats_load_back(tmp_path, golden_target):
    tcfg, _ = golden_target
    dcfg = eagle3_head_like(tcfg, 256)
    head = params.init_params(draft.param_specs(dcfg), jax.random.key(0))
    head["d2t"], head["t2d"] = objective.build_vocab_map(np.arange(1024)[::-1], 256)
    assert trainer.export_head(head, dcfg, tcfg, tmp_path) == ["config.json", "model.safetensors", "pytorch_model.bin"]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 256
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        (bin_only / name).write_bytes((tmp_path / "export" / name).read_bytes())
    expected = jax.device_get(head)
    for where in (tmp_path / "export", bin_only):
        cfg, loaded = loading.load_draft(where, tcfg)
        assert cfg == dcfg
        jax.tree.map(np.testing.assert_array_equal, loaded, expected)
    cfg, loaded = store.load_draft_store(tmp_path / "head", tcfg)  # the orbax copy
    assert cfg == dcfg
    jax.tree.map(np.testing.assert_array_equal, loaded, expected)


# ---------------------------------------------------------------- user errors


@pytest.fixture
def run_main(capsys):
    """eagle3.main in this process -> (exit code, stderr lines that are not progress bars)."""

    def call(*args) -> tuple[int, list[str]]:
        code = eagle3.main([str(a) for a in args])
        err = capsys.readouterr().err
        return code, [line for line in err.splitlines() if line.strip() and "\r" not in line]

    return call


def test_user_errors_are_one_line_with_exit_code_2(run_main, target_dir, chain_data, tmp_path):
    train = chain_data[0]
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "t9"}, {"from": "gpt", "value": "t8"}]},
                {"text": "no turns"},
            ]
        )
    )
    base = ["--target", target_dir, "--data", train, "--out", tmp_path / "o", *TINY]
    cases = [
        (["--target", tmp_path / "none", "--data", train, "--out", tmp_path / "o"], "directory not found"),
        ([*base, "--mesh", "data=two"], "--mesh: bad mesh entry 'data=two'"),
        ([*base, "--mesh", "data=3"], "does not divide the 8 devices"),
        ([*base, "--mesh", "data=8", "--batch-size", "4"], "batch"),
        ([*base, "--mesh", "tensor=8"], "does not divide heads=4 of the target"),
        (["--target", target_dir, "--data", bad, "--out", tmp_path / "o"], f"{bad}: record 1: no 'conversations'"),
        (
            ["--target", target_dir, "--data", tmp_path / "missing.jsonl", "--out", tmp_path / "o"],
            "data file not found",
        ),
        ([*base, "--steps", "0"], "--steps must be >= 1"),
        ([*base, "--tau-every", "5"], "--tau-every needs --tau-prompts"),
        (["--target", target_dir, "--out", tmp_path / "o"], "--data"),
        (
            [*base, "--draft-vocab-size", "4096", "--mesh", "fsdp=8"],
            "--draft-vocab-size: draft vocabulary size 4096 must be in 1..1024",
        ),
    ]
    for args, expected in cases:
        code, lines = run_main(*args)
        errors = [line for line in lines if line.startswith("error:")]
        assert code == 2 and errors == lines[-1:] and expected in errors[0], (args, lines)


def test_resume_with_other_flags_is_refused(run_main, target_dir, chain_data, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    run = eagle3.parse_args(["--target", str(target_dir), "--data", str(chain_data[0]), "--out", str(out), *TINY])
    (out / "run.json").write_text(json.dumps(dataclasses.asdict(run)))
    code, lines = run_main(
        "--target", target_dir, "--data", chain_data[0], "--out", out, *TINY[:-2], "--warmup", 5, "--mesh", "fsdp=8"
    )
    assert code == 2 and "--warmup 3 (now 5)" in lines[-1] and "use a new --out" in lines[-1]


@pytest.fixture
def out_dirs(tmp_path, target_dir, chain_data) -> Path:
    """Output folders a run must not take over, and runs it must not resume as asked."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me\n")
    (tmp_path / "file").write_text("a file\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(chain_data[0].read_bytes())
    for name, steps in (("run16", 16), ("bad_json", 16), ("bad_map", 16)):
        (tmp_path / name).mkdir()
        run = eagle3.parse_args(
            ["--target", str(target_dir), "--data", str(chain_data[0]), "--out", str(tmp_path / name), *TINY]
        )
        (tmp_path / name / "run.json").write_text(json.dumps(dataclasses.asdict(dataclasses.replace(run, steps=steps))))
    (tmp_path / "bad_json" / "run.json").write_text('{"steps": 16')
    (tmp_path / "bad_map" / "vocab_map.npz").write_bytes(b"PK\x03\x04 cut off")
    return tmp_path


TRAIN_BAD_OUT = {
    "a folder that is not a run": ("{o}/mine", [], "not a training run"),
    "a file": ("{o}/file", [], "is a file"),
    "the folder holding the data": ("{o}/data", ["--data", "{o}/data/train.jsonl"], "not a training run"),
    "the data folder's parent as a run": ("{o}/run16", ["--data", "{o}/run16/run.json"], "holds the input"),
    "resume with fewer --steps": ("{o}/run16", ["--steps", "8"], "--steps: 8 is below the 16 steps"),
    "a damaged run.json": ("{o}/bad_json", [], "repair it"),
    "a damaged vocab_map.npz": ("{o}/bad_map", ["--steps", "16"], "remove it to rebuild it"),
}


@pytest.mark.parametrize("case", list(TRAIN_BAD_OUT))
def test_bad_out_is_one_line_and_changes_nothing(case, run_main, out_dirs, target_dir, chain_data):
    from badinput import snapshot

    out, extra, expected = TRAIN_BAD_OUT[case]
    extra = [a.format(o=out_dirs) for a in extra]
    data_args = [] if "--data" in extra else ["--data", chain_data[0]]
    before = snapshot(out_dirs)
    code, lines = run_main("--target", target_dir, *data_args, "--out", out.format(o=out_dirs), *TINY, *extra)
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2 and errors == lines[-1:] and expected in errors[0], (case, lines)
    assert snapshot(out_dirs) == before


def test_cli_error_in_a_subprocess_has_no_traceback(tmp_path, target_dir):
    res = run_module(
        "train.eagle3",
        ["--target", target_dir, "--data", tmp_path / "nope.json", "--out", tmp_path / "o"],
        cli_env(tmp_path),
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == f"error: {tmp_path / 'nope.json'}: data file not found"


# ---------------------------------------------------------------- regeneration


def test_regenerate_replaces_answers_with_the_targets_greedy_ones(
    target_dir, chain_data, golden_target, golden_dir, tmp_path
):
    """Also reads the target from an eagle-jax store (config, weights and tokenizer in one directory)."""
    out = tmp_path / "regen.jsonl"
    tcfg, tparams = golden_target
    config = json.loads((golden_dir / "target" / "config.json").read_text())
    target_store = store.save(
        tmp_path / "store", target=store.TargetPart(config, tparams), tokenizer_from=target_dir, progress=False
    )
    res = run_module(
        "train.regenerate",
        [
            "--target",
            target_store,
            "--data",
            chain_data[1],
            "--out",
            out,
            "--max-new-tokens",
            6,
            "--batch-size",
            2,
            "--limit",
            3,
        ],
        cli_env(tmp_path),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    source = [json.loads(line) for line in chain_data[1].read_text().splitlines()][:3]
    rows = read_jsonl(out)
    assert len(rows) == 3
    tokenizer = data.chat_tokenizer(target_dir)
    prompts = [
        regeneration.prompt_ids(tokenizer, [{"role": "user", "content": r["conversations"][0]["value"]}])
        for r in source
    ]
    expected = plain_generate(tparams, tcfg, prompts, 6).tokens  # the golden target never emits eos
    for row, src, tokens in zip(rows, source, expected):
        human, gpt = row["conversations"]
        assert human == src["conversations"][0]
        assert gpt["from"] == "gpt" and gpt["value"] == " ".join(f"t{t}" for t in tokens)
    # the regenerated file is training data as it is
    examples, stats = data.load_examples([out], tokenizer, 64, 1024)
    assert stats.examples == 3


def _regenerated(ident: str) -> str:
    return json.dumps(regeneration.to_sharegpt([{"role": "assistant", "content": "x"}], ident)) + "\n"


def test_regenerate_continues_after_its_own_complete_lines(tmp_path):
    """Only a cut-off last line that starts like the next output is removed; every complete line is kept."""
    idents = [f"/data/c.jsonl: record {i}" for i in range(4)]
    out = tmp_path / "r.jsonl"
    kept = _regenerated(idents[0]) + _regenerated("elsewhere/c.jsonl: record 1")  # the same file, by another path
    out.write_text(kept + _regenerated(idents[2])[:25])
    assert regeneration.written_lines(out, idents) == 2 and out.read_text() == kept
    assert regeneration.written_lines(tmp_path / "new.jsonl", idents) == 0


@pytest.fixture
def regen_dir(tmp_path, chain_data) -> Path:
    """Inputs and outputs a rerun may meet: an earlier output with a damaged middle line, a user's file."""
    data_file = tmp_path / "data.jsonl"
    data_file.write_bytes(chain_data[1].read_bytes())
    idents = [f"{data_file}: record {i}" for i in range(4)]
    lines = [_regenerated(i) for i in idents[:3]]
    (tmp_path / "damaged.jsonl").write_text(lines[0] + '{"id": "broken\n' + lines[2])
    (tmp_path / "too_long.jsonl").write_text("".join(lines))
    (tmp_path / "mine.jsonl").write_text('{"text": "my own data"}\n')
    (tmp_path / "mine_no_newline.txt").write_text("my notes")
    (tmp_path / "latin1.jsonl").write_bytes(
        '{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n'.encode("latin-1")
    )
    (tmp_path / "folder.jsonl").mkdir()
    return tmp_path


REGENERATE_BAD_INPUT = {
    "--out is --data": (["--out", "{d}/data.jsonl"], "--out: "),
    "--out a user's JSONL": (["--out", "{d}/mine.jsonl"], "line 1 is not this command's output"),
    "--out a user's file without a newline": (["--out", "{d}/mine_no_newline.txt"], "neither complete nor the start"),
    "--out with a damaged middle line": (["--out", "{d}/damaged.jsonl"], "line 2 is not this command's output"),
    "--out longer than --limit selects": (["--out", "{d}/too_long.jsonl", "--limit", "2"], "more than the 2"),
    "--out a folder": (["--out", "{d}/folder.jsonl"], "is a folder"),
    "--out in a missing folder": (["--out", "{d}/missing/r.jsonl"], "does not exist"),
    "--limit 0": (["--out", "{d}/r.jsonl", "--limit", "0"], "--limit must be >= 1"),
    "non-UTF-8 data": (["--out", "{d}/r.jsonl", "--data", "{d}/latin1.jsonl"], "not UTF-8"),
}


@pytest.mark.parametrize("case", list(REGENERATE_BAD_INPUT))
def test_regenerate_bad_input_is_one_line_and_changes_nothing(case, regen_dir, target_dir, capsys):
    from badinput import assert_refused, snapshot

    from train import regenerate as regenerate_cli

    args, expected = REGENERATE_BAD_INPUT[case]
    args = [a.format(d=regen_dir) for a in args]
    if "--data" not in args:
        args += ["--data", str(regen_dir / "data.jsonl")]
    before = snapshot(regen_dir)
    code = regenerate_cli.main(["--target", str(target_dir), *args, "--max-new-tokens", "4"])
    assert_refused(code, capsys.readouterr().err, expected)
    assert snapshot(regen_dir) == before

"""Training and regeneration killed with SIGKILL and rerun with the same --out continue as if never stopped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from convdata import (
    chain_conversations,
    next_token_table,
    write_jsonl,
)
from test_train import ROOT, TINY, cli_env, read_jsonl, run_module

from eagle_jax.training import loop


@pytest.fixture(scope="module")
def env(workdir) -> dict:
    """One compilation cache for the module's runs: a program another test already compiled is loaded, not rebuilt."""
    return cli_env(workdir)


def checkpoint_steps(out: Path) -> list[int]:
    """Complete orbax checkpoints (temporary directories of unfinished saves have other names)."""
    ckpt = out / "ckpt"
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []


@pytest.fixture(scope="module")
def uninterrupted(target_dir, golden_target, env, workdir) -> tuple[list, Path]:
    """(args, run folder) of a run that the killed and the stopped runs (the same args, their own --out and
    checkpoint flags, which change no loss) must end like."""
    train = write_jsonl(workdir / "train.jsonl", chain_conversations(next_token_table(*golden_target), 128, 40, seed=0))
    args = ["--target", target_dir, "--data", train, "--steps", 16, *TINY, "--grad-accum", 2, "--log-every", 1]
    done = run_module("train.eagle3", [*args, "--out", workdir / "uninterrupted", "--save-every", 1000], env)
    assert done.returncode == 0, done.stderr[-3000:]
    return args, workdir / "uninterrupted"


def test_kill_9_and_resume_gives_the_same_losses(uninterrupted, env, tmp_path):
    # env: a shared compilation cache, the processes compile once
    args, ref = uninterrupted
    args = [*args, "--save-every", 3, "--keep", 2]
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.eagle3", *map(str, args), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not checkpoint_steps(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.4)  # somewhere past the first checkpoint: mid-step, mid-log or mid-save
    if proc.poll() is not None:
        pytest.fail(f"training ended (rc {proc.returncode}) before it could be killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = len(read_jsonl(out / "metrics.jsonl")) if (out / "metrics.jsonl").is_file() else 0
    assert checkpoint_steps(out) and killed_at < 16

    resumed = run_module("train.eagle3", [*args, "--out", out], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming {out} at step" in resumed.stderr
    ref_rows, rows = read_jsonl(ref / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 17))
    # exactly equal: same batches, restored parameters and optimiser state, same compiled step
    assert [(r["loss"], r["acc"], r["plosses"]) for r in rows] == [
        (r["loss"], r["acc"], r["plosses"]) for r in ref_rows
    ]
    assert checkpoint_steps(out) == [15, 16]  # --keep 2
    ref_export = (ref / "export" / "model.safetensors").read_bytes()
    assert (out / "export" / "model.safetensors").read_bytes() == ref_export
    assert json.loads((out / "run.json").read_text())["steps"] == 16


# python -m train.eagle3 with SIGINT handled as in a terminal, also when the suite runs as a background job
# (whose children inherit SIGINT ignored)
CTRL_C_LIKE_A_TERMINAL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'train.eagle3'; runpy.run_module('train.eagle3', run_name='__main__', alter_sys=True)"
)


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_an_export(uninterrupted, env, tmp_path):
    """The first SIGINT ends the step under way, saves it (no --save-every multiple needed) and
    exports the head, exit code 130; the same command then ends where an uninterrupted run ends."""
    args, ref = uninterrupted
    args = [*args, "--save-every", 1000]
    out = tmp_path / "stopped"
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C_LIKE_A_TERMINAL, *map(str, args), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 180
    while (
        proc.poll() is None
        and time.monotonic() < deadline
        and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2)
    ):
        time.sleep(0.02)
    if proc.poll() is not None:
        pytest.fail(f"training ended (rc {proc.returncode}) before the signal")
    proc.send_signal(signal.SIGINT)
    stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, stderr[-3000:]
    stopped_at = len(read_jsonl(metrics))
    assert 2 <= stopped_at < 16 and f"stopped at step {stopped_at} of 16;" in stderr, stderr[-3000:]
    assert checkpoint_steps(out) == [stopped_at]
    assert (out / "export" / "model.safetensors").is_file() and (out / "head").is_dir()

    resumed = run_module("train.eagle3", [*args, "--out", out], env)
    assert resumed.returncode == 0 and f"resuming {out} at step {stopped_at}" in resumed.stderr, resumed.stderr[-3000:]
    rows, ref_rows = read_jsonl(metrics), read_jsonl(ref / "metrics.jsonl")
    assert [(r["step"], r["loss"], r["acc"]) for r in rows] == [(r["step"], r["loss"], r["acc"]) for r in ref_rows]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_and_handlers_come_back(sig):
    before = signal.signal(sig, signal.default_int_handler)  # as in a terminal, even when the suite runs in `cmd &`
    try:
        with pytest.raises(KeyboardInterrupt), loop.stop_between_steps() as stop_asked:
            assert not stop_asked()
            signal.raise_signal(sig)
            assert stop_asked()
            signal.raise_signal(sig)
            pytest.fail("the second signal did not interrupt")
        assert signal.getsignal(sig) is signal.default_int_handler
    finally:
        signal.signal(sig, before)


def test_an_ignored_sigint_stays_ignored():
    """A background job (`cmd &`) ignores SIGINT: training there must not start stopping on it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with loop.stop_between_steps() as stop_asked:
            signal.raise_signal(signal.SIGINT)
            assert not stop_asked()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(target_dir, golden_target, env, tmp_path):
    """Truncate a file of the newest checkpoint: the rerun says which one it skips, continues from the one
    before and ends with the same losses and head; with every checkpoint damaged it refuses in one line."""
    train = write_jsonl(tmp_path / "train.jsonl", chain_conversations(next_token_table(*golden_target), 64, 40, seed=0))
    out = tmp_path / "run"
    args = ["--target", target_dir, "--data", train, "--out", out, "--steps", 4, *TINY, "--save-every", 2, "--keep", 3]
    first = run_module("train.eagle3", [*args, "--log-every", 1], env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint_steps(out) == [2, 4]
    rows, head = read_jsonl(out / "metrics.jsonl"), (out / "export" / "model.safetensors").read_bytes()

    def damage(step: int) -> Path:
        biggest = max((p for p in (out / "ckpt" / str(step)).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
        return biggest

    damage(4)
    resumed = run_module("train.eagle3", [*args, "--log-every", 1], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {out / 'ckpt' / '4'} is damaged" in resumed.stderr
    assert f"resuming {out} at step 2" in resumed.stderr
    timing = ("tokens_per_s", "head_flops_per_s", "of_peak")  # the only fields that may differ
    assert read_jsonl(out / "metrics.jsonl") == [
        {**r, **{k: mine[k] for k in timing}} for r, mine in zip(rows, read_jsonl(out / "metrics.jsonl"))
    ]
    assert (out / "export" / "model.safetensors").read_bytes() == head
    assert checkpoint_steps(out) == [2, 4]

    for step in (2, 4):
        damage(step)
    refused = run_module("train.eagle3", args, env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --out: {out / 'ckpt'}: no checkpoint can be restored")
    assert "a new run folder" in last


def test_a_sealed_checkpoint_with_a_truncated_file_is_skipped_without_being_read(tmp_path, monkeypatch):
    """The recorded file sizes decide: orbax is never asked to read a checkpoint known to be damaged (its
    reader threads print tracebacks), and the intact older one is restored."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from eagle_jax.errors import EagleError
    from eagle_jax.training import checkpoints

    mgr = checkpoints.manager(tmp_path / "ckpt", keep=3)
    for step in (1, 2):
        checkpoints.save(mgr, step, {"w": jnp.full((256,), float(step))}, {"step": step})
    checkpoints.close(mgr)
    assert all((tmp_path / "ckpt" / str(s) / checkpoints.SIZES_FILE).is_file() for s in (1, 2))

    def truncate(step: int) -> None:
        files = [
            p for p in (tmp_path / "ckpt" / str(step)).rglob("*") if p.is_file() and p.name != checkpoints.SIZES_FILE
        ]
        biggest = max(files, key=lambda p: p.stat().st_size)
        biggest.write_bytes(biggest.read_bytes()[:-1])

    truncate(2)
    asked: list[int] = []
    real_restore = ocp.CheckpointManager.restore
    monkeypatch.setattr(
        ocp.CheckpointManager, "restore", lambda self, step, **kw: asked.append(step) or real_restore(self, step, **kw)
    )
    logged: list[str] = []
    mgr = checkpoints.manager(tmp_path / "ckpt", keep=3)
    abstract = {
        "w": jax.ShapeDtypeStruct((256,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    }
    state, meta = checkpoints.restore_latest(mgr, abstract, logged.append)
    assert asked == [1] and meta["step"] == 1 and float(state["w"][0]) == 1.0
    assert "is damaged" in logged[0] and "bytes" in logged[0]

    truncate(1)
    asked.clear()
    with pytest.raises(EagleError, match="no checkpoint can be restored"):
        checkpoints.restore_latest(checkpoints.manager(tmp_path / "ckpt", keep=3), abstract, logged.append)
    assert asked == []


@pytest.fixture(scope="module")
def regeneration(target_dir, golden_target, env, workdir) -> tuple[list, Path]:
    """(arguments of a regeneration, the file an uninterrupted run of them writes): one reference for every kill."""
    convs = write_jsonl(workdir / "convs.jsonl", chain_conversations(next_token_table(*golden_target), 160, 8, seed=3))
    args = ["--target", target_dir, "--data", convs, "--max-new-tokens", 6, "--batch-size", 1]  # chunks of 8
    reference = run_module("train.regenerate", [*args, "--out", workdir / "ref.jsonl"], env)
    assert reference.returncode == 0, reference.stderr[-3000:]
    return args, workdir / "ref.jsonl"


@pytest.mark.parametrize("seed", [0, 1])
def test_regeneration_killed_at_a_random_point_continues_to_the_same_file(regeneration, env, tmp_path, seed):
    """kill -9 somewhere after the first chunk was written (mid-chunk or mid-line), rerun: the file equals an
    uninterrupted run's, byte for byte."""
    args, ref = regeneration

    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.regenerate", *map(str, args), "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180
    while not (out.is_file() and out.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(np.random.default_rng(seed).uniform(0, 0.2))
    if proc.poll() is not None:
        pytest.fail(f"regeneration ended (rc {proc.returncode}) before it could be killed")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 0 < written < 160

    resumed = run_module("train.regenerate", [*args, "--out", out], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing after {written} conversations" in resumed.stderr
    assert out.read_bytes() == ref.read_bytes()

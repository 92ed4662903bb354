"""The persistent compilation cache every command keeps (`cli.compile_cache`): a second process loads what the
first compiled, two processes starting at once share it, a damaged entry is compiled again, and it can be off."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from procs import finish, launch

from cli import compile_cache

GOLDEN = Path(__file__).resolve().parent / "golden"
ARGS = ["--target", str(GOLDEN / "target"), "--draft", str(GOLDEN / "eagle3"), "--prompt-ids", "5,6,7,8,9"]
ARGS += ["--max-new-tokens", "6", "--total-tokens", "5", "--depth", "4", "--tree-top-k", "1", "--no-stream"]


def started(root: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env |= {"EAGLE_JAX_CACHE": str(root), compile_cache.OFF: "1", "JAX_LOG_COMPILES": "1", "JAX_PLATFORMS": "cpu"}
    return launch(ARGS, env)


def finished(proc: subprocess.Popen) -> tuple[str, str]:
    code, out, err = finish(proc)
    assert code == 0, err[-2000:]
    return out, err


def loaded(err: str) -> bool:
    """Whether the decode loop came from the cache (JAX_LOG_COMPILES logs each hit)."""
    return any("Persistent compilation cache hit for 'jit_run_loop'" in line for line in err.splitlines())


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    root = tmp_path / "cache"
    first, second = started(root), started(root)  # two processes start at once on an empty cache
    (out_a, err_a), (out_b, _) = finished(first), finished(second)
    assert out_a == out_b and out_a.strip()
    folders = list((root / "jax").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("jax") and "-cpu-" in folders[0].name, folders
    assert list(folders[0].glob("jit_run_loop-*-cache")) and not loaded(err_a)

    out, err = finished(started(root))
    assert out == out_a
    assert loaded(err), err[-3000:]

    for entry in folders[0].glob("*-cache"):  # every entry damaged: compiled again, same answer, no crash
        entry.write_bytes(b"not an executable")
    out, err = finished(started(root))
    assert out == out_a and not loaded(err)
    damaged = "warning: Error reading persistent compilation cache entry"
    assert any(line.startswith(damaged) for line in err.splitlines())


def test_the_cache_can_be_turned_off_and_respects_a_users_jax_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv(compile_cache.OFF, "0")
    assert compile_cache.enable() is None and not (tmp_path / "jax").exists()
    monkeypatch.setenv(compile_cache.OFF, "1")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.enable() is None and not (tmp_path / "jax").exists()


@pytest.mark.parametrize("kind", ["TPU v5 lite", "cpu"])
def test_the_folder_names_versions_platform_and_device_kind(tmp_path, monkeypatch, kind):
    import jax
    import jaxlib

    class Device:
        platform, device_kind = "tpu" if "TPU" in kind else "cpu", kind

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(jax, "devices", lambda: [Device()])
    name = compile_cache.folder().relative_to(tmp_path / "jax").as_posix()
    assert name == f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{Device.platform}-{kind.replace(' ', '_')}", name

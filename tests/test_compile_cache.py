"""The persistent compilation cache every command keeps (`cli.compile_cache`, and the executable store inside it,
`decoding.executables`): a second process loads what the first compiled, two processes starting at once share it, a
damaged entry is compiled again, and it can be off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli import command, compile_cache
from eagle_jax.decoding import executables


def finished(proc: subprocess.Popen) -> tuple[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return out, err


def test_commands_switch_the_cache_on(monkeypatch):
    calls = []
    monkeypatch.setattr(compile_cache, "enable", lambda: calls.append(1))
    assert command.run(lambda argv: 0, []) == 0 and calls == [1]


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


def _session(root: Path) -> subprocess.Popen:
    """tests/session_proc.py (a chat session and a generation on the golden pair) with its cache under `root`."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env |= {"EAGLE_JAX_CACHE": str(root), compile_cache.OFF: "1", "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
    script = Path(__file__).resolve().parent / "session_proc.py"
    pipe = subprocess.PIPE
    return subprocess.Popen([sys.executable, script], env=env, text=True, stdout=pipe, stderr=pipe)


def _report(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = finished(proc)
    return json.loads(out.strip().splitlines()[-1]), err


def test_a_second_process_loads_what_the_first_compiled(tmp_path):
    """The session's programs and the one-shot generation's (an engine's too) come back whole from the executable
    store (neither traced nor compiled); two processes start at once on the empty cache; damaged entries of the
    store and of JAX's cache are compiled again, with the same answers."""
    root = tmp_path / "cache"
    (a, _), (b, _) = (_report(p) for p in [_session(root), _session(root)])  # at once, on an empty cache
    assert a["answer"] == b["answer"] and a["generated"] == b["generated"] and len(a["answer"]) == 12
    assert sorted(a["traced"]) == ["cycle", "cycle", "extend", "extend"], a
    (folder,) = (root / "jax").iterdir()
    assert folder.name.startswith("jax") and "-cpu-" in folder.name, folder
    entries = sorted(folder.glob("executables/*.bin"))
    # the session's 4, and the generation's extend and loop
    assert len(entries) == a["programs"] + 2 == 6 and list(folder.glob("jit_run_loop-*-cache")), entries

    again, err = _report(_session(root))
    assert again == {**a, "traced": [], "compiled": []}, err[-3000:]

    for entry in [*entries, *folder.glob("*-cache")]:  # damaged: compiled again, the same answers, no crash
        entry.write_bytes(b"not an executable")
    damaged, err = _report(_session(root))
    same = ("answer", "generated", "programs")
    assert [damaged[k] for k in same] == [a[k] for k in same] and sorted(damaged["traced"]) == sorted(a["traced"])
    assert "unreadable" in err
    assert "Error reading persistent compilation cache entry for 'jit_run_loop'" in err
    assert all(e.read_bytes() != b"not an executable" for e in entries)


def test_a_program_is_keyed_by_what_it_is_made_of(tmp_path, monkeypatch):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from eagle_jax.decoding import programs, speculative

    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    x = np.zeros((2, 3), np.float32)
    key = lambda fn, arg=x, **static: executables.key(*programs._program(fn, (arg,), static))  # noqa: E731
    base = key(speculative.cycle, span=8)
    assert base and base == key(speculative.cycle, span=8)
    assert len({base, key(speculative.cycle, span=16), key(speculative.extend, span=8)}) == 3
    assert base != key(speculative.cycle, np.zeros((2, 4), np.float32), span=8)
    assert base != key(speculative.cycle, np.zeros((2, 3), np.int32), span=8)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))  # one argument's placements on the same eight devices
    y = np.zeros((8, 8), np.float32)
    placed = [
        key(speculative.cycle, jax.device_put(y, NamedSharding(mesh, spec)), span=8)
        for spec in (P("data"), P("tensor"), P(None, "data"), P())
    ]
    assert None not in placed and len({key(speculative.cycle, y, span=8), *placed}) == 5, placed
    assert key(jax.jit(lambda v: v)) is None  # not a module-level function of the package: its closure is unseen
    assert key(speculative.cycle, span=object()) is None  # a static argument with no stable text

    package = tmp_path / "eagle_jax"  # the package's source is in every key
    shutil.copytree(Path(executables.eagle_jax.__file__).parent, package)
    monkeypatch.setattr(executables.eagle_jax, "__file__", str(package / "__init__.py"))
    same = executables._fingerprint.__wrapped__()
    (package / "decoding" / "speculative.py").write_text("# changed\n", encoding="utf-8")
    assert executables._fingerprint.__wrapped__() != same

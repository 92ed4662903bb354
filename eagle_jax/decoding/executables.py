"""Compiled programs kept on disk between processes: a second start neither traces nor lowers them.

JAX's persistent compilation cache is keyed by the lowered program, so a process that finds its programs there
still traces and lowers each one first: on a second start of the SmolLM2 server that is most of its warm-up. This
store keys a program by what it is made from instead (the package's source, the library versions, the backend,
JAX's settings, the jitted function, its static arguments and its arguments' shapes, dtypes and placements) and
keeps the executable itself (`jax.experimental.serialize_executable`, zlib-compressed), so loading it is all a
second start does.

It lives in `executables/` inside JAX's cache folder and is on whenever that cache is (every command:
`cli.compile_cache`; off in a multi-process run, where JAX's cache serves instead). Only module-level jitted
functions of this package are stored (a closure's captured values are not part of any key). An entry is written
to a private temporary file and renamed (processes starting at once never read half of one); one that cannot be
read is compiled again and replaced; least recently used entries go beyond `MAX_BYTES`. Like JAX's cache, the
folder holds executable code: keep it private to its user.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

import eagle_jax

MAX_BYTES = 2 << 30
LIBRARIES = ("jax", "jaxlib", "numpy", "ml_dtypes")
log = logging.getLogger(__name__)


def folder() -> Path | None:
    """`executables/` in JAX's cache folder, or None when that cache is off or the run has several processes."""
    root = jax.config.jax_compilation_cache_dir
    return Path(root) / "executables" if root and jax.process_count() == 1 else None


@functools.cache
def _fingerprint() -> bytes:
    """What every program depends on: this package's source, the libraries, the backend and JAX's settings."""
    h = hashlib.sha256()
    package = Path(eagle_jax.__file__).parent
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    device = jax.devices()[0]
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if "cache" not in k)
    for name in LIBRARIES:
        h.update(f"{name}={importlib.metadata.version(name)}\0".encode())
    h.update(repr((device.platform, device.client.platform_version, device.device_kind, jax.device_count())).encode())
    h.update(repr((settings, os.environ.get("XLA_FLAGS"), os.environ.get("LIBTPU_INIT_ARGS"))).encode())
    return h.digest()


def _placement(shape: jax.ShapeDtypeStruct) -> tuple | None:
    """A NamedSharding's spec and its mesh's devices in order; () for an unplaced argument; None for others."""
    where = shape.sharding
    if where is None:
        return ()
    if isinstance(where, NamedSharding):
        mesh = where.mesh
        return repr(where.spec), mesh.axis_names, mesh.devices.shape, tuple(d.id for d in mesh.devices.flat)
    return None


def key(fn: Any, static: tuple, tree: Any, shapes: tuple) -> str | None:
    """The key of `fn` (a module-level jitted function of this package) compiled with `static` for arguments
    of pytree `tree` and leaves `shapes`; None for a program this store does not keep, or when it is off."""
    if folder() is None:
        return None
    wrapped = getattr(fn, "__wrapped__", None)
    module = sys.modules.get(getattr(wrapped, "__module__", None) or "")
    if module is None or not module.__name__.startswith("eagle_jax."):
        return None
    name = next((n for n, v in vars(module).items() if v is fn), None)
    placements = tuple(_placement(s) for s in shapes)
    if name is None or None in placements:
        return None
    text = repr((module.__name__, name, static, str(tree), [(s.shape, str(s.dtype)) for s in shapes], placements))
    if " at 0x" in text:  # a static argument without a stable repr
        return None
    return hashlib.sha256(_fingerprint() + text.encode()).hexdigest()


def _devices(compiled: jax.stages.Compiled) -> list:
    """The devices a compiled program runs on, in its order."""
    where = jax.tree.leaves(compiled.input_shardings)[0]
    if isinstance(where, NamedSharding):
        return list(where.mesh.devices.flat)
    return sorted(where.device_set, key=lambda d: d.id)


def load(name: str) -> jax.stages.Compiled | None:
    """The stored program `name` (a `key`), or None when absent or unreadable (then it is compiled again)."""
    base = folder()
    path = base / f"{name}.bin" if base else None
    if path is None or not path.is_file():
        return None
    try:
        payload, in_tree, out_tree, ids = pickle.loads(zlib.decompress(path.read_bytes()))
        by_id = {d.id: d for d in jax.devices()}
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=[by_id[i] for i in ids]
        )
    except Exception as exc:  # noqa: BLE001 (a damaged or foreign entry, whatever the error: compile again)
        log.warning("stored program %s unreadable (%s): compiling it again", path.name, exc)
        return None
    with contextlib.suppress(FileNotFoundError):  # evicted by another process meanwhile
        os.utime(path)  # recently used
    return compiled


def store(name: str, compiled: jax.stages.Compiled) -> None:
    """Keep `compiled` as `name` (skipped when the backend cannot serialise it), then evict beyond MAX_BYTES."""
    base = folder()
    if base is None:
        return
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        blob = zlib.compress(pickle.dumps((payload, in_tree, out_tree, [d.id for d in _devices(compiled)])), 1)
    except Exception as exc:  # noqa: BLE001 (XLA cannot serialise every program: JAX's cache still has it)
        log.info("program %s not stored: %s", name, exc)
        return
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{name}.{os.getpid()}.{threading.get_ident()}.partial"
    tmp.write_bytes(blob)
    os.replace(tmp, base / f"{name}.bin")
    _evict(base)


def _evict(base: Path) -> None:
    entries = []
    for path in base.glob("*.bin"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # evicted by another process meanwhile
            continue
        entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= MAX_BYTES:
            break
        path.unlink(missing_ok=True)
        total -= size

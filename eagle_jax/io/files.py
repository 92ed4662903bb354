"""Small file primitives every reader and writer shares: JSON objects in, atomic writes out.

A write goes to a temporary sibling first and is renamed into place (`os.replace`), so a crash at
any moment leaves either the old file (or folder) or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle_jax.errors import EagleError


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when empty)."""
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def read_json(path: str | Path) -> dict[str, Any]:
    """A JSON object from a file; a missing file, bad JSON or another JSON type is a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"{path}: file not found")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise EagleError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise EagleError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(value, dict):
        raise EagleError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = _temporary(path)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_npz_atomic(path: str | Path, **arrays: np.ndarray) -> None:
    path = Path(path)
    tmp = _temporary(path)
    with tmp.open("wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def check_output_file(path: str | Path, flag: str, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Refuse, before any work, an output file that cannot be written: a folder, a missing or read-only
    parent folder, or one of the command's inputs."""
    path = Path(path)
    if path.is_dir():
        raise EagleError(f"{flag} {path}: is a folder; name a file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise EagleError(f"{flag} {path}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise EagleError(f"{flag} {path}: not writable; choose another path")
    for given in inputs:
        if Path(given).exists() and path.exists() and path.samefile(given):
            raise EagleError(f"{flag} {path}: is also an input; write the output elsewhere")
    return path


def check_new_directory(out: str | Path) -> None:
    """Refuse an output directory that exists and is not empty (nothing is written yet)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EagleError(f"{out.absolute()}: already exists and is not empty")


@contextlib.contextmanager
def new_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place when the block succeeds.

    A non-empty `out` is refused unless `overwrite`, in which case it is replaced only once the new
    contents are complete; on failure the temporary directory is removed and `out` is untouched.
    """
    out = Path(out).absolute()
    if not overwrite:
        check_new_directory(out)
    elif out.exists() and not out.is_dir():
        raise EagleError(f"{out}: exists and is not a directory")
    tmp = _temporary(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)

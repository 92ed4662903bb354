"""Small file primitives every reader and writer shares: JSON objects in, atomic writes out.

A write goes to a temporary sibling first and is renamed into place (`os.replace`), so a crash at
any moment leaves either the old file (or folder) or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
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


Recogniser = Callable[[Path], bool]  # is this existing path this command's own earlier output?


def json_with(*keys: str) -> Recogniser:
    """Recognise a JSON object holding all of `keys` (a command's report)."""

    def ours(path: Path) -> bool:
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return False
        return isinstance(value, dict) and all(k in value for k in keys)

    return ours


def holds_bytes(marker: bytes, within: int = 4096) -> Recogniser:
    """Recognise a file whose first `within` bytes hold `marker` (a report's fixed header, a PNG's title)."""

    def ours(path: Path) -> bool:
        with path.open("rb") as f:
            return marker in f.read(within)

    return ours


def _is_input(path: Path, given: str | Path) -> bool:
    given = Path(given)
    return given.exists() and path.exists() and path.samefile(given)


def _writable_parent(path: Path, setting: str | None) -> None:
    """Refuse a file whose folder is missing or read-only, or a read-only file."""
    parent = path.absolute().parent
    if not parent.is_dir():
        raise EagleError(f"{path}: folder {parent} does not exist; create it first", setting)
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise EagleError(f"{path}: not writable; choose another path", setting)


def check_output_file(
    path: str | Path, setting: str | None, inputs: Iterable[str | Path] = (), ours: Recogniser | None = None
) -> Path:
    """Refuse, before any work, an output file that cannot be written (a folder, a missing or read-only
    parent folder), that is one of the command's inputs, or that exists and is not recognisably this
    command's earlier output (`ours`; without one, any existing file is refused). `setting` names the
    output in the errors (see `EagleError`)."""
    path = Path(path)
    if path.is_dir():
        raise EagleError(f"{path}: is a folder; name a file", setting)
    _writable_parent(path, setting)
    if any(_is_input(path, given) for given in inputs):
        raise EagleError(f"{path}: is also an input; write the output elsewhere", setting)
    if path.exists() and (ours is None or not ours(path)):
        raise EagleError(f"{path}: exists and was not written by this command; move it or choose another path", setting)
    return path


def _holds(out: Path, given: str | Path) -> bool:
    """Is `given` the folder `out` or inside it?"""
    return Path(given).absolute().resolve().is_relative_to(out)


def check_output_directory(
    out: str | Path, inputs: Iterable[str | Path] = (), overwrite: bool = False, owned: Iterable[str] | None = ()
) -> Path:
    """Refuse, before any work, an output folder that is a file, is an input or holds one, cannot
    be created, or exists and is not empty; with `overwrite`, a folder is accepted only when it holds nothing
    but the names this command writes (`owned`; None: the caller recognised the folder as its own)."""
    out = Path(out).absolute()
    if out.exists() and not out.is_dir():
        raise EagleError(f"{out}: is a file, not a folder")
    resolved = out.resolve()
    for given in inputs:
        if _holds(resolved, given):
            raise EagleError(f"{out}: is or holds the input {given}; write the output elsewhere")
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        raise EagleError(f"{out}: cannot be created ({existing} is not a writable folder)")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise EagleError(f"{out}: already exists and is not empty")
        strangers = [] if owned is None else sorted(p.name for p in out.iterdir() if p.name not in set(owned))
        if strangers:
            shown = ", ".join(strangers[:3]) + (" ..." if len(strangers) > 3 else "")
            raise EagleError(
                f"{out}: holds {shown}, which this command did not write; overwriting replaces only its own output",
                "overwrite",
            )
    return out


@contextlib.contextmanager
def new_directory(out: str | Path, overwrite: bool = False, owned: Iterable[str] = ()) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it into place when the block succeeds.

    `out` is checked by `check_output_directory` (with `overwrite` it may hold only the `owned` names); an
    existing one is replaced only once the new contents are complete; on failure the temporary directory
    is removed and `out` is untouched.
    """
    out = check_output_directory(out, overwrite=overwrite, owned=owned)
    tmp, old = _temporary(out), out.with_name(f".{out.name}.old")
    for stale in (tmp, old):  # left by a crash of an earlier run
        shutil.rmtree(stale, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)

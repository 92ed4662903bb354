"""Helpers for the bad-input tables: a refusal is exit code 2 and one `error: ` line, and changes no file."""

from __future__ import annotations

from pathlib import Path


def snapshot(*roots: Path) -> dict[Path, tuple[bytes, int]]:
    """Every file under `roots` (or the file itself) -> (bytes, mtime in ns)."""
    found = {}
    for root in roots:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            found[path] = (path.read_bytes(), path.stat().st_mtime_ns)
    return found


def assert_refused(code: int, err: str, expected: str = "") -> None:
    """Exit code 2 and exactly one stderr line, `error: ...` holding `expected`, without a traceback."""
    lines = [line for line in err.splitlines() if line.strip() and "\r" not in line]  # progress bars aside
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert expected in lines[0], (expected, lines[0])

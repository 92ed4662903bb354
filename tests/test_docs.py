"""The commands the docs show still exist: `sh runnable` blocks run on the demo pair, every other `sh` block's
`python -m` commands name a module whose --help lists the flags they use (convention: docs/how-it-works.md)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELLS = ("sh", "bash", "shell", "console")
PLACEHOLDERS = {"/models/target": str(ROOT / "demo" / "target"), "/models/eagle3": str(ROOT / "demo" / "eagle3")}
LINKED = ("demo", "data", "tests", "configs")  # what runnable commands read by relative paths
OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    runnable: bool
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def shell_blocks(path: Path) -> list[Block]:
    """The fenced `sh` (or bash) blocks of a Markdown file; `sh runnable` marks those the tests run."""
    found, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*(.*)$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if m[1] in SHELLS:
            found.append(Block(path, i + 1, "runnable" in m[2].split(), "\n".join(lines[i + 1 : end])))
        i = end + 1
    return found


def commands(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [c for c in (shlex.join(shlex.split(line, comments=True)) for line in joined.splitlines()) if c]


def python_modules(command: str) -> list[tuple[str, list[str]]]:
    """(module, its --flags) of every `python -m MODULE ...` in a command, quoted ones (ssh --command "...") too."""
    found, words = [], shlex.split(command)
    for i, word in enumerate(words):
        if " " in word and "python" in word:
            found += python_modules(word)
        elif re.fullmatch(r"(\S*/)?python[0-9.]*", word) and i + 2 < len(words) + 1 and words[i + 1 : i + 2] == ["-m"]:
            rest = []
            for w in words[i + 3 :]:
                if w in OPERATORS:
                    break
                rest.append(w)
            found.append((words[i + 2], [w.split("=")[0] for w in rest if w.startswith("--")]))
    return found


@functools.cache
def help_text(module: str) -> str:
    """`python -m module --help`, run in this process (the imports are shared: seconds, not minutes)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    return out.getvalue()


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


BLOCKS = [b for path in DOCS for b in shell_blocks(path)]


def test_the_docs_have_runnable_and_checked_blocks():
    assert any(b.runnable for b in BLOCKS) and any(not b.runnable for b in BLOCKS)
    assert python_modules('ssh --command "cd x && python -m infer.serve --port 1"') == [("infer.serve", ["--port"])]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_and_flags_exist(path):
    problems = []
    for block in (b for b in BLOCKS if b.path == path):
        for command in commands(block.text):
            words = shlex.split(command)
            if words[0] == "make" and len(words) > 1 and words[1] not in make_targets():
                problems.append(f"{block.name}: no Makefile target {words[1]!r}")
            for module, flags in python_modules(command):
                try:
                    text = help_text(module)
                except ImportError as exc:
                    problems.append(f"{block.name}: python -m {module}: {exc}")
                    continue
                listed = set(re.findall(r"--[a-z0-9][a-z0-9-]*", text))
                problems += [
                    f"{block.name}: python -m {module} has no {f} (see --help)" for f in flags if f not in listed
                ]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder where runnable blocks write their outputs; the repository's inputs are linked into it."""
    folder = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (folder / name).symlink_to(ROOT / name)
    return folder


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runnable], ids=lambda b: b.name)
def test_runnable_blocks_run(block, scratch):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    for command in commands(block.text):
        for placeholder, value in PLACEHOLDERS.items():
            command = command.replace(placeholder, value)
        command = re.sub(r"(^|\s)python(?=\s)", lambda m: m[1] + shlex.quote(sys.executable), command)
        done = subprocess.run(
            ["bash", "-c", command], cwd=scratch, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"{block.name}: {command}\n{done.stderr[-2000:]}"

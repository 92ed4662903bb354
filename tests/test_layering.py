"""The package tree is the architecture: nothing imports upward, the commands never import one another."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# library packages, bottom to top; a module imports its own package or lower ranks only
LIBRARY_RANKS = {"errors": 0, "models": 1, "parallel": 2, "io": 3, "decoding": 3, "training": 4, "serving": 4}
COMMANDS = ("infer", "instruments", "train", "convert")  # entry points: they may import the library and `cli`
SHARED_CLI = "cli"


def imports(path: Path) -> set[str]:
    """Absolute module names a file imports (top level and inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def library_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "eagle_jax" and len(parts) > 1 and parts[1] in LIBRARY_RANKS else None


def test_library_layers_point_down():
    problems = []
    for path in sorted((ROOT / "eagle_jax").rglob("*.py")):
        own = path.relative_to(ROOT / "eagle_jax").parts[0].removesuffix(".py")
        if own not in LIBRARY_RANKS:
            continue
        for module in imports(path):
            top = module.split(".")[0]
            if top in COMMANDS + (SHARED_CLI,):
                problems.append(f"{path.relative_to(ROOT)} imports the command layer ({module})")
            other = library_package(module)
            if other is None or other == own:
                continue
            if LIBRARY_RANKS[other] >= LIBRARY_RANKS[own]:
                problems.append(f"{path.relative_to(ROOT)} ({own}) imports {module} ({other}), not below it")
    assert not problems, "\n".join(problems)


def test_commands_never_import_one_another():
    problems = []
    for command in COMMANDS + (SHARED_CLI,):
        for path in sorted((ROOT / command).rglob("*.py")):
            for module in imports(path):
                top = module.split(".")[0]
                if top in COMMANDS and top != command or (command == SHARED_CLI and top in COMMANDS):
                    problems.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not problems, "\n".join(problems)


def test_planted_upward_import_is_caught(tmp_path, monkeypatch):
    """The checker itself: a models module importing decoding is reported."""
    bad = tmp_path / "eagle_jax" / "models" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from eagle_jax.decoding import schedule\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    try:
        test_library_layers_point_down()
    except AssertionError as exc:
        assert "models/bad.py (models) imports eagle_jax.decoding" in str(exc)
    else:
        raise AssertionError("an upward import went unnoticed")


def test_library_errors_name_settings_and_commands_name_flags(capsys):
    """A library error states the value and names its setting; the command line adds the flag."""
    from cli import command
    from eagle_jax.decoding.tree import DynamicTree, check_fits
    from eagle_jax.errors import EagleError

    try:
        check_fits(DynamicTree(8, 2, 300), 256)
    except EagleError as exc:
        assert exc.setting == "tree_top_k" and "--" not in str(exc), str(exc)
        shown = exc
    else:
        raise AssertionError("a tree wider than the draft vocabulary was accepted")

    def main(argv):
        raise shown

    assert command.run(main, []) == 2
    assert capsys.readouterr().err.startswith("error: --tree-top-k: tree top_k=300 exceeds")
    assert command.run(main, [], flags={"tree_top_k": "--width"}) == 2
    assert capsys.readouterr().err.startswith("error: --width: ")


def test_library_messages_name_no_flags():
    """No library module writes a command-line flag into an error message."""
    problems = []
    for path in sorted((ROOT / "eagle_jax").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = ast.unparse(node.exc)
                if "EagleError" in text and " --" in text.replace("'--'", "").replace('"--"', ""):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text[:100]}")
    assert not problems, "\n".join(problems)

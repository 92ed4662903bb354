"""Training-state checkpoints (orbax).

A checkpoint holds the state pytree (trainable parameters, optimiser state) and a JSON `meta`
item (at least the completed step). Orbax writes each step into a temporary directory and renames it
when complete, so a process killed at any moment leaves either a whole checkpoint or one that
`latest_step` ignores (and the next manager removes). Once a save has finished, the sizes of its files
are sealed into `file_sizes.json` next to it; a checkpoint damaged later (a truncated or missing file after
a crash or a full disk) is recognised by them without being read, and skipped on restore in favour of the
newest intact one that `keep` left.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from eagle_jax.errors import EagleError
from eagle_jax.io.files import first_line, read_json, write_json_atomic

PyTree = Any
SIZES_FILE = "file_sizes.json"


def manager(directory: str | Path, keep: int) -> ocp.CheckpointManager:
    """A manager keeping the last `keep` checkpoints; saves happen when `save` is called."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("state", "meta"))


def _step_files(step_dir: Path) -> dict[str, int]:
    """{path relative to the step directory: size in bytes} of the checkpoint's own files."""
    return {
        str(p.relative_to(step_dir)): p.stat().st_size
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and SIZES_FILE not in p.name  # nor its temporary
    }


def _seal_finished(mgr: ocp.CheckpointManager) -> None:
    """Wait for the save in flight, then record the file sizes of every finished checkpoint not yet sealed."""
    mgr.wait_until_finished()
    if jax.process_index() != 0:
        return
    for step in mgr.all_steps():
        step_dir = Path(mgr.directory) / str(step)
        if step_dir.is_dir() and not (step_dir / SIZES_FILE).exists():
            write_json_atomic(step_dir / SIZES_FILE, _step_files(step_dir))


def _damage(step_dir: Path) -> str | None:
    """Why a sealed checkpoint's files no longer match their recorded sizes, or None (also when unsealed)."""
    sizes_file = step_dir / SIZES_FILE
    if not sizes_file.is_file():
        return None
    try:
        recorded = read_json(sizes_file)
    except EagleError as exc:  # a damaged record is itself damage
        return first_line(exc)
    found = _step_files(step_dir)
    for name, size in recorded.items():
        if name not in found:
            return f"{name} is missing"
        if found[name] != size:
            return f"{name} has {found[name]} bytes, {size} were written"
    return None


def save(mgr: ocp.CheckpointManager, step: int, state: PyTree, meta: dict) -> None:
    """Seal the checkpoints already finished, then start saving `state` at `step` (asynchronous after the
    device-to-host copy; orbax waits for the previous save anyway)."""
    _seal_finished(mgr)
    mgr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
    )


def close(mgr: ocp.CheckpointManager) -> None:
    """Finish the save in flight, seal it and release the manager."""
    _seal_finished(mgr)
    mgr.close()


@contextlib.contextmanager
def opened(directory: str | Path, keep: int) -> Iterator[ocp.CheckpointManager]:
    """A `manager` released however the block ends (its finished saves sealed when the block ends normally),
    so none of orbax's threads outlives the run and prints a traceback at exit."""
    mgr = manager(directory, keep)
    try:
        yield mgr
    except BaseException:
        mgr.close()
        raise
    close(mgr)


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    """Silence the named loggers below CRITICAL for the block (their tracebacks of a damaged file would bury
    the one-line report)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def restore_latest(
    mgr: ocp.CheckpointManager, abstract_state: PyTree, log: Callable[[str], None]
) -> tuple[PyTree, dict] | None:
    """(state placed as `abstract_state`'s shardings say, meta) of the newest checkpoint that restores, or None
    when there is none. Newer damaged ones (a truncated file after a crash or a full disk) are logged and
    deleted, so the run saves those steps afresh; when none restores, a one-line `EagleError`."""
    directory = Path(mgr.directory)
    damaged: list[tuple[int, str]] = []
    for step in sorted(mgr.all_steps(), reverse=True):
        why = _damage(directory / str(step))
        if why is not None:  # known damaged without asking orbax (whose reader threads would print tracebacks)
            damaged.append((step, why))
            log(f"warning: checkpoint {directory / str(step)} is damaged ({why}); skipping it")
            continue
        try:
            with _quiet_loggers("absl", "orbax", "jax"):  # a damaged file is reported below, in one line
                restored = mgr.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
        except Exception as exc:  # orbax, tensorstore and JSON raise many kinds for a damaged checkpoint
            damaged.append((step, first_line(exc)))
            log(f"warning: checkpoint {directory / str(step)} is damaged ({first_line(exc)[:200]}); skipping it")
            continue
        for bad, _ in damaged:
            mgr.delete(bad)
        return restored.state, restored.meta
    if damaged:
        step, why = damaged[-1]
        raise EagleError(
            f"{directory}: no checkpoint can be restored (the oldest, step {step}: {why[:200]}); remove {directory} "
            "to restart the run from step 0, or use a new run folder",
            "out",
        )
    return None


def abstract_like(tree: PyTree, shardings: PyTree) -> PyTree:
    """ShapeDtypeStructs with shardings: the restore target for a tree shaped like `tree`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

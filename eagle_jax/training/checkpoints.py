"""Training-state checkpoints (orbax).

A checkpoint holds the state pytree (trainable parameters, optimiser state) and a JSON `meta`
item (at least the completed step). Orbax writes each step into a temporary directory and renames it
when complete, so a process killed at any moment leaves either a whole checkpoint or one that
`latest_step` ignores (and the next manager removes); a checkpoint damaged later (a truncated file) is
skipped on restore in favour of the newest intact one that `keep` left.
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
from eagle_jax.io.files import first_line

PyTree = Any


def manager(directory: str | Path, keep: int) -> ocp.CheckpointManager:
    """A manager keeping the last `keep` checkpoints; saves happen when `save` is called."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_names=("state", "meta"))


def save(mgr: ocp.CheckpointManager, step: int, state: PyTree, meta: dict) -> None:
    """Start saving `state` at `step` (asynchronous after the device-to-host copy)."""
    mgr.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True
    )


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
            "to restart the run from step 0, or use a new --out"
        )
    return None


def abstract_like(tree: PyTree, shardings: PyTree) -> PyTree:
    """ShapeDtypeStructs with shardings: the restore target for a tree shaped like `tree`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

"""Training-state checkpoints (orbax).

A checkpoint holds the state pytree (trainable parameters, optimiser state) and a JSON `meta`
item (at least the completed step). Orbax writes each step into a temporary directory and renames it
when complete, so a process killed at any moment leaves either a whole checkpoint or one that
`latest_step` ignores (and the next manager removes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

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


def restore_latest(mgr: ocp.CheckpointManager, abstract_state: PyTree) -> tuple[PyTree, dict] | None:
    """(state placed as `abstract_state`'s shardings say, meta) of the newest complete checkpoint, or None."""
    step = mgr.latest_step()
    if step is None:
        return None
    restored = mgr.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore())
    )
    return restored.state, restored.meta


def abstract_like(tree: PyTree, shardings: PyTree) -> PyTree:
    """ShapeDtypeStructs with shardings: the restore target for a tree shaped like `tree`."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)

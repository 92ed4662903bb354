"""Logical axes -> mesh axes. Model code names logical axes only; this table places them on a mesh."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.errors import EagleError
from eagle_jax.spec import ParamSpec, is_spec, map_specs

MESH_AXES = ("data", "fsdp", "tensor")

# One table for target, draft, caches and activations.
LOGICAL_RULES: dict[str, tuple[str, ...] | str | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "draft_vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "experts": None,
    "layers": None,
    "head_dim": None,
    "seq": None,
    "cache_seq": None,
    "features": "fsdp",
    "fused": None,
}


def parse_mesh(text: str | None) -> dict[str, int]:
    """'data=2,tensor=4' -> {'data': 2, 'fsdp': 1, 'tensor': 4}."""
    sizes = {axis: 1 for axis in MESH_AXES}
    if not text:
        return sizes
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise EagleError(
                f"bad --mesh entry {part.strip()!r}: expected comma-separated AXIS=N with AXIS in "
                f"{', '.join(MESH_AXES)} (e.g. data=2,tensor=4)"
            )
        sizes[name] = int(value)
    return sizes


def make_mesh(text: str | None, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a (data, fsdp, tensor) mesh whose axis sizes multiply to the device count."""
    sizes = parse_mesh(text)
    devices = list(devices if devices is not None else jax.devices())
    need = math.prod(sizes.values())
    if need != len(devices):
        raise EagleError(
            f"--mesh {text!r} needs {need} devices but {len(devices)} are available; "
            f"make the product of the axis sizes equal {len(devices)}"
        )
    grid = np.array(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def partition_spec(axes: Sequence[str | None], rules: dict = LOGICAL_RULES) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec, never using a mesh axis twice."""
    used: set[str] = set()
    out = []
    for name in axes:
        mesh_axes = rules.get(name) if name else None
        if mesh_axes is None:
            out.append(None)
            continue
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
        free = tuple(a for a in mesh_axes if a not in used)
        used.update(free)
        out.append(free if len(free) > 1 else (free[0] if free else None))
    return PartitionSpec(*out)


def _fit(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes that do not divide a dimension (replicate that dimension instead)."""
    out = []
    for dim, entry in zip(shape, spec):
        if entry is None:
            out.append(None)
            continue
        names = (entry,) if isinstance(entry, str) else entry
        kept = tuple(n for n in names if dim % mesh.shape[n] == 0 or mesh.shape[n] == 1)
        kept = tuple(n for n in kept if mesh.shape[n] > 1)
        out.append(kept if len(kept) > 1 else (kept[0] if kept else None))
    return PartitionSpec(*out)


def logical_sharding(shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, _fit(shape, partition_spec(axes), mesh))


def param_shardings(specs: Any, mesh: Mesh) -> Any:
    """NamedSharding for every parameter spec in a tree."""
    return map_specs(lambda s: logical_sharding(s.shape, s.axes, mesh), specs)


def shard_params(params: Any, specs: Any, mesh: Mesh) -> Any:
    """Place (host or device) parameters onto the mesh by their logical axes."""
    return jax.tree.map(
        lambda p, s: jax.device_put(p, logical_sharding(s.shape, s.axes, mesh)),
        params,
        specs,
        is_leaf=lambda x: is_spec(x),
    )


__all__ = [
    "LOGICAL_RULES",
    "MESH_AXES",
    "ParamSpec",
    "logical_sharding",
    "make_mesh",
    "param_shardings",
    "parse_mesh",
    "partition_spec",
    "shard_params",
]

"""How arrays lie on a device mesh: logical axes -> mesh axes, mesh construction, placement.

Model code names logical axes only (`ParamSpec.axes`, `KVCache` axes); one table, `LOGICAL_RULES`, maps
them onto the mesh axes `data`, `fsdp`, `tensor`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.errors import EagleError
from eagle_jax.models import draft, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.params import map_specs

PyTree = Any

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
    seen: set[str] = set()
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise EagleError(
                f"bad mesh entry {part.strip()!r}: expected comma-separated AXIS=N with AXIS in "
                f"{', '.join(MESH_AXES)} (e.g. data=2,tensor=4)"
            )
        if name in seen:
            raise EagleError(f"bad mesh {text!r}: axis {name} is given twice")
        seen.add(name)
        sizes[name] = int(value)
    return sizes


def make_mesh(text: str | None, devices: Sequence[Any] | None = None) -> Mesh:
    """Build a (data, fsdp, tensor) mesh whose axis sizes multiply to the device count."""
    sizes = parse_mesh(text)
    devices = list(devices if devices is not None else jax.devices())
    for axis in MESH_AXES:
        if len(devices) % sizes[axis]:
            raise EagleError(f"mesh {text!r}: {axis}={sizes[axis]} does not divide the {len(devices)} devices")
    need = math.prod(sizes.values())
    if need != len(devices):
        raise EagleError(
            f"mesh {text!r} needs {need} devices but {len(devices)} are available; "
            f"make the product of the axis sizes equal {len(devices)}"
        )
    grid = np.array(devices).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def mesh_axes(name: str, rules: Mapping[str, Any] = LOGICAL_RULES) -> tuple[str, ...]:
    """The mesh axes a logical axis is split over (empty: replicated)."""
    entry = rules.get(name)
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def rules_for(num_kv_heads: int, mesh: Mesh, rules: Mapping[str, Any] = LOGICAL_RULES) -> dict[str, Any]:
    """The rules for a model with `num_kv_heads` key/value heads on `mesh`.

    Grouped-query attention often has fewer kv heads than the tensor axis (8 kv heads, tensor=16).
    Splitting below one head would cut head_dim across devices, so then the kv projections and the
    KV caches are replicated over tensor instead: every device holds all kv heads (the cache costs
    tensor/kv_heads times more memory than an even split) and its query heads pick their group locally.
    """
    tensor = math.prod(mesh.shape[a] for a in mesh_axes("kv_heads", rules))
    return {**rules, "kv_heads": None} if num_kv_heads < tensor else dict(rules)


def check_dims(mesh: Mesh, dims: Mapping[str, int], what: str, rules: Mapping[str, Any] = LOGICAL_RULES) -> None:
    """Raise a one-line error when the mesh axes of a logical axis do not divide its size.

    dims: logical axis -> size, e.g. {"heads": 64, "vocab": 128256, "batch": 8}.
    """
    for name, size in dims.items():
        axes = [a for a in mesh_axes(name, rules) if mesh.shape[a] > 1]
        split = math.prod(mesh.shape[a] for a in axes)
        if size % split:
            shown = ",".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise EagleError(
                f"mesh {shown} does not divide {name}={size} of the {what} ({name} is split over "
                f"{'*'.join(axes)}); use sizes whose product divides {size}"
            )


def partition_spec(axes: Sequence[str | None], rules: Mapping[str, Any] = LOGICAL_RULES) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec, never using a mesh axis twice."""
    used: set[str] = set()
    out = []
    for name in axes:
        free = tuple(a for a in (mesh_axes(name, rules) if name else ()) if a not in used)
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


def logical_sharding(
    shape: Sequence[int], axes: Sequence[str | None], mesh: Mesh, rules: Mapping[str, Any] = LOGICAL_RULES
) -> NamedSharding:
    return NamedSharding(mesh, _fit(shape, partition_spec(axes, rules), mesh))


def param_shardings(specs: Any, mesh: Mesh, rules: Mapping[str, Any] = LOGICAL_RULES) -> Any:
    """NamedSharding for every parameter spec in a tree."""
    return map_specs(lambda s: logical_sharding(s.shape, s.axes, mesh, rules), specs)


def put(x: Any, sharding: NamedSharding) -> jax.Array:
    """Place one host or device array; host arrays go shard by shard (works across hosts too)."""
    if isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


# ---------------------------------------------------------------- models on a mesh


def target_dims(tcfg: TargetConfig) -> dict[str, int]:
    """Sizes of the target's split logical axes."""
    return {
        "heads": tcfg.num_heads,
        "kv_heads": tcfg.num_kv_heads,
        "mlp": tcfg.intermediate_size,
        "vocab": tcfg.vocab_size,
        "embed": tcfg.hidden_size,
    }


def draft_dims(dcfg: DraftConfig) -> dict[str, int]:
    """Sizes of the draft head's split logical axes."""
    dims = {
        "heads": dcfg.num_heads,
        "kv_heads": dcfg.num_kv_heads,
        "mlp": dcfg.intermediate_size,
        "embed": dcfg.hidden_size,
    }
    return {**dims, "draft_vocab": dcfg.draft_vocab_size} if dcfg.kind == "eagle3" else dims


def check_mesh(mesh: Mesh, tcfg: TargetConfig, dcfg: DraftConfig | None = None, batch: int | None = None) -> None:
    """One-line EagleError when a mesh axis does not divide a model dimension or the batch.

    kv heads fewer than `tensor` are replicated (`rules_for`), not an error.
    """
    check_dims(mesh, target_dims(tcfg), "target", rules_for(tcfg.num_kv_heads, mesh))
    if dcfg is not None:
        check_dims(mesh, draft_dims(dcfg), "draft head", rules_for(dcfg.num_kv_heads, mesh))
    if batch is not None:
        check_dims(mesh, {"batch": batch}, "inputs")


def data_parallelism(mesh: Mesh) -> int:
    """How many ways the batch is split."""
    return math.prod(mesh.shape[a] for a in mesh_axes("batch"))


def target_shardings(tcfg: TargetConfig, mesh: Mesh) -> PyTree:
    """NamedShardings of the target parameter tree (kv projections replicated below tensor)."""
    return param_shardings(target.param_specs(tcfg), mesh, rules_for(tcfg.num_kv_heads, mesh))


def draft_shardings(dcfg: DraftConfig, mesh: Mesh) -> PyTree:
    """NamedShardings of the draft head's parameter tree (vocabulary map replicated)."""
    return param_shardings(draft.param_specs(dcfg), mesh, rules_for(dcfg.num_kv_heads, mesh))


def place(params: PyTree, shardings: PyTree) -> PyTree:
    """Put host or device parameters where `shardings` says (a no-op for arrays already there)."""
    return jax.tree.map(put, params, shardings)

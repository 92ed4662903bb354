"""Parameters described once: shape, dtype and logical axes; init, abstract trees, shardings and loading
checks derive from the description."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleError

PyTree = Any


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, dtype, logical axis names and initialiser kind."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: Any = jnp.float32
    init: str = "normal"  # normal | ones | zeros
    scale: float = 0.02

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: PyTree) -> PyTree:
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def with_dtype(specs: PyTree, dtype: Any, only_float: bool = True) -> PyTree:
    """The same specs with every floating parameter in `dtype`."""

    def cast(s: ParamSpec) -> ParamSpec:
        if only_float and not jnp.issubdtype(s.dtype, jnp.floating):
            return s
        return dataclasses.replace(s, dtype=dtype)

    return map_specs(cast, specs)


def abstract_params(specs: PyTree) -> PyTree:
    """`jax.ShapeDtypeStruct` leaves: the restore / lowering target, no memory allocated."""
    return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs)


def init_params(specs: PyTree, key: jax.Array) -> PyTree:
    """Random parameters following the specs (normal(scale) weights, ones for norms, zeros for biases)."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(s: ParamSpec, k: jax.Array) -> jax.Array:
        if s.init == "ones":
            return jnp.ones(s.shape, s.dtype)
        if s.init == "zeros":
            return jnp.zeros(s.shape, s.dtype)
        return (s.scale * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys)])


def describe_mismatch(
    expected: dict[str, tuple[int, ...]], actual: dict[str, tuple[int, ...]], limit: int = 6
) -> str | None:
    """One line naming missing, unexpected and mis-shaped entries (name -> shape), or None if they agree."""

    def listed(items: list[str]) -> str:
        return ", ".join(items[:limit]) + (f" (+{len(items) - limit} more)" if len(items) > limit else "")

    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    misshaped = [
        f"{k} {tuple(actual[k])} (expected {tuple(expected[k])})"
        for k in sorted(set(expected) & set(actual))
        if tuple(actual[k]) != tuple(expected[k])
    ]
    parts = [
        f"{what} {listed(items)}"
        for what, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped))
        if items
    ]
    return "; ".join(parts) or None


def check_against_specs(params: PyTree, specs: PyTree, what: str) -> None:
    """Raise one error naming every missing, unexpected or mis-shaped parameter."""
    problem = describe_mismatch(
        {k: s.shape for k, s in flatten(specs).items()},
        {k: tuple(np.shape(x)) for k, x in flatten(params).items()},
    )
    if problem:
        raise EagleError(f"{what}: {problem}")


def _is_leaf(x: Any) -> bool:
    """A spec or an array; a quantised weight (`quantize`: it has a shape too) is a node of its values and scales."""
    return is_spec(x) or (hasattr(x, "shape") and not hasattr(x, "qvalue"))


def flatten(tree: PyTree) -> dict[str, Any]:
    """{'a': {'b': x}, 'layers': [y]} -> {'a.b': x, 'layers.0': y}; leaves are specs or arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_leaf)[0]
    return {jax.tree_util.keystr(path, simple=True, separator="."): x for path, x in leaves}


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten`: {'a.b': x, 'layers.0': y} -> {'a': {'b': x}, 'layers': [y]} (digit keys make lists)."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and set(node) == {str(i) for i in range(len(node))}:
            return [node[str(i)] for i in range(len(node))]
        return node

    return listify(tree)


def param_count(specs: PyTree) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))

"""Static-capacity KV cache with per-row lengths.

Slots [0, lengths[b]) of row b hold committed context. A forward writes its T new entries at
slots lengths + offset + [0, T) and does not move `lengths`: the caller commits what it keeps
(`advance`), so rejected tree entries are dropped by length, never by copying the cache.

A forward attends over the first `span` slots only (a static length, the whole capacity by default);
`decoding.schedule` picks the spans.

A cache may be a view of some of its rows (`view`): the arrays stay whole, `rows` [R] names the rows it
reads and writes and `lengths` [R] are theirs. A cycle over a server's live rows computes R rows, not all
of them, and writes in place; `merge` returns the whole cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle_jax.errors import EagleError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, KV, S, D]: each head's keys contiguous, as attention reads them
    v: jax.Array  # [L, B, KV, S, D]
    lengths: jax.Array  # [R] int32 (R = B unless a view)
    rows: jax.Array | None = None  # [R] int32: the rows of a view (None: every row)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]


CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")


def init_cache(num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, dtype) -> KVCache:
    if capacity < 1:
        raise EagleError(f"cache capacity must be positive, got {capacity}")
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def view(cache: KVCache, rows: jax.Array) -> KVCache:
    """The view of rows [R] (int32, distinct) of a whole cache."""
    return KVCache(cache.k, cache.v, cache.lengths[rows], rows)


def merge(lengths: jax.Array, part: KVCache) -> KVCache:
    """The whole cache again from a view written in place, given the whole cache's lengths [B]."""
    return KVCache(part.k, part.v, lengths.at[part.rows].set(part.lengths))


def _row_index(rows: jax.Array | None, n: int) -> jax.Array:
    """[R] the cache rows of a view's R rows (all n rows without one)."""
    return jnp.arange(n) if rows is None else rows


def write(
    cache_k: jax.Array,
    cache_v: jax.Array,
    layer: int,
    slots: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new entries k, v [R, T, KV, D] into layer `layer` at per-row slots [R, T] (of `rows`, or every row)."""
    b, _, kv, _ = k.shape
    index = (layer, _row_index(rows, b)[:, None, None], jnp.arange(kv)[None, :, None], slots[:, None, :])  # [R, KV, T]
    cache_k = cache_k.at[index].set(jnp.swapaxes(k, 1, 2).astype(cache_k.dtype), mode="drop")
    cache_v = cache_v.at[index].set(jnp.swapaxes(v, 1, 2).astype(cache_v.dtype), mode="drop")
    return cache_k, cache_v


def keys_values(
    cache_k: jax.Array, cache_v: jax.Array, layer: int, span: int, rows: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Layer `layer`'s first `span` slots: k, v [R, KV, span, D] (of `rows`, or every row)."""
    if rows is None:
        return cache_k[layer, :, :, :span], cache_v[layer, :, :, :span]
    return cache_k[layer, rows, :, :span], cache_v[layer, rows, :, :span]


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Commit n [B] more entries per row."""
    return dataclasses.replace(cache, lengths=cache.lengths + n.astype(jnp.int32))


def set_lengths(cache: KVCache, lengths: jax.Array) -> KVCache:
    return dataclasses.replace(cache, lengths=lengths.astype(jnp.int32))


def compact(cache: KVCache, src: jax.Array) -> KVCache:
    """Move entries at slots lengths + src [B, N] to lengths + [0, N), in every layer.

    Used to commit an accepted tree path: src are the path's node indices (root first); entries
    past the accepted length are moved too but stay beyond `lengths` until overwritten.
    """
    b, n = src.shape
    start = cache.lengths[:, None]
    rows, heads = _row_index(cache.rows, b)[:, None, None], jnp.arange(cache.k.shape[2])[None, :, None]
    src_slots = jnp.clip(start + src, 0, cache.capacity - 1)[:, None, :]  # [R, 1, N]
    dst = (slice(None), rows, heads, (start + jnp.arange(n)[None, :])[:, None, :])  # [R, KV, N] after the layer axis
    moved_k = cache.k[:, rows, heads, src_slots]  # [L, R, KV, N, D]
    moved_v = cache.v[:, rows, heads, src_slots]
    return dataclasses.replace(
        cache, k=cache.k.at[dst].set(moved_k, mode="drop"), v=cache.v.at[dst].set(moved_v, mode="drop")
    )


def window_mask(cache: KVCache, new_mask: jax.Array, span: int) -> jax.Array:
    """Attention mask [B, T, span] over the first `span` cache slots.

    A query sees committed slots (< lengths) plus the window [lengths, lengths + W) as allowed by
    new_mask [B, T, W] (the uncommitted entries written by this and earlier calls).
    """
    b, t, w = new_mask.shape
    slots = jnp.arange(span)[None, None, :]
    rel = slots - cache.lengths[:, None, None]  # [B, 1, span]
    committed = committed_mask(cache, span)
    in_window = (rel >= 0) & (rel < w)
    picked = jnp.take_along_axis(new_mask, jnp.broadcast_to(jnp.clip(rel, 0, w - 1), (b, t, span)), axis=2)
    return committed | (in_window & picked)


def committed_mask(cache: KVCache, span: int) -> jax.Array:
    """[B, 1, span]: which of the first `span` slots hold committed entries."""
    return jnp.arange(span)[None, None, :] < cache.lengths[:, None, None]


def write_path(cache: KVCache, k: jax.Array, v: jax.Array, path: jax.Array) -> KVCache:
    """Write the new entries k, v [L, B, KV, N, D] at nodes `path` [B, P] to slots lengths + [0, P) in every
    layer (a tree's accepted path, root first, committed in one scatter; slots past what is committed stay
    beyond `lengths` until overwritten)."""
    b, p = path.shape
    index = path[:, None, :, None]  # [R, 1, P, 1]
    rows, heads = _row_index(cache.rows, b)[:, None, None], jnp.arange(k.shape[2])[None, :, None]
    dst = (slice(None), rows, heads, (cache.lengths[:, None] + jnp.arange(p)[None, :])[:, None, :])  # [B, KV, P]
    picked = [jnp.take_along_axis(a, index[None], axis=3) for a in (k, v)]  # [L, B, KV, P, D]
    return dataclasses.replace(
        cache,
        k=cache.k.at[dst].set(picked[0].astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[dst].set(picked[1].astype(cache.v.dtype), mode="drop"),
    )


def span_of(cache: KVCache, span: int | None) -> int:
    """The attended span: `span`, or the whole capacity when None."""
    if span is None:
        return cache.capacity
    if not 1 <= span <= cache.capacity:
        raise EagleError(f"attention span {span} must lie in [1, cache capacity {cache.capacity}]")
    return span

"""A prefix cache across rows: a new prompt starts from the longest cached prefix of its tokens.

Rows keep their contiguous caches (`kv_cache`); beside them lies a pool of blocks of `BLOCK` positions on device
holding copies of the target's keys and values and the head's (EAGLE-3's draft cache holds what its fused features
gave, EAGLE-1's what its features gave: nothing else of a prefix is needed to go on from it). A host index maps the
hash of a prompt's prefix up to each block's end (chained: block j's key hashes block j-1's key and block j's
tokens) to the block that holds it. A hit copies the blocks into the row before the rest of the prompt is fed (one
program, a loop over the blocks); a retiring row copies out its full blocks that are not cached yet. Rows never read
the pool, so evicting a block cannot touch a running row.

Least recently used blocks go first; a prefix's blocks are touched from its end back to its first, so a chain is
evicted from its end and what is left of it stays reachable. Copying was chosen over rows that share paged blocks
by measurement (`instruments.prefix_bench`): a hit's copy costs a small fraction of the prefill it saves, and
paged attention would gather every row's blocks on every cycle.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding.speculative import SpecState
from eagle_jax.errors import EagleError
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.kv_cache import KVCache

BLOCK = 16  # positions per block (vLLM's default)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
    """Cached blocks on device: the target's and the head's keys and values."""

    arrays: tuple[jax.Array, ...]  # (target k, target v[, draft k, draft v]) each [L, N, KV, BLOCK, D]


def _caches(state: SpecState) -> tuple[KVCache, ...]:
    return (state.target_cache,) if state.draft_cache is None else (state.target_cache, state.draft_cache)


def _arrays(state: SpecState) -> tuple[jax.Array, ...]:
    """The state's cache arrays [L, B, KV, S, D], in the pool's order."""
    return tuple(a for c in _caches(state) for a in (c.k, c.v))


def empty_pool(state: SpecState, blocks: int) -> Pool:
    """A pool of `blocks` blocks shaped like the state's caches."""
    shape = lambda a: (a.shape[0], blocks, a.shape[2], BLOCK, a.shape[4])  # noqa: E731
    return Pool(tuple(jnp.zeros(shape(a), a.dtype) for a in _arrays(state)))


def bytes_per_token(tcfg: TargetConfig, dcfg: DraftConfig | None, dtype: Any) -> int:
    """Device bytes one cached position takes: the target's keys and values, and the head's."""
    models = (tcfg,) if dcfg is None else (tcfg, dcfg)
    return sum(2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(dtype).itemsize for c in models)


@functools.partial(jax.jit, donate_argnames=("state",))
def copy_in(state: SpecState, pool: Pool, blocks: jax.Array, count: jax.Array, row: jax.Array, history: jax.Array):
    """The state with the first count [] of blocks [M] (pool ids) copied to positions [0, count * BLOCK) of row []
    of its caches, and that row's history [S] set to `history` (the prompt it now holds)."""

    def one(i: jax.Array, arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out = []
        for a, p in zip(arrays, pool.arrays):
            block = jax.lax.dynamic_slice_in_dim(p, blocks[i], 1, axis=1)  # [L, 1, KV, BLOCK, D]
            out.append(jax.lax.dynamic_update_slice(a, block, (0, row, 0, i * BLOCK, 0)))
        return tuple(out)

    arrays = iter(jax.lax.fori_loop(0, count, one, _arrays(state)))
    caches = [dataclasses.replace(c, k=next(arrays), v=next(arrays)) for c in _caches(state)]
    return dataclasses.replace(
        state,
        target_cache=caches[0],
        draft_cache=caches[1] if len(caches) > 1 else None,
        history=state.history.at[row].set(history),
    )


@functools.partial(jax.jit, donate_argnames=("pool",))
def copy_out(pool: Pool, state: SpecState, row: jax.Array, sources: jax.Array, count: jax.Array, blocks: jax.Array):
    """The pool with blocks[i] (pool ids [M]) holding the positions of block sources[i] ([M]: positions
    [sources[i] * BLOCK, (sources[i] + 1) * BLOCK)) of row [] of the state's caches, for i < count []."""

    def one(i: jax.Array, arrays: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        out = []
        for p, a in zip(arrays, _arrays(state)):
            size = (a.shape[0], 1, a.shape[2], BLOCK, a.shape[4])
            block = jax.lax.dynamic_slice(a, (0, row, 0, sources[i] * BLOCK, 0), size)  # [L, 1, KV, BLOCK, D]
            out.append(jax.lax.dynamic_update_slice_in_dim(p, block, blocks[i], axis=1))
        return tuple(out)

    return Pool(jax.lax.fori_loop(0, count, one, pool.arrays))


def block_keys(tokens: Sequence[int]) -> list[bytes]:
    """The key of each full block of `tokens`: a hash of every token up to that block's end."""
    keys, key = [], b""
    ids = np.asarray(tokens, np.int64)
    for j in range(len(ids) // BLOCK):
        key = hashlib.blake2b(key + ids[j * BLOCK : (j + 1) * BLOCK].tobytes(), digest_size=16).digest()
        keys.append(key)
    return keys


class Index:
    """The host's side of the pool: which prefix each block holds, least recently used first, and free blocks."""

    def __init__(self, blocks: int):
        self.blocks = blocks
        self.used: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> block, LRU first
        self.free = list(range(blocks))
        self.evicted = 0  # blocks evicted so far

    @property
    def tokens(self) -> int:
        """Positions the pool holds."""
        return len(self.used) * BLOCK

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Most recently used: a chain's first block last (evicted after its descendants)."""
        for key in reversed(keys):
            self.used.move_to_end(key)

    def lookup(self, tokens: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of `tokens` (in order), touched."""
        keys = []
        for key in block_keys(tokens):
            if key not in self.used:
                break
            keys.append(key)
        self._touch(keys)
        return [self.used[k] for k in keys]

    def insert(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Make room for the full blocks of `tokens` (positions whose caches are valid) that are not cached yet,
        evicting the least recently used blocks of other prefixes; (block index in `tokens`, pool block) of each
        one to copy out. The prefix's own blocks are never evicted for it: beyond the pool, its end is left out."""
        keys = block_keys(tokens)
        new: list[tuple[int, int]] = []
        mine = set(keys)
        for j, key in enumerate(keys):
            if key in self.used:
                self.used.move_to_end(key)
                continue
            if not self.free:
                victim = next((k for k in self.used if k not in mine), None)
                if victim is None:
                    keys = keys[:j]
                    break
                self.free.append(self.used.pop(victim))
                self.evicted += 1
            self.used[key] = self.free.pop()
            new.append((j, self.used[key]))
        self._touch(keys)
        return new

    def clear(self) -> None:
        self.used.clear()
        self.free = list(range(self.blocks))


def blocks_for(tokens: int) -> int:
    """Pool blocks for a budget of `tokens` cached positions (whole blocks, rounded down)."""
    return tokens // BLOCK


def check_budget(tokens: int, per_token: int, free_bytes: int | None) -> None:
    """Refuse a budget whose pool cannot fit in the device's free memory (None: unknown, allowed)."""
    need = blocks_for(tokens) * BLOCK * per_token
    if free_bytes is not None and need > free_bytes:
        raise EagleError(
            f"{tokens} cached tokens need {need / 2**30:.2f} GiB ({per_token} bytes each) but the device has "
            f"{free_bytes / 2**30:.2f} GiB free; lower it",
            "prefix_tokens",
        )


def free_bytes(device: jax.Device) -> int | None:
    """Memory the device has free: an accelerator's limit less what is in use, the host's available memory."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None

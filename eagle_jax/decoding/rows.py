"""Sampling settings per row, as arrays: rows with different temperatures, top-p, top-k and seeds share
one compiled program (what a server batching many requests needs).

The token at sequence position t of a row is drawn with the key fold_in(key(seed), t), whatever the
cycle, the tree or the other rows: so a seeded request gives the same answer at any load, with any tree
and with plain decoding. This stays lossless: a cycle's emitted tokens depend only on the keys of the
positions it emits (the accepted chain and its bonus); the keys of deeper positions decided only
rejected nodes, so drawing those positions again next cycle with the same keys is drawing fresh noise.
A row's processed distribution is exactly `sampling.processed_logits` for its settings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding.sampling import SamplingConfig, argmax, filtered


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowControls:
    temperature: jax.Array  # [B] float32; 0 = greedy
    top_p: jax.Array  # [B] float32; 1 = off
    top_k: jax.Array  # [B] int32; 0 = off
    seed: jax.Array  # [B] uint32

    @staticmethod
    def of(settings: list[SamplingConfig], seeds: list[int]) -> RowControls:
        """Host-side arrays for one setting and seed per row."""
        return RowControls(
            temperature=np.asarray([s.temperature for s in settings], np.float32),
            top_p=np.asarray([s.top_p for s in settings], np.float32),
            top_k=np.asarray([s.top_k for s in settings], np.int32),
            seed=np.asarray(seeds, np.uint32),
        )


def processed_logits(logits: jax.Array, c: RowControls) -> jax.Array:
    """Logits [B, N, V] -> float32 logits after each row's temperature, top-k and top-p (rows with
    temperature 0 are returned unscaled: callers take their argmax)."""
    t, top_k, top_p = (a[:, None, None] for a in (jnp.where(c.temperature > 0, c.temperature, 1.0), c.top_k, c.top_p))
    x = logits.astype(jnp.float32) / t
    needs_filter = jnp.any((c.temperature > 0) & (((c.top_k > 0) & (c.top_k < x.shape[-1])) | (c.top_p < 1)))
    return jax.lax.cond(needs_filter, lambda x: filtered(x, top_k, top_p), lambda x: x, x)


def sample(logits: jax.Array, c: RowControls, positions: jax.Array) -> jax.Array:
    """Draw token ids [B, N] from logits [B, N, V]: row b's draw for the token at sequence position
    positions [B, N] uses fold_in(key(seed_b), position) and the row's own settings."""
    greedy = argmax(logits)

    def draw(logits: jax.Array) -> jax.Array:
        x = processed_logits(logits, c)
        keys = jax.vmap(lambda seed, pos: jax.vmap(lambda p: jax.random.fold_in(jax.random.key(seed), p))(pos))(
            c.seed, positions
        )  # [B, N]
        pick = lambda key, row: jax.random.categorical(key, row)  # noqa: E731
        drawn = jax.vmap(jax.vmap(pick))(keys, x).astype(jnp.int32)
        return jnp.where((c.temperature > 0)[:, None], drawn, greedy)

    return jax.lax.cond(jnp.any(c.temperature > 0), draw, lambda _: greedy, logits)

"""Appending new tokens to per-row output buffers, and the stop rule both decoders share.

A row's output is `out[b, :counts[b]]`; slots past it hold PAD_ID. A step (one token for plain
decoding, root + accepted drafts for a speculative cycle) appends a prefix of its tokens, cut at the
row's budget and just after the first eos id (which is kept).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.models.config import TargetConfig

PAD_ID = -1  # fills the output buffer past each row's last token


def is_eos(tokens: jax.Array, cfg: TargetConfig) -> jax.Array:
    """tokens [...] -> [...] bool: is each token one of the config's eos ids."""
    if not cfg.eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(cfg.eos_token_ids, tokens.dtype))


def emit(
    out: jax.Array, counts: jax.Array, limits: jax.Array, tokens: jax.Array, n: jax.Array, cfg: TargetConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Append the first n [B] of tokens [B, T] to out [B, S] at counts [B], at most up to limits [B] and
    through the first eos. Returns (out, counts, hit_eos [B])."""
    offsets = jnp.arange(tokens.shape[1])[None, :]
    valid = (offsets < n[:, None]) & (offsets < (limits - counts)[:, None])
    eos_at = valid & is_eos(tokens, cfg)
    hit_eos = jnp.any(eos_at, axis=-1)
    valid = valid & (~hit_eos[:, None] | (offsets <= jnp.argmax(eos_at, axis=-1)[:, None]))
    rows = jnp.arange(tokens.shape[0])[:, None]
    out = out.at[rows, counts[:, None] + offsets].set(jnp.where(valid, tokens, PAD_ID), mode="drop")
    return out, counts + jnp.sum(valid, axis=-1, dtype=counts.dtype), hit_eos

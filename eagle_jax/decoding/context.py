"""Drafts from the context: candidates copied from a row's own history, grafted onto the head's tree.

`propose` finds the longest suffix (up to MAX_NGRAM tokens) of a row's committed tokens, root included,
at its most recent earlier occurrence in the same row (prompt and answer) and proposes the tokens that
followed it there: prompt lookup, on device, with static shapes. The search compares every history slot
with the suffix, MAX_NGRAM comparisons per slot, a small cost beside the target's forward.

`graft` joins those candidates to a tree: walking from the root, a candidate equal to an existing child
of the node reached so far merges with it (siblings stay distinct, which the acceptance rule needs to keep
the target's distribution); the rest hangs off the deepest shared node as a chain. Slots of merged or
missing candidates hold `NO_TOKEN`, which no target choice equals, so they are never accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_NGRAM = 4  # longest suffix matched
NO_TOKEN = -1  # an unused candidate slot (verified as token 0, never accepted)


def propose(history: jax.Array, lengths: jax.Array, k: int, min_match: int = 1) -> tuple[jax.Array, jax.Array]:
    """history [B, S] committed tokens by position with the root at lengths [B] -> candidates [B, k] and
    valid [B, k]: the k tokens after the latest earlier occurrence of the longest matching suffix (min_match <=
    n <= MAX_NGRAM; ties go to the most recent), valid up to the root's position (none when nothing matches)."""
    b, s = history.shape
    pos = jnp.arange(s)[None, :]  # [1, S]
    run = jnp.ones((b, s), bool)  # the slots whose last i tokens all match the suffix's
    matched = jnp.zeros((b, s), jnp.int32)
    for i in range(MAX_NGRAM):
        suffix = jnp.take_along_axis(history, jnp.maximum(lengths - i, 0)[:, None], axis=1)  # [B, 1]
        earlier = jnp.pad(history, ((0, 0), (i, 0)), constant_values=NO_TOKEN)[:, :s]  # earlier[j] = history[j - i]
        run = run & (earlier == suffix) & (pos >= i) & (lengths[:, None] >= i)
        matched = matched + run
    score = jnp.where((pos < lengths[:, None]) & (matched >= min_match), matched * s + pos, -1)  # longest, then latest
    best = jnp.argmax(score, axis=1)  # [B]
    found = jnp.max(score, axis=1) >= 0
    at = best[:, None] + 1 + jnp.arange(k)[None, :]  # [B, k]
    valid = found[:, None] & (at <= lengths[:, None])
    tokens = jnp.take_along_axis(history, jnp.minimum(at, s - 1), axis=1)
    return jnp.where(valid, tokens, NO_TOKEN), valid


def graft(
    tokens: jax.Array, parents: jax.Array, candidates: jax.Array, valid: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A tree's tokens and parents [B, N] with candidates [B, k] (valid [B, k], a prefix of each row) grafted on:
    -> [B, N + k]. Candidate i fills slot N + i when it is new, else the slot holds NO_TOKEN under the root."""
    b, n = tokens.shape
    k = candidates.shape[1]
    node = jnp.zeros((b,), jnp.int32)  # deepest node shared so far
    shared = jnp.zeros((b,), jnp.int32)  # candidates merged into the tree
    following = jnp.ones((b,), bool)
    for i in range(k):
        child = (parents == node[:, None]) & (tokens == candidates[:, i : i + 1]) & (jnp.arange(n) > 0)
        following = following & valid[:, i] & jnp.any(child, axis=1)
        node = jnp.where(following, jnp.argmax(child, axis=1), node).astype(jnp.int32)
        shared = shared + following
    i = jnp.arange(k)[None, :]
    new = valid & (i >= shared[:, None])
    parent = jnp.where(i == shared[:, None], node[:, None], n + i - 1)
    return (
        jnp.concatenate([tokens, jnp.where(new, candidates, NO_TOKEN)], axis=1),
        jnp.concatenate([parents, jnp.where(new, parent, 0).astype(parents.dtype)], axis=1),
    )

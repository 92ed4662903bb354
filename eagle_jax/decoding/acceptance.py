"""Which drafted tokens a cycle keeps, and the statistics of how many it keeps.

At every tree node the target's choice is drawn from its processed distribution p (argmax when
greedy). A node is accepted when every node on its path equals the choice at its parent; the deepest
accepted node ends the path and its choice is the bonus token. For sampling this is exactly
upstream's EAGLE-2/3 rule with a deterministic draft (q = 1): trying the distinct children x_1, x_2,
... in order, accepting x_i with probability p(x_i) after zeroing and renormalising rejected ones,
accepts x_i with total probability p(x_i) and, when all are rejected, samples the bonus from p
restricted to the other tokens -- which is what one draw y ~ p followed by "move to the child whose
token is y, else emit y" does. So the output distribution equals the target's (lossless), and
greedy output equals plain greedy decoding.

Statistics: tau = tokens per cycle; the accept-length histogram counts cycles by accepted drafts
(0..max_accept); n-alpha[n] is the acceptance rate at depth n given that depth n-1 was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding.tree import Tree, root_paths


def accept(tr: Tree, choice: jax.Array, path_len: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The deepest node whose every path node equals the target's choice at its parent.

    choice [B, N] is the target's token after each node. Returns accept_len [B] (accepted draft
    tokens), path [B, path_len] (root-to-node indices, 0 past accept_len) and the bonus token [B].
    """
    rows = jnp.arange(tr.tokens.shape[0])
    agrees = (tr.tokens == jnp.take_along_axis(choice, tr.parents, axis=1)).at[:, 0].set(True)
    accepted = jnp.all(jnp.where(tr.mask, agrees[:, None, :], True), axis=-1)  # [B, N]
    best = jnp.argmax(jnp.where(accepted, tr.depths, -1), axis=-1)  # [B]
    accept_len = tr.depths[rows, best]
    path = root_paths(tr.mask[rows, best][:, None, :], tr.depths, path_len)[:, 0]
    path = jnp.where(jnp.arange(path_len)[None, :] <= accept_len[:, None], path, 0)
    return accept_len, path, choice[rows, best]


def accept_histogram(accept_lengths: Sequence[int], max_accept: int) -> list[int]:
    """Counts of accept lengths 0..max_accept."""
    return np.bincount(np.asarray(accept_lengths, np.int64), minlength=max_accept + 1)[: max_accept + 1].tolist()


def n_alpha(histogram: Sequence[int]) -> list[float | None]:
    """Acceptance rate at depth n = 1..len(histogram) - 1 given that depth n - 1 was accepted (None: never reached)."""
    hist = np.asarray(histogram, np.float64)
    reached = hist[::-1].cumsum()[::-1]  # reached[n] = cycles with accept >= n
    return [float(reached[n] / reached[n - 1]) if reached[n - 1] else None for n in range(1, len(hist))]

"""Log-probabilities of the emitted tokens under the target, and their most likely alternatives, recorded on device.

They are raw: the log-softmax of the target's logits, before temperature, top-k and top-p (vLLM's default
`logprobs_mode`, "raw_logprobs"), taken from the forward that chose the token: a cycle's verification (or, for a
turn's first token, the forward over the prompt's last chunk). A cycle's verification gives the target's
distribution after each node of the accepted path: these are the distributions of the accepted drafts (emitted this
cycle after the root) and of the bonus (emitted next cycle as its root). So a row's buffers are laid out as its output
(`SpecState.out`): entry p belongs to output token p, and a cycle that starts at count c writes entries c + 1 onward.

Only rows that asked (`wanted`, set when a turn starts) record, and a program computes the top-k only when some row
it steps asked: rows that did not ask pay a few scatters of nothing. The number of alternatives K is static (the
settings' `logprobs`); a request asks for any number up to it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP = 20  # the alternatives a server keeps per token (OpenAI's bound on top_logprobs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Per-row buffers beside the output (B rows, S = cache capacity, K alternatives), or the view of R of their
    rows (`view`: the buffers stay whole and are written in place, as a cache view's)."""

    wanted: jax.Array  # [B] (a view: [R]) bool: the row's current turn records
    chosen: jax.Array  # [B, S] float32: logprob of output token p
    top_ids: jax.Array  # [B, S, K] int32: the K most likely tokens at output position p, most likely first
    top: jax.Array  # [B, S, K] float32: their logprobs
    rows: jax.Array | None = None  # [R] int32: a view's rows of the buffers


def view(lp: Logprobs, rows: jax.Array) -> Logprobs:
    """The view of rows [R] (int32, distinct)."""
    return dataclasses.replace(lp, wanted=lp.wanted[rows], rows=rows)


def merge(wanted: jax.Array, part: Logprobs) -> Logprobs:
    """The whole again from a view written in place, given the whole's `wanted` [B]."""
    return dataclasses.replace(part, wanted=wanted.at[part.rows].set(part.wanted), rows=None)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's logprob under the target and its top alternatives (most likely first), on the host."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def empty(batch: int, capacity: int, k: int) -> Logprobs:
    return Logprobs(
        wanted=jnp.zeros((batch,), bool),
        chosen=jnp.zeros((batch, capacity), jnp.float32),
        top_ids=jnp.zeros((batch, capacity, k), jnp.int32),
        top=jnp.zeros((batch, capacity, k), jnp.float32),
    )


def of(logits: jax.Array, nodes: jax.Array, tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logits [B, N, V], the nodes [B, T] whose distributions count and the tokens [B, T] chosen from them -> (their
    logprobs [B, T], the top-k ids [B, T, k] and logprobs [B, T, k])."""
    logits = jnp.take_along_axis(logits, nodes[:, :, None], axis=1)  # [B, T, V]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, ids = jax.lax.top_k(logp, k)
    chosen = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    return chosen, ids.astype(jnp.int32), top


def record(
    lp: Logprobs, logits: jax.Array, nodes: jax.Array, tokens: jax.Array, at: jax.Array, n: jax.Array
) -> Logprobs:
    """`lp` with the logprobs of tokens [B, T] under the logits [B, N, V] of nodes [B, T] written at output positions
    at [B] + [0, T), the first n [B] of each row that wants them (the rest untouched); computed only when some such
    row exists."""
    b, t = tokens.shape
    k, capacity = lp.top.shape[-1], lp.chosen.shape[1]
    offsets = jnp.arange(t)[None, :]
    write = lp.wanted[:, None] & (offsets < n[:, None])  # [B, T]

    def nothing(*_):
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, k), jnp.int32), jnp.zeros((b, t, k), jnp.float32)

    chosen, ids, top = jax.lax.cond(jnp.any(write), functools.partial(of, k=k), nothing, logits, nodes, tokens)
    rows = (jnp.arange(b) if lp.rows is None else lp.rows)[:, None]
    where = jnp.where(write, at[:, None] + offsets, capacity)  # past the buffer: dropped
    return dataclasses.replace(
        lp,
        chosen=lp.chosen.at[rows, where].set(chosen, mode="drop"),
        top_ids=lp.top_ids.at[rows, where].set(ids, mode="drop"),
        top=lp.top.at[rows, where].set(top, mode="drop"),
    )


def start(lp: Logprobs, starts: jax.Array, wanted: jax.Array | None) -> Logprobs:
    """Rows starting a turn (starts [B] bool) record when `wanted` [B] says so (None: every one)."""
    wanted = starts if wanted is None else wanted
    return dataclasses.replace(lp, wanted=jnp.where(starts, wanted, lp.wanted))


@jax.jit
def row(lp: Logprobs, slot: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One row's buffers: chosen [S], top ids [S, K], top [S, K] (one program for every row)."""
    return lp.chosen[slot], lp.top_ids[slot], lp.top[slot]


def tokens_of(buffers: tuple[np.ndarray, ...], tokens: list[int], first: int) -> list[TokenLogprobs]:
    """The `TokenLogprobs` of `tokens`, a row's output tokens from position `first` on (`row`'s buffers, read)."""
    chosen, ids, top = buffers
    return [
        TokenLogprobs(t, float(chosen[p]), tuple(zip(ids[p].tolist(), top[p].tolist())))
        for p, t in enumerate(tokens, first)
    ]

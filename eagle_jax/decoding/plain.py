"""Plain (non-speculative) decoding with the target: one jitted prefill, then one jitted decode loop.

The decode loop is a `lax.while_loop` over one-token steps with the state donated: no host round
trip per token. It runs in segments over growing attention spans (`schedule.run_segments`). Rows stop
independently on an eos id (kept in the output) or on their token budget; the loop ends when every
row is done. Prompts are sized and padded by `schedule.prepare`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import schedule
from eagle_jax.decoding.emit import PAD_ID, emit
from eagle_jax.decoding.sampling import SamplingConfig, sample
from eagle_jax.models import kv_cache, target
from eagle_jax.models.config import TargetConfig
from eagle_jax.models.kv_cache import KVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Carry of the decode loop (B rows, C = cache capacity)."""

    step: jax.Array  # [] int32: index of the next token to generate
    last: jax.Array  # [B] int32: each row's latest token (fed at the next step)
    done: jax.Array  # [B] bool
    eos: jax.Array  # [B] bool: the row ended on an eos id
    counts: jax.Array  # [B] int32: tokens generated so far
    limits: jax.Array  # [B] int32: per-row budgets
    out: jax.Array  # [B, C] int32: generated tokens, PAD_ID past counts
    cache: KVCache


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row (eos included when it stopped the row)
    stop_reasons: list[str]  # per row: "eos" or "length"
    bucket: int  # padded prompt length
    capacity: int  # cache slots per row


@functools.partial(jax.jit, static_argnames=("cfg", "sc", "capacity"))
def prefill(
    params: dict,
    tokens: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    *,
    cfg: TargetConfig,
    sc: SamplingConfig,
    capacity: int,
) -> tuple[KVCache, jax.Array]:
    """Fill a fresh cache with right-padded prompts and sample each row's first new token.

    tokens [B, P] (row b valid up to lengths[b]), lengths [B] -> (cache with lengths set, first [B] int32).
    The first token of row b comes from the logits at position lengths[b] - 1 (step key fold_in(key, 0)).
    """
    out = target.prefill(params, cfg, tokens, capacity)
    last_hidden = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    logits = target.lm_logits(params, cfg, last_hidden)  # [B, V]
    first = sample(jax.random.fold_in(key, 0), logits, sc)
    return kv_cache.set_lengths(out.cache, lengths), first


@functools.partial(jax.jit, static_argnames=("cfg",))
def init_state(cache: KVCache, first: jax.Array, limits: jax.Array, cfg: TargetConfig) -> DecodeState:
    """Decode state after prefill: first [B] is generated token 0; limits [B] are the per-row budgets."""
    b = first.shape[0]
    empty = jnp.full((b, cache.capacity), PAD_ID, jnp.int32)
    out, counts, eos = emit(empty, jnp.zeros((b,), jnp.int32), limits, first[:, None], jnp.ones((b,), jnp.int32), cfg)
    return DecodeState(jnp.int32(1), first, eos | (counts >= limits), eos, counts, limits, out, cache)


@functools.partial(jax.jit, static_argnames=("cfg", "sc"), donate_argnames=("state",))
def extend(
    params: dict, state: DecodeState, start, tokens, n, final, limits, key, *, cfg: TargetConfig, sc: SamplingConfig
) -> DecodeState:
    """Feed a chunk of a conversation into a cache kept from earlier chunks and turns (chunked prefill).

    Each fed row's cache is first cut to start [B] tokens, then takes the first n [B] of tokens [B, C] at
    positions start + [0, C). A row whose chunk is its last (final [B]) starts a turn with budget
    limits [B]: its first token is sampled from the last fed token's logits (key fold_in(key, 0), as
    `prefill`) and emitted. A row fed a chunk that is not its last waits (done); rows fed nothing are
    left as they were.
    """
    b, c = tokens.shape
    fed = n > 0
    start = jnp.where(fed, start, state.cache.lengths)
    positions = start[:, None] + jnp.arange(c)[None, :]
    fwd = target.forward(params, cfg, tokens, positions, kv_cache.set_lengths(state.cache, start), compute_logits=False)
    cache = kv_cache.advance(fwd.cache, n)
    last_hidden = fwd.hidden[jnp.arange(b), jnp.maximum(n - 1, 0)]  # [B, H]
    first = sample(jax.random.fold_in(key, 0), target.lm_logits(params, cfg, last_hidden), sc)
    turn = init_state(cache, first, limits, cfg)
    starts = fed & final
    pick = lambda new, old: jnp.where(starts.reshape(-1, *[1] * (old.ndim - 1)), new, old)  # noqa: E731
    return DecodeState(
        step=jnp.where(jnp.any(starts), turn.step, state.step),
        last=pick(turn.last, state.last),
        done=jnp.where(fed, ~final | turn.done, state.done),
        eos=pick(turn.eos, state.eos),
        counts=pick(turn.counts, state.counts),
        limits=pick(turn.limits, state.limits),
        out=pick(turn.out, state.out),
        cache=cache,
    )


def empty_state(cfg: TargetConfig, batch: int, capacity: int, dtype) -> DecodeState:
    """A state with an empty cache and every row done: what `extend` feeds a conversation into."""
    return DecodeState(
        step=jnp.int32(0),
        last=jnp.zeros((batch,), jnp.int32),
        done=jnp.ones((batch,), bool),
        eos=jnp.zeros((batch,), bool),
        counts=jnp.zeros((batch,), jnp.int32),
        limits=jnp.zeros((batch,), jnp.int32),
        out=jnp.full((batch, capacity), PAD_ID, jnp.int32),
        cache=target.init_cache(cfg, batch, capacity, dtype),
    )


def step(
    params: dict, s: DecodeState, key: jax.Array, cfg: TargetConfig, sc: SamplingConfig, span: int | None = None
) -> DecodeState:
    """One decode step: the rows' latest tokens [B, 1] at positions = cache lengths, one target forward
    attending over `span` slots, a sample per row, one slot committed for every row still running."""
    running = ~s.done
    fwd = target.forward(params, cfg, s.last[:, None], s.cache.lengths[:, None], s.cache, span=span)
    cache = kv_cache.advance(fwd.cache, running)
    nxt = sample(jax.random.fold_in(key, s.step), fwd.logits[:, 0], sc)  # [B]
    nxt = jnp.where(running, nxt, s.last)
    out, counts, hit_eos = emit(s.out, s.counts, s.limits, nxt[:, None], running.astype(jnp.int32), cfg)
    eos = s.eos | hit_eos
    done = s.done | eos | (counts >= s.limits)
    return DecodeState(s.step + 1, nxt, done, eos, counts, s.limits, out, cache)


def decode_loop(
    params: dict, state: DecodeState, key: jax.Array, cfg: TargetConfig, sc: SamplingConfig, span: int | None = None
) -> DecodeState:
    """Generate until every row hits eos or its budget, or a running row's next step would write past
    `span` cache slots (default: the whole cache); step s samples with fold_in(key, s).

    Each step feeds the rows' latest tokens [B, 1] at positions = cache lengths and commits one
    slot for every row still running; finished rows are computed but neither commit nor change.
    """
    span = kv_cache.span_of(state.cache, span)

    def go_on(s: DecodeState) -> jax.Array:
        return ~jnp.all(s.done) & jnp.all(s.done | (s.cache.lengths < span))

    return jax.lax.while_loop(go_on, lambda s: step(params, s, key, cfg, sc, span), state)


decode_span = jax.jit(decode_loop, static_argnames=("cfg", "sc", "span"), donate_argnames=("state",))


def decode(
    params: dict,
    cache: KVCache,
    first: jax.Array,
    limits: jax.Array,
    key: jax.Array,
    *,
    cfg: TargetConfig,
    sc: SamplingConfig,
) -> DecodeState:
    """Generate from a prefilled cache and first tokens [B] until every row hits eos or its budget
    limits [B], in segments over growing attention spans (the cache is consumed)."""
    return schedule.run_segments(
        lambda s, span: decode_span(params, s, key, cfg=cfg, sc=sc, span=span),
        init_state(cache, first, limits, cfg),
        lambda s: np.asarray(jax.device_get(s.cache.lengths)) + 1,
        cache.capacity,
    )


def result(state: DecodeState, bucket: int) -> GenerationResult:
    """Per-row tokens and stop reasons of a finished state."""
    out, counts, eos = jax.device_get((state.out, state.counts, state.eos))
    return GenerationResult(
        tokens=[out[row, :n].tolist() for row, n in enumerate(counts)],
        stop_reasons=["eos" if e else "length" for e in eos],
        bucket=bucket,
        capacity=state.cache.capacity,
    )


def generate(
    params: dict,
    cfg: TargetConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    capacity: int | None = None,
) -> GenerationResult:
    """Generate up to max_new_tokens new tokens for each prompt (greedy unless `sampling` says otherwise).

    capacity: cache slots per row (default: `schedule.prepare`'s). Budgets past it are clamped with a warning.
    """
    p = schedule.prepare(prompts, max_new_tokens, 0, capacity, cfg.rope.max_position_embeddings, cfg.pad_token_id or 0)
    key = jax.random.key(seed)
    cache, first = prefill(params, p.tokens, p.lengths, key, cfg=cfg, sc=sampling, capacity=p.capacity)
    return result(decode(params, cache, first, p.limits, key, cfg=cfg, sc=sampling), p.tokens.shape[1])

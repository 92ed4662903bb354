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

    def body(s: DecodeState) -> DecodeState:
        running = ~s.done
        fwd = target.forward(params, cfg, s.last[:, None], s.cache.lengths[:, None], s.cache, span=span)
        cache = kv_cache.advance(fwd.cache, running)
        nxt = sample(jax.random.fold_in(key, s.step), fwd.logits[:, 0], sc)  # [B]
        nxt = jnp.where(running, nxt, s.last)
        out, counts, hit_eos = emit(s.out, s.counts, s.limits, nxt[:, None], running.astype(jnp.int32), cfg)
        eos = s.eos | hit_eos
        done = s.done | eos | (counts >= s.limits)
        return DecodeState(s.step + 1, nxt, done, eos, counts, s.limits, out, cache)

    return jax.lax.while_loop(go_on, body, state)


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

"""Plain (non-speculative) generation with the target: one jitted prefill, then one jitted decode loop.

Prompts are right-padded to a length bucket (16, 24, 32, 48, 64, 96, ...: powers of two and 1.5x
powers of two, capped by the cache capacity) and the default capacity is rounded up too, so a new
prompt length in a known bucket compiles nothing. The decode loop is a `lax.while_loop` over
one-token steps with the state donated: no host round trip per token. It runs in segments whose
attention spans the smallest power-of-two multiple of 128 cache slots holding every live row, so a
step's cost follows the context length rather than the capacity (`run_segments`). Rows stop
independently on an eos id (kept in the output) or on their token budget; the loop ends when every
row is done. Compiled functions are cached per (config, sampling config, batch size, bucket, capacity).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding.sampling import SamplingConfig, sample
from eagle_jax.errors import EagleError
from eagle_jax.models import kv_cache, target
from eagle_jax.models.config import TargetConfig
from eagle_jax.models.kv_cache import KVCache

State = TypeVar("State")
MIN_BUCKET = 16
CAPACITY_MULTIPLE = 128
PAD_ID = -1  # fills the output buffer past each row's last token


def prompt_bucket(length: int, capacity: int | None = None) -> int:
    """Padded prompt length: the smallest 2^k or 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) >= max(length, 16),
    at most `capacity`. Two compiled prompt shapes per octave; padding is at most a third of a bucket."""
    n = max(MIN_BUCKET, length)
    power = 1 << (n - 1).bit_length()  # the smallest power of two >= n
    bucket = power * 3 // 4 if power * 3 // 4 >= n else power
    return bucket if capacity is None else min(bucket, capacity)


def default_capacity(bucket: int, max_new_tokens: int) -> int:
    """Cache capacity for a bucket: bucket + max_new_tokens rounded up to a multiple of 128."""
    return -(-(bucket + max_new_tokens) // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


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


def is_eos(tokens: jax.Array, cfg: TargetConfig) -> jax.Array:
    """tokens [...] -> [...] bool: is each token one of the config's eos ids."""
    if not cfg.eos_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(cfg.eos_token_ids, tokens.dtype))


@functools.partial(jax.jit, static_argnames=("cfg", "sc", "capacity"))
def prefill(params: dict, tokens: jax.Array, lengths: jax.Array, key: jax.Array, *,
            cfg: TargetConfig, sc: SamplingConfig, capacity: int) -> tuple[KVCache, jax.Array]:
    """Fill a fresh cache with right-padded prompts and sample each row's first new token.

    tokens [B, P] (row b valid up to lengths[b]), lengths [B] -> (cache with lengths set, first [B] int32).
    The first token of row b comes from the logits at position lengths[b] - 1 (step key fold_in(key, 0)).
    """
    out = target.prefill(params, cfg, tokens, capacity, feature_layers=())
    last_hidden = jnp.take_along_axis(out.hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, H]
    logits = target.lm_logits(params, cfg, last_hidden)  # [B, V]
    first = sample(jax.random.fold_in(key, 0), logits, sc)
    return kv_cache.set_lengths(out.cache, lengths), first


@functools.partial(jax.jit, static_argnames=("cfg",))
def init_state(cache: KVCache, first: jax.Array, limits: jax.Array, cfg: TargetConfig) -> DecodeState:
    """Decode state after prefill: first [B] is generated token 0; limits [B] are the per-row budgets."""
    b = first.shape[0]
    out = jnp.full((b, cache.capacity), PAD_ID, jnp.int32).at[:, 0].set(first)
    eos = is_eos(first, cfg)
    counts = jnp.ones((b,), jnp.int32)
    return DecodeState(jnp.int32(1), first, eos | (counts >= limits), eos, counts, limits, out, cache)


def live_span(needed: np.ndarray, done: np.ndarray, capacity: int) -> int:
    """The attention span for the running rows (done [B] False) needing `needed` [B] cache slots."""
    return kv_cache.attention_span(int(needed[~done].max()), capacity)


def run_segments(segment: Callable[[State, int], State], state: State, slots_needed: Callable[[State], jax.Array],
                 capacity: int) -> State:
    """Drive a decode loop that also stops when a running row outgrows its attention span: run
    `segment(state, span)` with the smallest `kv_cache.attention_span` holding every running row's
    slots_needed(state) [B], again with a larger span when it stops early, until every row is done."""
    span = 0
    while True:
        needed, done = jax.device_get((slots_needed(state), state.done))
        if done.all():
            return state
        if span == capacity:
            raise EagleError(f"a decode loop stopped with rows running and a full-capacity span ({capacity})")
        span = live_span(needed, done, capacity)
        state = segment(state, span)


def decode_loop(params: dict, state: DecodeState, key: jax.Array, cfg: TargetConfig, sc: SamplingConfig,
                span: int | None = None) -> DecodeState:
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
        fwd = target.forward(params, cfg, s.last[:, None], s.cache.lengths[:, None], s.cache, feature_layers=(),
                             span=span)
        cache = kv_cache.advance(fwd.cache, running)
        nxt = sample(jax.random.fold_in(key, s.step), fwd.logits[:, 0], sc)  # [B]
        nxt = jnp.where(running, nxt, s.last)
        out = s.out.at[:, s.step].set(jnp.where(running, nxt, PAD_ID), mode="drop")
        counts = s.counts + running
        eos = s.eos | (running & is_eos(nxt, cfg))
        done = s.done | eos | (counts >= s.limits)
        return DecodeState(s.step + 1, nxt, done, eos, counts, s.limits, out, cache)

    return jax.lax.while_loop(go_on, body, state)


decode_span = jax.jit(decode_loop, static_argnames=("cfg", "sc", "span"), donate_argnames=("state",))


def decode(params: dict, cache: KVCache, first: jax.Array, limits: jax.Array, key: jax.Array, *,
           cfg: TargetConfig, sc: SamplingConfig) -> DecodeState:
    """Generate from a prefilled cache and first tokens [B] until every row hits eos or its budget
    limits [B], in segments over growing attention spans (the cache is consumed)."""
    return run_segments(lambda s, span: decode_span(params, s, key, cfg=cfg, sc=sc, span=span),
                        init_state(cache, first, limits, cfg), lambda s: s.cache.lengths + 1, cache.capacity)


def prepare_prompts(prompts: list[list[int]], max_new_tokens: int, capacity: int | None,
                    pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Validate and right-pad prompts on the host.

    Returns tokens [B, bucket] int32, lengths [B] int32, per-row budgets limits [B] int32, capacity.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise EagleError("every prompt needs at least one token (got an empty prompt list or prompt)")
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens={max_new_tokens} must be >= 1")
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    if capacity is None:
        capacity = default_capacity(prompt_bucket(longest), max_new_tokens)
    elif longest >= capacity:
        raise EagleError(
            f"prompt of {longest} tokens does not fit the cache capacity {capacity} "
            f"(prompt + max_new_tokens={max_new_tokens} must be <= capacity); pass a larger capacity "
            "or a shorter prompt"
        )
    limits = np.minimum(max_new_tokens, capacity - lengths).astype(np.int32)
    if (limits < max_new_tokens).any():
        warnings.warn(
            f"max_new_tokens={max_new_tokens} clamped to {int(limits.min())} for the longest prompt "
            f"({longest} tokens): the cache capacity is {capacity}; pass a larger capacity to generate more",
            stacklevel=3,
        )
    bucket = prompt_bucket(longest, capacity)
    tokens = np.full((len(prompts), bucket), pad_id, np.int32)
    for row, p in enumerate(prompts):
        tokens[row, : len(p)] = p
    return tokens, lengths, limits, capacity


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

    capacity: cache slots per row; default: bucket + max_new_tokens rounded up to a multiple of 128.
    Each row needs prompt + max_new_tokens <= capacity; budgets past the capacity are clamped with a warning.
    """
    tokens, lengths, limits, capacity = prepare_prompts(prompts, max_new_tokens, capacity, cfg.pad_token_id or 0)
    key = jax.random.key(seed)
    cache, first = prefill(params, tokens, lengths, key, cfg=cfg, sc=sampling, capacity=capacity)
    state = decode(params, cache, first, limits, key, cfg=cfg, sc=sampling)
    out, counts, eos = jax.device_get((state.out, state.counts, state.eos))
    return GenerationResult(
        tokens=[out[row, :n].tolist() for row, n in enumerate(counts)],
        stop_reasons=["eos" if e else "length" for e in eos],
        bucket=tokens.shape[1],
        capacity=capacity,
    )

"""How a generation is sized: prompt buckets, cache capacity, per-row budgets, attention spans.

Every decoder (plain, speculative, on one device or a mesh) and every command sizes its work here:

- prompts are right-padded to a bucket (16, 24, 32, 48, 64, 96, ...: powers of two and 1.5x powers
  of two), so a new prompt length in a known bucket compiles nothing;
- the cache holds the bucket, the budget and one cycle's overhead (a draft tree), rounded up to a
  multiple of 128 and capped by the model's positions, unless a capacity is given;
- a decode loop attends over the smallest span of 128 * 2^k slots (or the capacity) holding every
  running row, stepping out to a larger span, compiled once each, as the context grows
  (`engine.Engine.cycle`), so a step costs what the context costs, not what the capacity costs.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import numpy as np

from eagle_jax.errors import EagleError

MIN_BUCKET = 16
CAPACITY_MULTIPLE = 128
SPAN_UNIT = 128


def prompt_bucket(length: int, capacity: int | None = None) -> int:
    """Padded prompt length: the smallest 2^k or 3 * 2^(k-1) (16, 24, 32, 48, 64, 96, ...) >= max(length, 16),
    at most `capacity`. Two compiled prompt shapes per octave; padding is at most a third of a bucket."""
    n = max(MIN_BUCKET, length)
    power = 1 << (n - 1).bit_length()  # the smallest power of two >= n
    bucket = power * 3 // 4 if power * 3 // 4 >= n else power
    return bucket if capacity is None else min(bucket, capacity)


def round_capacity(slots: int) -> int:
    """`slots` rounded up to a multiple of 128."""
    return -(-slots // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The sizes of one generation: cache, prompt bucket, budgets."""

    capacity: int  # cache slots per row
    bucket: int  # padded prompt length
    limits: np.ndarray  # [B] int32: new tokens each row may generate
    max_new_tokens: int  # what was asked for (limits are below it where the cache is too small)

    @property
    def clamped(self) -> bool:
        return bool((self.limits < self.max_new_tokens).any())


def plan(
    lengths: Sequence[int],
    max_new_tokens: int,
    overhead: int = 0,
    capacity: int | None = None,
    max_positions: int | None = None,
) -> Sizes:
    """Size a generation of prompts of `lengths`.

    overhead: cache slots one step needs past the context (a speculative cycle's tree; 0 for plain
    decoding). capacity: cache slots per row; default bucket + max_new_tokens + overhead rounded up to
    a multiple of 128, at most `max_positions`. A prompt must leave room for one step; budgets past the
    capacity are clamped.
    """
    if not len(lengths) or min(lengths) < 1:
        raise EagleError("every prompt needs at least one token (got an empty prompt list or prompt)")
    if max_new_tokens < 1:
        raise EagleError(f"max_new_tokens={max_new_tokens} must be >= 1")
    lengths = np.asarray(lengths, np.int32)
    longest = int(lengths.max())
    if capacity is None:
        capacity = round_capacity(prompt_bucket(longest) + max_new_tokens + overhead)
        capacity = min(capacity, max_positions) if max_positions else capacity
    usable = capacity - overhead
    if longest >= usable:
        tree = f" minus {overhead} slots for one draft tree" if overhead else ""
        raise EagleError(
            f"prompt of {longest} tokens does not fit the cache capacity {capacity}{tree}; "
            "use a larger capacity or a shorter prompt"
        )
    limits = np.minimum(max_new_tokens, usable - lengths).astype(np.int32)
    return Sizes(capacity, prompt_bucket(longest, capacity), limits, max_new_tokens)


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A batch of prompts laid out for decoding."""

    tokens: np.ndarray  # [B, bucket] int32, right-padded
    lengths: np.ndarray  # [B] int32
    limits: np.ndarray  # [B] int32: new tokens each row may generate
    capacity: int  # cache slots per row


def prepare(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    overhead: int = 0,
    capacity: int | None = None,
    max_positions: int | None = None,
    pad_id: int = 0,
) -> Prompts:
    """`plan` the prompts (warning when budgets are clamped) and right-pad them to the bucket."""
    p = plan([len(x) for x in prompts], max_new_tokens, overhead, capacity, max_positions)
    if p.clamped:
        warnings.warn(
            f"max_new_tokens={max_new_tokens} clamped to {int(p.limits.min())} for the longest prompt "
            f"({max(map(len, prompts))} tokens): the cache holds {p.capacity} tokens; use a larger capacity "
            "to generate more",
            stacklevel=3,
        )
    tokens = np.full((len(prompts), p.bucket), pad_id, np.int32)
    for row, x in enumerate(prompts):
        tokens[row, : len(x)] = x
    return Prompts(tokens, np.asarray([len(x) for x in prompts], np.int32), p.limits, p.capacity)


def all_spans(capacity: int) -> list[int]:
    """The spans a cache of `capacity` slots is attended over: 128 * 2^k below it, then the capacity
    (what a warm-up compiles)."""
    spans = [SPAN_UNIT]
    while spans[-1] < capacity:
        spans.append(2 * spans[-1])
    return [min(s, capacity) for s in spans]


def attention_span(needed: int, capacity: int) -> int:
    """Slots a decode segment attends over: the smallest of `all_spans` >= needed (else the capacity)."""
    return next((s for s in all_spans(capacity) if s >= needed), capacity)

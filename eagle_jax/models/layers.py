"""Building blocks shared by targets and draft heads: norms, rotary embeddings, attention, MLPs."""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp

from eagle_jax.models.config import RopeConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF/Llama RMSNorm: normalise in fp32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def inv_frequencies(rope: RopeConfig, head_dim: int, positions: jax.Array) -> jax.Array:
    """Inverse frequencies [D/2] for the rope type.

    `dynamic` (NTK) depends on this call's largest position over the whole batch, as transformers does
    for a fresh model: with seq_len = max(positions) + 1, the base becomes
    theta * (factor * seq_len / max_pos - (factor - 1)) ** (D / (D - 2)) once seq_len > max_pos, and
    stays theta below that. Keys already in a cache keep the rotation they were written with (as in HF);
    unlike HF's module, nothing is remembered between calls.
    """
    exponent = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "dynamic":
        seq_len = jnp.maximum(jnp.max(positions) + 1, rope.max_position_embeddings).astype(jnp.float32)
        base = rope.theta * ((rope.factor * seq_len / rope.max_position_embeddings) - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        return 1.0 / (base**exponent)
    if rope.rope_type == "llama3":
        old_ctx = rope.original_max_position_embeddings
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(is_medium, smoothed, scaled)
    return inv


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotate x [B, T, N, D] by positions [B, T] (HF rotate-half layout)."""
    head_dim = x.shape[-1]
    inv = inv_frequencies(rope, head_dim, positions)
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, T, D/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    half = head_dim // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, extra: tuple[jax.Array, ...] | None = None
) -> jax.Array:
    """Grouped-query attention. q [B, T, N, D], k/v [B, KV, S, D], mask [B, T, S] -> [B, T, N, D].

    The G = N / KV query heads of a kv head are rows of one matrix [G * T, D] against its keys [S, D],
    and the probabilities are normalised after the value product ([G * T, D] divisions instead of
    [G * T, S]). `extra` = (k2, v2, mask2) adds keys and values [B, KV, S2, D] under mask2 [B, T, S2] to the
    same softmax without concatenating them to k and v.
    """
    b, t, n, d = q.shape
    kv = k.shape[1]
    g = n // kv
    q = (q * (1 / math.sqrt(d))).reshape(b, t, kv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)

    def scores_of(keys: jax.Array, m: jax.Array) -> jax.Array:  # [B, KV, G, T, S]
        s = jnp.einsum("bkqd,bksd->bkqs", q, keys, preferred_element_type=jnp.float32).reshape(b, kv, g, t, -1)
        return jnp.where(m[:, None, None], s, jnp.finfo(jnp.float32).min)

    def weighted(w: jax.Array, values: jax.Array) -> jax.Array:  # [B, KV, G * T, D]
        return jnp.einsum("bkqs,bksd->bkqd", w.reshape(b, kv, g * t, -1).astype(values.dtype), values)

    blocks = [(scores_of(k, mask), v)] + ([(scores_of(extra[0], extra[2]), extra[1])] if extra else [])
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s, _ in blocks])
    weights = [jnp.exp(s - top) for s, _ in blocks]
    out = functools.reduce(operator.add, [weighted(w, values) for w, (_, values) in zip(weights, blocks)])
    total = functools.reduce(operator.add, [jnp.sum(w, axis=-1) for w in weights])
    out = out / total.reshape(b, kv, g * t, 1).astype(out.dtype)
    return out.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, out_dtype=None) -> jax.Array:
    """x [..., in] @ w [in, out] (+ b), accumulated and returned in `out_dtype` (default: the operands'). A quantised
    w (`quantize`: a qwix.QArray) is dequantised where the product reads it; XLA fuses the two."""
    if hasattr(w, "qvalue"):
        import qwix  # loaded already (it made w); importing it up front would add 0.3 s to every start

        w = qwix.dequantize(w)
    y = jnp.einsum("...i,io->...o", x, w, preferred_element_type=out_dtype)
    return y if b is None else y + b


def swiglu(x: jax.Array, p: dict) -> jax.Array:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""
    return linear(jax.nn.silu(linear(x, p["gate"])) * linear(x, p["up"]), p["down"])


def route(x: jax.Array, router: jax.Array, experts_per_token: int) -> tuple[jax.Array, jax.Array]:
    """Mixtral routing: softmax over the experts, top-k, renormalised. -> weights [..., k] f32, experts [..., k]."""
    probs = jax.nn.softmax(linear(x, router).astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, experts_per_token)
    return top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_i


def _expert(x: jax.Array, p: dict, e: int | jax.Array) -> jax.Array:
    """Expert e's SwiGLU on x [..., H] (its weights read in place when e is static)."""
    return linear(jax.nn.silu(linear(x, p["gate"][e])) * linear(x, p["up"][e]), p["down"][e])


def moe_dense(x: jax.Array, p: dict, experts_per_token: int) -> jax.Array:
    """Every expert on every token, summed with the routing weights (zero for experts not chosen)."""
    top_p, top_i = route(x, p["router"], experts_per_token)
    weights = jnp.sum(jax.nn.one_hot(top_i, p["router"].shape[-1]) * top_p[..., None], axis=-2)  # [..., E]
    gate = jnp.einsum("...h,ehi->...ei", x, p["gate"])
    up = jnp.einsum("...h,ehi->...ei", x, p["up"])
    out = jnp.einsum("...ei,eih->...eh", jax.nn.silu(gate) * up, p["down"])
    return jnp.einsum("...eh,...e->...h", out, weights.astype(out.dtype))


def _moe_switched(xs: jax.Array, top_p: jax.Array, top_i: jax.Array, p: dict) -> jax.Array:
    """Few tokens: one `switch` per (token, choice) runs only the chosen expert. xs [N, H] -> [N, H]."""
    n, k = top_i.shape
    branches = [functools.partial(_expert, p=p, e=e) for e in range(p["router"].shape[-1])]
    outs = jnp.stack([jax.lax.switch(top_i[j // k, j % k], branches, xs[j // k]) for j in range(n * k)])
    return jnp.einsum("nkh,nk->nh", outs.reshape(n, k, -1), top_p.astype(outs.dtype))


def sparse_moe(x: jax.Array, p: dict, experts_per_token: int) -> jax.Array:
    """Mixtral MoE: softmax router, top-k experts renormalised, SwiGLU experts.

    x [..., H]; p['router'] [H, E]; expert weights stacked on a leading E axis. With N tokens, when the
    N * k chosen (token, expert) pairs are fewer than the experts (decoding a few rows), each pair runs its
    expert through a `switch`, which reads and multiplies that expert's weights only (Mixtral, one row:
    2 of 8 experts). With more pairs nearly every expert is read anyway, and the dense weighted sum runs.
    (Pairs grouped by expert into `lax.ragged_dot` would skip the unchosen products in principle, but XLA:CPU
    lowers it to masked dense products and libtpu's cost analysis of a Mixtral decode step with it counts
    twice the dense sum's flops.)
    """
    xs = x.reshape(-1, x.shape[-1])
    if xs.shape[0] * experts_per_token >= p["router"].shape[-1]:
        return moe_dense(x, p, experts_per_token)
    top_p, top_i = route(xs, p["router"], experts_per_token)
    return _moe_switched(xs, top_p, top_i, p).reshape(x.shape)

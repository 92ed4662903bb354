"""EAGLE-1 and EAGLE-3 draft heads as pure functions over parameter trees.

EAGLE-3: `h = fc(target features)` (3Ht -> H, only on target features); one layer whose attention
input is `concat(input_layernorm(embed(tok)), hidden_norm(h))` (2H) with residual `h`; the pre-norm
output is fed back as the next `h`; logits `lm_head(norm(out))` over the draft vocabulary, draft id d
meaning target id `d + d2t[d]`.

EAGLE-1: `x = fc(concat(embed(tok), feature))` (bias if config `bias`), then N Llama layers, layer 0
without input_layernorm; no final norm; logits through the *target's* lm_head. Its output is a
predicted final-norm feature, fed back as the next feature.

Both heads take the target's (frozen) embedding and keep their own KV cache of real context only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from eagle_jax.models import kv_cache
from eagle_jax.models.config import DraftConfig
from eagle_jax.models.kv_cache import KVCache
from eagle_jax.models.layers import apply_rope, attend, linear, rms_norm, swiglu
from eagle_jax.models.params import ParamSpec


def _attn_specs(c: DraftConfig, dtype) -> dict:
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    H, I = c.hidden_size, c.intermediate_size
    return {
        "q": ParamSpec((c.attn_in, q_out), ("embed", "heads"), dtype),
        "k": ParamSpec((c.attn_in, kv_out), ("embed", "kv_heads"), dtype),
        "v": ParamSpec((c.attn_in, kv_out), ("embed", "kv_heads"), dtype),
        "o": ParamSpec((q_out, H), ("heads", "embed"), dtype),
        "mlp_norm": ParamSpec((H,), (None,), dtype, "ones"),
        "mlp": {
            "gate": ParamSpec((H, I), ("embed", "mlp"), dtype),
            "up": ParamSpec((H, I), ("embed", "mlp"), dtype),
            "down": ParamSpec((I, H), ("mlp", "embed"), dtype),
        },
    }


def param_specs(c: DraftConfig, dtype=jnp.float32) -> dict:
    """Every draft parameter once (shape, dtype, logical axes); weights are [in, out]."""
    H = c.hidden_size
    if c.kind == "eagle3":
        layer = _attn_specs(c, dtype)
        layer["hidden_norm"] = ParamSpec((H,), (None,), dtype, "ones")
        layer["input_norm"] = ParamSpec((H,), (None,), dtype, "ones")
        specs = {
            "fc": ParamSpec((3 * c.target_hidden_size, H), ("features", "embed"), dtype),
            "layers": [layer],
            "norm": ParamSpec((H,), (None,), dtype, "ones"),
            "lm_head": ParamSpec((H, c.draft_vocab_size), ("embed", "draft_vocab"), dtype),
        }
        if c.has_vocab_map:
            specs["d2t"] = ParamSpec((c.draft_vocab_size,), (None,), jnp.int32, "zeros")
            specs["t2d"] = ParamSpec((c.vocab_size,), (None,), jnp.bool_, "zeros")
        return specs
    layers = []
    for i in range(c.num_layers):
        layer = _attn_specs(c, dtype)
        if i > 0:
            layer["input_norm"] = ParamSpec((H,), (None,), dtype, "ones")
        layers.append(layer)
    specs = {"fc": ParamSpec((2 * H, H), ("features", "embed"), dtype), "layers": layers}
    if c.fc_bias:
        specs["fc_bias"] = ParamSpec((H,), (None,), dtype, "zeros")
    return specs


def init_cache(c: DraftConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    return kv_cache.init_cache(c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim, dtype)


# ---------------------------------------------------------------- forward


def project_features(params: dict, c: DraftConfig, features: jax.Array) -> jax.Array:
    """Target features -> the head's hidden input: EAGLE-3 fc(3 fused layers), EAGLE-1 identity (final norm)."""
    return linear(features, params["fc"]) if c.kind == "eagle3" else features


def forward(
    params: dict,
    c: DraftConfig,
    embed: jax.Array,
    tokens: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: jax.Array | None = None,
    offset: int | jax.Array = 0,
    span: int | None = None,
) -> tuple[jax.Array, KVCache]:
    """One draft pass. tokens [B, T], hidden [B, T, H] (projected features or own outputs).

    Writes keys/values at cache slots lengths + offset + [0, T) (lengths are not advanced) and
    returns the layer output [B, T, H] (pre-norm; the next step's hidden input). Attention reads
    the first `span` cache slots (default: all).
    """
    b, t = tokens.shape
    if mask is None:
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    span = kv_cache.span_of(cache, span)
    full_mask = kv_cache.window_mask(cache, mask, span)
    slots = cache.lengths[:, None] + offset + jnp.arange(t)[None, :]
    emb = embed[tokens].astype(hidden.dtype)  # [B, T, H]
    ck, cv = cache.k, cache.v
    if c.kind == "eagle3":
        p = params["layers"][0]
        x, ck, cv = _layer(
            p, c, eagle3_input(p, c, emb, hidden), hidden, positions, ck, cv, cache.rows, 0, slots, full_mask, span
        )
    else:
        x = linear(jnp.concatenate([emb, hidden], -1), params["fc"], params.get("fc_bias"))
        for i, p in enumerate(params["layers"]):
            h = rms_norm(x, p["input_norm"], c.rms_norm_eps) if i > 0 else x
            x, ck, cv = _layer(p, c, h, x, positions, ck, cv, cache.rows, i, slots, full_mask, span)
    return x, dataclasses.replace(cache, k=ck, v=cv)


def eagle3_input(p: dict, c: DraftConfig, emb: jax.Array, hidden: jax.Array) -> jax.Array:
    """EAGLE-3 attention input [B, T, 2H]: concat(input_layernorm(emb), hidden_norm(hidden)), embedding first."""
    return jnp.concatenate(
        [rms_norm(emb, p["input_norm"], c.rms_norm_eps), rms_norm(hidden, p["hidden_norm"], c.rms_norm_eps)], -1
    )


def qkv(p: dict, c: DraftConfig, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [B, T, N, D] and keys, values [B, T, KV, D] of the (already normed) input x."""
    b, t, _ = x.shape
    q = apply_rope(linear(x, p["q"]).reshape(b, t, c.num_heads, c.head_dim), positions, c.rope)
    k = apply_rope(linear(x, p["k"]).reshape(b, t, c.num_kv_heads, c.head_dim), positions, c.rope)
    v = linear(x, p["v"]).reshape(b, t, c.num_kv_heads, c.head_dim)
    return q, k, v


def post_attention(p: dict, c: DraftConfig, attn: jax.Array, residual: jax.Array) -> jax.Array:
    """o_proj of the attention output [B, T, N, D], `+ residual`, then post-norm SwiGLU MLP + residual."""
    b, t = attn.shape[:2]
    h = residual + linear(attn.reshape(b, t, -1), p["o"])
    return h + swiglu(rms_norm(h, p["mlp_norm"], c.rms_norm_eps), p["mlp"])


def _layer(p, c: DraftConfig, x, residual, positions, ck, cv, rows, layer: int, slots, mask, span: int):
    """One cached decoder layer on the (already normed) input x with `residual` (the cache's `rows`, or all)."""
    q, k, v = qkv(p, c, x, positions)
    ck, cv = kv_cache.write(ck, cv, layer, slots, k, v, rows)
    attn = attend(q, *kv_cache.keys_values(ck, cv, layer, span, rows), mask)
    return post_attention(p, c, attn, residual), ck, cv


def logits(params: dict, c: DraftConfig, out: jax.Array, target_head: jax.Array | None) -> jax.Array:
    """Draft logits [..., Vd] (f32). EAGLE-1 uses the target's lm_head [H, V] without a norm."""
    if c.kind == "eagle3":
        return linear(rms_norm(out, params["norm"], c.rms_norm_eps), params["lm_head"], out_dtype=jnp.float32)
    return linear(out, target_head, out_dtype=jnp.float32)


def to_target_ids(params: dict, c: DraftConfig, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target ids (d + d2t[d]); identity without a vocabulary map."""
    return draft_ids + params["d2t"][draft_ids] if c.has_vocab_map else draft_ids


def top_k(params: dict, c: DraftConfig, out: jax.Array, target_head: jax.Array | None, k: int):
    """The draft's top-k proposals for each output: (target ids [..., k], log-probs [..., k])."""
    logp = jax.nn.log_softmax(logits(params, c, out, target_head), axis=-1)
    values, ids = jax.lax.top_k(logp, k)
    return to_target_ids(params, c, ids), values

"""Target transformers (Llama, Mistral, Mixtral, Qwen2, Qwen3) as pure functions over parameter trees.

One `forward` serves prefill, one-token decode and tree verification: the new tokens attend to the
committed cache plus a window of uncommitted entries given by an explicit mask (causal by default,
the tree mask during verification).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from eagle_jax.errors import EagleError
from eagle_jax.models import kv_cache
from eagle_jax.models.config import TargetConfig
from eagle_jax.models.kv_cache import KVCache
from eagle_jax.models.layers import apply_rope, attend, linear, rms_norm, sparse_moe, swiglu
from eagle_jax.models.params import ParamSpec


def layer_specs(cfg: TargetConfig, dtype=jnp.float32) -> dict:
    """One decoder layer's parameters (weights [in, out])."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def w(*shape_axes, init="normal"):
        return ParamSpec(tuple(s for s, _ in shape_axes), tuple(a for _, a in shape_axes), dtype, init)

    layer = {
        "attn_norm": w((H, None), init="ones"),
        "q": w((H, "embed"), (q_out, "heads")),
        "k": w((H, "embed"), (kv_out, "kv_heads")),
        "v": w((H, "embed"), (kv_out, "kv_heads")),
        "o": w((q_out, "heads"), (H, "embed")),
        "mlp_norm": w((H, None), init="ones"),
    }
    if cfg.qkv_bias:
        layer["q_bias"] = w((q_out, "heads"), init="zeros")
        layer["k_bias"] = w((kv_out, "kv_heads"), init="zeros")
        layer["v_bias"] = w((kv_out, "kv_heads"), init="zeros")
    if cfg.o_bias:
        layer["o_bias"] = w((H, None), init="zeros")
    if cfg.qk_norm:
        layer["q_norm"] = w((cfg.head_dim, None), init="ones")
        layer["k_norm"] = w((cfg.head_dim, None), init="ones")
    if cfg.is_moe:
        E = cfg.num_experts
        layer["mlp"] = {
            "router": w((H, "embed"), (E, None)),
            "gate": w((E, "experts"), (H, "embed"), (I, "mlp")),
            "up": w((E, "experts"), (H, "embed"), (I, "mlp")),
            "down": w((E, "experts"), (I, "mlp"), (H, "embed")),
        }
    else:
        layer["mlp"] = {
            "gate": w((H, "embed"), (I, "mlp")),
            "up": w((H, "embed"), (I, "mlp")),
            "down": w((I, "mlp"), (H, "embed")),
        }
    return layer


def param_specs(cfg: TargetConfig, dtype=jnp.float32) -> dict:
    """Every target parameter, once: shape, dtype, logical axes (a quantised target's weights: `quantize.spec`).

    `layers` is a list with one tree per decoder layer, so each layer's weights are buffers of their own: a
    forward reads them in place (slicing them out of arrays stacked over layers costs a copy per layer and
    step on CPUs and GPUs).
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    specs = {
        "embed": ParamSpec((V, H), ("vocab", "embed"), dtype),
        "layers": [layer_specs(cfg, dtype) for _ in range(cfg.num_layers)],
        "final_norm": ParamSpec((H,), (None,), dtype, "ones"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((H, V), ("embed", "vocab"), dtype)
    if cfg.quantize:
        from eagle_jax.models import quantize  # qwix loads only for a quantised target (0.3 s)

        specs = quantize.map_weights(quantize.spec, specs)
    return specs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    logits: jax.Array | None  # [B, T, V] float32
    hidden: jax.Array  # [B, T, H] final normed hidden state (EAGLE-1 feature)
    features: jax.Array  # [B, T, n*H] inputs of the feature layers, concatenated (EAGLE-3 features)
    cache: KVCache
    new_kv: tuple[jax.Array, jax.Array] | None = None  # [L, B, KV, T, D] each: entries not written (write=False)


def check_capacity(cfg: TargetConfig, capacity: int) -> None:
    """Refuse a cache longer than the sliding window (Mistral `sliding_window`).

    Sliding-window attention is not implemented: every query sees its whole context. With a window W,
    HF lets position i see keys j with i - j < W, so the two agree exactly while a sequence holds at
    most W tokens, i.e. for caches of capacity <= W.
    """
    if cfg.sliding_window is not None and capacity > cfg.sliding_window:
        raise EagleError(
            f"cache capacity {capacity} exceeds sliding_window={cfg.sliding_window}: sliding-window attention is "
            f"not implemented, so this model is exact only for sequences of at most {cfg.sliding_window} tokens; "
            "use a smaller max length"
        )


def init_cache(cfg: TargetConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    check_capacity(cfg, capacity)
    return kv_cache.init_cache(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, dtype)


def causal_mask(batch: int, t: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def _attention(
    p: dict,
    cfg: TargetConfig,
    x: jax.Array,
    positions: jax.Array,
    cache_k,
    cache_v,
    rows,
    layer,
    slots,
    mask,
    span: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of x [B, T, H] (the cache's `rows`, or all): with `slots`, the new entries are written there and
    the queries read the cache's first `span` slots under `mask` [B, T, span]; with slots None the cache is only
    read, under mask = (committed [B, 1, span], among the new tokens [B, T, T]), and the new entries
    [B, KV, T, D] come back instead of the cache."""
    b, t, _ = x.shape
    q = linear(x, p["q"], p.get("q_bias")).reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = linear(x, p["k"], p.get("k_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = linear(x, p["v"], p.get("v_bias")).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = apply_rope(q, positions, cfg.rope)
    k = apply_rope(k, positions, cfg.rope)
    if slots is None:
        k, v = (jnp.swapaxes(a, 1, 2).astype(cache_k.dtype) for a in (k, v))  # [B, KV, T, D]
        out = attend(q, *kv_cache.keys_values(cache_k, cache_v, layer, span, rows), mask[0], (k, v, mask[1]))
        cache_k, cache_v = k, v
    else:
        cache_k, cache_v = kv_cache.write(cache_k, cache_v, layer, slots, k, v, rows)
        out = attend(q, *kv_cache.keys_values(cache_k, cache_v, layer, span, rows), mask)  # [B, T, N, D]
    out = linear(out.reshape(b, t, -1), p["o"], p.get("o_bias"))
    return out, cache_k, cache_v


@functools.partial(jax.jit, static_argnames=("cfg", "span"))
def _decoder_layer(p: dict, cfg: TargetConfig, x: jax.Array, positions, ck, cv, rows, layer, slots, mask, span: int):
    """One pre-norm decoder layer: attention then (dense or sparse) MLP, each with a residual.

    Jitted with the layer index as an argument, so a forward traces and lowers one layer, not every layer
    (XLA inlines the calls: the compiled program is the same)."""
    attn, ck, cv = _attention(
        p, cfg, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions, ck, cv, rows, layer, slots, mask, span
    )
    x = x + attn
    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return x + (sparse_moe(h, p["mlp"], cfg.experts_per_token) if cfg.is_moe else swiglu(h, p["mlp"])), ck, cv


def output_head(params: dict, cfg: TargetConfig) -> jax.Array:
    """The lm_head as [H, V] (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def lm_logits(params: dict, cfg: TargetConfig, hidden: jax.Array) -> jax.Array:
    """Logits [..., V] from final normed hidden states, accumulated in float32 whatever the weights' dtype."""
    return linear(hidden, output_head(params, cfg), out_dtype=jnp.float32)


def forward(
    params: dict,
    cfg: TargetConfig,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    mask: jax.Array | None = None,
    offset: int | jax.Array = 0,
    feature_layers: Sequence[int] = (),
    compute_logits: bool = True,
    span: int | None = None,
    write: bool = True,
) -> TargetOutput:
    """Run T new tokens [B, T] at positions [B, T] against the cache.

    The new keys/values are written at slots lengths + offset + [0, T); `mask` [B, T, W] says which
    of the window slots [lengths, lengths + W) each new token sees (default: causal, W = T).
    Attention reads the first `span` slots (static; default the whole cache), which must hold them.
    The cache lengths are not advanced: call `kv_cache.advance` with what is committed.
    With write=False the cache is only read (the tokens see its committed slots and, by `mask` [B, T, T],
    each other) and the new entries come back as `new_kv`, for `kv_cache.write_path`.
    """
    b, t = tokens.shape
    if mask is None:
        mask = causal_mask(b, t)
    feature_layers = tuple(feature_layers)
    if any(not 0 <= i < cfg.num_layers for i in feature_layers):
        raise EagleError(f"feature_layers={feature_layers}: layer indices must lie in [0, {cfg.num_layers})")
    span = kv_cache.span_of(cache, span)
    if write:
        full_mask = kv_cache.window_mask(cache, mask, span)  # [B, T, span]
        slots = cache.lengths[:, None] + offset + jnp.arange(t)[None, :]  # [B, T]
    else:
        full_mask, slots = (kv_cache.committed_mask(cache, span), mask), None
    x = params["embed"][tokens]  # [B, T, H]
    inputs = {}  # layer index -> its input, for the feature layers
    ck, cv = cache.k, cache.v
    new = []
    for i, p in enumerate(params["layers"]):
        if i in feature_layers:
            inputs[i] = x
        x, k, v = _decoder_layer(p, cfg, x, positions, ck, cv, cache.rows, i, slots, full_mask, span)
        if write:
            ck, cv = k, v
        else:
            new.append((k, v))
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    features = jnp.concatenate([inputs[i] for i in feature_layers], axis=-1) if feature_layers else x[..., :0]
    logits = lm_logits(params, cfg, hidden) if compute_logits else None
    new_kv = None if write else tuple(jnp.stack(parts) for parts in zip(*new))
    return TargetOutput(logits, hidden, features, dataclasses.replace(cache, k=ck, v=cv), new_kv)


def prefill(
    params: dict, cfg: TargetConfig, tokens: jax.Array, capacity: int, feature_layers: Sequence[int] = ()
) -> TargetOutput:
    """Causal forward of prompts [B, P] from position 0 into a fresh cache of `capacity` slots.

    Attention spans the P prompt slots only (P x P, not P x capacity). Lengths stay 0: the caller
    sets them.
    """
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    return forward(
        params,
        cfg,
        tokens,
        positions,
        init_cache(cfg, b, capacity, params["embed"].dtype),
        feature_layers=feature_layers,
        compute_logits=False,
        span=p,
    )

"""EAGLE-1 and EAGLE-3 draft heads as pure functions, and their official checkpoints.

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
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleError
from eagle_jax.models import kv_cache
from eagle_jax.models.config import RopeConfig, TargetConfig, read_json, rope_from_hf
from eagle_jax.models.kv_cache import KVCache
from eagle_jax.models.layers import apply_rope, attend, linear, rms_norm, swiglu
from eagle_jax.models.params import ParamSpec, describe_mismatch, flatten_dict, unflatten_dict

KINDS = ("eagle1", "eagle3")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    kind: str  # "eagle1" | "eagle3"
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int
    fc_bias: bool = False

    @property
    def has_vocab_map(self) -> bool:
        return self.kind == "eagle3" and self.draft_vocab_size != self.vocab_size

    @property
    def attn_in(self) -> int:
        """Width of the attention input: 2H for EAGLE-3 (embedding ++ hidden), H for EAGLE-1."""
        return 2 * self.hidden_size if self.kind == "eagle3" else self.hidden_size


def draft_config_from_hf(cfg: dict[str, Any], kind: str) -> DraftConfig:
    if kind not in KINDS:
        raise EagleError(f"unknown draft kind {kind!r} (expected one of {', '.join(KINDS)})")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    vocab = int(cfg["vocab_size"])
    return DraftConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=1 if kind == "eagle3" else int(cfg.get("num_hidden_layers") or 1),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope=rope_from_hf(cfg),
        vocab_size=vocab,
        draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab) if kind == "eagle3" else vocab,
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        fc_bias=kind == "eagle1" and bool(cfg.get("bias", True)),
    )


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
        x, ck, cv = _layer(p, c, eagle3_input(p, c, emb, hidden), hidden, positions, ck, cv, 0, slots, full_mask, span)
    else:
        x = linear(jnp.concatenate([emb, hidden], -1), params["fc"], params.get("fc_bias"))
        for i, p in enumerate(params["layers"]):
            h = rms_norm(x, p["input_norm"], c.rms_norm_eps) if i > 0 else x
            x, ck, cv = _layer(p, c, h, x, positions, ck, cv, i, slots, full_mask, span)
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


def _layer(p, c: DraftConfig, x, residual, positions, ck, cv, layer: int, slots, mask, span: int):
    """One cached decoder layer on the (already normed) input x with `residual`."""
    q, k, v = qkv(p, c, x, positions)
    ck, cv = kv_cache.write(ck, cv, layer, slots, k, v)
    return post_attention(p, c, attend(q, ck[layer, :, :span], cv[layer, :, :span], mask), residual), ck, cv


def logits(params: dict, c: DraftConfig, out: jax.Array, target_head: jax.Array | None) -> jax.Array:
    """Draft logits [..., Vd] (f32). EAGLE-1 uses the target's lm_head [H, V] without a norm."""
    if c.kind == "eagle3":
        return linear(rms_norm(out, params["norm"], c.rms_norm_eps), params["lm_head"]).astype(jnp.float32)
    return linear(out, target_head).astype(jnp.float32)


def to_target_ids(params: dict, c: DraftConfig, draft_ids: jax.Array) -> jax.Array:
    """Draft-vocabulary ids -> target ids (d + d2t[d]); identity without a vocabulary map."""
    return draft_ids + params["d2t"][draft_ids] if c.has_vocab_map else draft_ids


def top_k(params: dict, c: DraftConfig, out: jax.Array, target_head: jax.Array | None, k: int):
    """The draft's top-k proposals for each output: (target ids [..., k], log-probs [..., k])."""
    logp = jax.nn.log_softmax(logits(params, c, out, target_head), axis=-1)
    values, ids = jax.lax.top_k(logp, k)
    return to_target_ids(params, c, ids), values


# ---------------------------------------------------------------- official checkpoints


def _layer_names(prefix: str, with_input_norm: bool) -> dict[str, tuple[str, bool]]:
    names = {
        "q": (f"{prefix}.self_attn.q_proj.weight", True),
        "k": (f"{prefix}.self_attn.k_proj.weight", True),
        "v": (f"{prefix}.self_attn.v_proj.weight", True),
        "o": (f"{prefix}.self_attn.o_proj.weight", True),
        "mlp_norm": (f"{prefix}.post_attention_layernorm.weight", False),
        "mlp.gate": (f"{prefix}.mlp.gate_proj.weight", True),
        "mlp.up": (f"{prefix}.mlp.up_proj.weight", True),
        "mlp.down": (f"{prefix}.mlp.down_proj.weight", True),
    }
    if with_input_norm:
        names["input_norm"] = (f"{prefix}.input_layernorm.weight", False)
    return names


def official_names(c: DraftConfig) -> dict[str, tuple[str, bool]]:
    """Our flat parameter name -> (official key, stored transposed?). Used both ways."""
    if c.kind == "eagle3":
        names = {"fc": ("fc.weight", True), "norm": ("norm.weight", False), "lm_head": ("lm_head.weight", True)}
        layer = _layer_names("midlayer", True)
        layer["hidden_norm"] = ("midlayer.hidden_norm.weight", False)
        names.update({f"layers.0.{k}": v for k, v in layer.items()})
        if c.has_vocab_map:
            names["d2t"] = ("d2t", False)
            names["t2d"] = ("t2d", False)
        return names
    names = {"fc": ("fc.weight", True)}
    if c.fc_bias:
        names["fc_bias"] = ("fc.bias", False)
    for i in range(c.num_layers):
        names.update({f"layers.{i}.{k}": v for k, v in _layer_names(f"layers.{i}", i > 0).items()})
    return names


IGNORED_KEYS = ("embed_tokens.weight",)


def detect_kind(keys: set[str]) -> str | None:
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if any(k.startswith("layers.") for k in keys):
        return "eagle1"
    return None


def _nest_layers(flat: dict[str, Any]) -> dict:
    """unflatten, turning the 'layers' dict {'0': ..., '1': ...} into a list."""
    tree = unflatten_dict(flat)
    tree["layers"] = [tree["layers"][str(i)] for i in range(len(tree["layers"]))]
    return tree


def params_from_tensors(tensors: dict[str, np.ndarray], c: DraftConfig, where: str, dtype=None) -> dict:
    """Official head tensors -> our parameter tree; every key and shape checked."""
    names = official_names(c)
    specs = flatten_dict(_flat_specs_tree(c))
    expected = {theirs: specs[ours].shape[::-1] if transpose else specs[ours].shape
                for ours, (theirs, transpose) in names.items()}
    present = {k: np.shape(v) for k, v in tensors.items() if k not in IGNORED_KEYS}
    problem = describe_mismatch(expected, present)
    if problem:
        raise EagleError(f"{where}: not a valid {c.kind.upper()} head for its config.json ({problem})")
    flat = {}
    for ours, (theirs, transpose) in names.items():
        x = np.asarray(tensors[theirs])
        x = x.T if transpose else x
        if ours in ("d2t", "t2d"):
            x = x.astype(np.int32 if ours == "d2t" else np.bool_)
        elif dtype is not None:
            x = x.astype(dtype)
        flat[ours] = x
    return _nest_layers(flat)


def _flat_specs_tree(c: DraftConfig) -> dict:
    specs = param_specs(c)
    specs["layers"] = {str(i): layer for i, layer in enumerate(specs["layers"])}
    return specs


def tensors_from_params(params: dict, c: DraftConfig) -> dict[str, np.ndarray]:
    """Our parameter tree -> official keys, layouts and dtypes (d2t int64, t2d bool)."""
    tree = dict(params)
    tree["layers"] = {str(i): layer for i, layer in enumerate(params["layers"])}
    flat = flatten_dict(tree)
    out = {}
    for ours, (theirs, transpose) in official_names(c).items():
        x = np.asarray(flat[ours])
        if ours == "d2t":
            x = x.astype(np.int64)
        out[theirs] = np.ascontiguousarray(x.T if transpose else x)
    return out


def check_fits(c: DraftConfig, target: TargetConfig, where: str) -> None:
    """Refuse a head whose widths or vocabulary do not match the target."""
    problems = []
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {c.vocab_size} vs target {target.vocab_size}")
    if c.kind == "eagle3" and c.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {c.target_hidden_size} vs target hidden_size {target.hidden_size}")
    if c.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {c.hidden_size} vs target hidden_size {target.hidden_size} (embedding width)")
    if problems:
        raise EagleError(f"{where}: this head does not fit the target ({'; '.join(problems)}); use the head trained for this target")


def load_draft(draft_dir: str | Path, target: TargetConfig, kind: str | None = None, dtype=None) -> tuple[DraftConfig, dict]:
    """Load an official EAGLE-1/EAGLE-3 head directory (config.json + safetensors or pytorch_model.bin).

    The kind is detected from the keys; `kind` forces it (and a mismatch is an error).
    """
    from eagle_jax.io.hf import read_tensors

    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise EagleError(f"{draft_dir}: draft directory not found")
    raw_cfg = read_json(draft_dir / "config.json")
    tensors = read_tensors(draft_dir)
    detected = detect_kind(set(tensors))
    if detected is None:
        raise EagleError(f"{draft_dir}: no EAGLE head keys found (expected 'midlayer.*' for EAGLE-3 or 'layers.*' for EAGLE-1)")
    if kind is not None and kind != detected:
        raise EagleError(f"{draft_dir}: this is an {detected.upper()} head (by its keys) but {kind.upper()} was requested; drop the override")
    cfg = draft_config_from_hf(raw_cfg, detected)
    check_fits(cfg, target, str(draft_dir))
    return cfg, params_from_tensors(tensors, cfg, str(draft_dir), dtype)

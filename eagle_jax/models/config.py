"""Frozen, hashable model configs built from Hugging Face / official EAGLE `config.json` dictionaries.

Every config feature the code does not implement raises `EagleError` naming the field, so an
unsupported checkpoint never turns into a silently wrong model. Reading the files is `eagle_jax.io`'s job.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eagle_jax.errors import EagleError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (HF `rope_scaling` / `rope_parameters`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 2048


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only target transformer (Llama, Mistral, Mixtral, Qwen2, Qwen3)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    quantize: str | None = None  # "int8": weight-only int8 weights (`models.quantize`)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Upstream rule: inputs of decoder layers 2, L//2 and L-3 (distinct for L >= 7)."""
    layers = (2, num_layers // 2, num_layers - 3)
    if len(set(layers)) != 3 or min(layers) < 0:
        raise EagleError(
            f"num_hidden_layers={num_layers}: the EAGLE-3 layer rule (2, L//2, L-3) needs three distinct "
            "layers; use a target with at least 7 layers"
        )
    return layers


def _get(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    value = cfg.get(key, default)
    return default if value is None else value


def _count(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """A positive whole-number field of config.json (`default` when absent or null); else a one-line error."""
    value = _get(cfg, key, default)
    if value is None:
        raise EagleError(f"config.json: {key} is missing; it must be a positive whole number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise EagleError(f"config.json: {key}={value!r} is not a positive whole number")
    return int(value)


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """Parse the rope settings of both HF layouts (`rope_theta`+`rope_scaling` and v5 `rope_parameters`)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", _get(cfg, "rope_theta", 10000.0)))
    field = "rope_parameters" if params else "rope_scaling"
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise EagleError(f"{field}.rope_type={rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mrope_section"):
        if merged.get(key) is not None:
            raise EagleError(f"{field}.{key} is not supported by rope_type {rope_type!r}")
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise EagleError(f"partial_rotary_factor={partial} is not supported (only full rotary embeddings)")
    max_pos = int(_get(cfg, "max_position_embeddings", 2048))
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", max_pos)),
        max_position_embeddings=max_pos,
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def target_config_from_hf(cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> TargetConfig:
    """Build a `TargetConfig` from an HF config dict, refusing what is not implemented."""
    archs = cfg.get("architectures") or []
    family = None
    for arch in archs:
        family = SUPPORTED_ARCHITECTURES.get(arch)
        if family:
            break
    if family is None:
        family = {v: v for v in SUPPORTED_ARCHITECTURES.values()}.get(cfg.get("model_type", ""))
    if family is None:
        raise EagleError(
            f"architectures={archs or cfg.get('model_type')!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if _get(cfg, "hidden_act", "silu") != "silu":
        raise EagleError(f"hidden_act={cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise EagleError("mlp_bias=true is not supported")
    sliding = None
    if family in ("mistral", "mixtral"):
        sliding = cfg.get("sliding_window")
    elif family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        sliding = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types) or sliding:
            raise EagleError(
                "use_sliding_window=true is not supported (sliding-window attention is not implemented); "
                "set it to false in config.json"
            )
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    elif family == "qwen3":
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
    num_heads = _count(cfg, "num_attention_heads")
    hidden = _count(cfg, "hidden_size")
    head_dim = _count(cfg, "head_dim", hidden // num_heads)
    eos = _as_ids(cfg.get("eos_token_id"))
    if generation_config:
        eos = tuple(dict.fromkeys(eos + _as_ids(generation_config.get("eos_token_id"))))
    num_experts = int(_get(cfg, "num_local_experts", 0)) if family == "mixtral" else 0
    return TargetConfig(
        family=family,
        vocab_size=_count(cfg, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_count(cfg, "intermediate_size"),
        num_layers=_count(cfg, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=_count(cfg, "num_key_value_heads", num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
        rope=rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=family == "qwen3",
        num_experts=num_experts,
        experts_per_token=int(_get(cfg, "num_experts_per_tok", 2)) if num_experts else 0,
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
    )


# ---------------------------------------------------------------- draft heads

DRAFT_KINDS = ("eagle1", "eagle3")


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """An EAGLE-1 or EAGLE-3 draft head."""

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
    aux_layers: tuple[int, ...] | None = None  # EAGLE-3 target layers named by the config (None: upstream rule)

    @property
    def has_vocab_map(self) -> bool:
        return self.kind == "eagle3" and self.draft_vocab_size != self.vocab_size

    @property
    def attn_in(self) -> int:
        """Width of the attention input: 2H for EAGLE-3 (embedding ++ hidden), H for EAGLE-1."""
        return 2 * self.hidden_size if self.kind == "eagle3" else self.hidden_size

    def feature_layers(self, target: TargetConfig) -> tuple[int, ...]:
        """The target layers whose inputs this head reads: EAGLE-3 three of them (by default upstream's
        {2, L//2, L-3}), EAGLE-1 none (it reads the target's final normed hidden state)."""
        if self.kind != "eagle3":
            return ()
        return self.aux_layers if self.aux_layers is not None else default_eagle3_layers(target.num_layers)


def _aux_layers(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    """EAGLE-3 target layers given by the config (`eagle_config.eagle_aux_hidden_state_layer_ids`), if any."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise EagleError(f"eagle_config.eagle_aux_hidden_state_layer_ids={ids!r} must list three layer indices")
    return tuple(ids)


def draft_config_from_hf(cfg: dict[str, Any], kind: str) -> DraftConfig:
    """Build a `DraftConfig` from an official head's config.json dict."""
    if kind not in DRAFT_KINDS:
        raise EagleError(f"unknown draft kind {kind!r} (expected one of {', '.join(DRAFT_KINDS)})")
    hidden = _count(cfg, "hidden_size")
    heads = _count(cfg, "num_attention_heads")
    vocab = _count(cfg, "vocab_size")
    return DraftConfig(
        kind=kind,
        hidden_size=hidden,
        intermediate_size=_count(cfg, "intermediate_size"),
        num_layers=1 if kind == "eagle3" else _count(cfg, "num_hidden_layers", 1),
        num_heads=heads,
        num_kv_heads=_count(cfg, "num_key_value_heads", heads),
        head_dim=_count(cfg, "head_dim", hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        rope=rope_from_hf(cfg),
        vocab_size=vocab,
        draft_vocab_size=_count(cfg, "draft_vocab_size", vocab) if kind == "eagle3" else vocab,
        target_hidden_size=_count(cfg, "target_hidden_size", hidden),
        fc_bias=kind == "eagle1" and bool(cfg.get("bias", True)),
        aux_layers=_aux_layers(cfg) if kind == "eagle3" else None,
    )


def eagle3_head_like(target: TargetConfig, draft_vocab_size: int) -> DraftConfig:
    """A one-layer EAGLE-3 head shaped like a target layer (hidden, heads, kv heads, MLP, rope)."""
    if not 0 < draft_vocab_size <= target.vocab_size:
        raise EagleError(
            f"draft vocabulary size {draft_vocab_size} must be in 1..{target.vocab_size} (the target vocabulary)"
        )
    return DraftConfig(
        kind="eagle3",
        hidden_size=target.hidden_size,
        intermediate_size=target.intermediate_size,
        num_layers=1,
        num_heads=target.num_heads,
        num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps,
        rope=target.rope,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size,
    )


def eagle1_head_like(target: TargetConfig) -> DraftConfig:
    """A one-layer EAGLE-1 head shaped like a target layer, its fc with a bias (the v1 code's default); it reads
    the target's full vocabulary through the target's lm_head."""
    return dataclasses.replace(eagle3_head_like(target, target.vocab_size), kind="eagle1", fc_bias=True)


def check_draft_fits(draft: DraftConfig, target: TargetConfig, where: str) -> None:
    """Refuse a head whose widths, vocabulary or feature layers do not match the target."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {draft.vocab_size} vs target {target.vocab_size}")
    if draft.kind == "eagle3" and draft.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {draft.target_hidden_size} vs target hidden_size {target.hidden_size}")
    if draft.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {draft.hidden_size} vs target hidden_size {target.hidden_size} (embedding width)")
    if any(not 0 <= i < target.num_layers for i in draft.aux_layers or ()):
        problems.append(f"feature layers {list(draft.aux_layers)} outside the target's {target.num_layers} layers")
    if problems:
        raise EagleError(
            f"{where}: this head does not fit the target ({'; '.join(problems)}); use the head trained for this target"
        )

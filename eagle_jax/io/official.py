"""Official EAGLE-1 / EAGLE-3 head checkpoints, both ways.

A head folder holds `config.json` and `model.safetensors` and/or `pytorch_model.bin` with upstream's
keys (EAGLE-3: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t` int64, `t2d` bool; EAGLE-1: `fc`,
`layers.{i}.*`). Weights are stored [out, in] there and [in, out] in our trees. Upstream loads with
`strict=False` and so silently ignores wrong keys; here every key and shape is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleError
from eagle_jax.io import files, store
from eagle_jax.io.hf import read_tensors
from eagle_jax.models import draft
from eagle_jax.models.config import DraftConfig, TargetConfig, check_draft_fits, draft_config_from_hf
from eagle_jax.models.params import describe_mismatch, flatten, unflatten

IGNORED_KEYS = ("embed_tokens.weight",)  # some heads carry a copy of the target's embedding; ours comes from the target
OFFICIAL_FILES = ("config.json", "model.safetensors", "pytorch_model.bin")  # what an exported head holds
VOCAB_MAP_DTYPES = {"d2t": np.int32, "t2d": np.bool_}  # in our trees; stored as int64 / bool


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


def detect_kind(keys: set[str]) -> str | None:
    """'eagle3' for `midlayer.*` keys, 'eagle1' for `layers.*`, else None."""
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if any(k.startswith("layers.") for k in keys):
        return "eagle1"
    return None


def params_from_tensors(tensors: dict[str, np.ndarray], c: DraftConfig, where: str, dtype=None) -> dict:
    """Official head tensors -> our parameter tree; every key and shape checked first."""
    names = official_names(c)
    specs = flatten(draft.param_specs(c))
    expected = {
        theirs: specs[ours].shape[::-1] if transpose else specs[ours].shape
        for ours, (theirs, transpose) in names.items()
    }
    present = {k: np.shape(v) for k, v in tensors.items() if k not in IGNORED_KEYS}
    problem = describe_mismatch(expected, present)
    if problem:
        raise EagleError(f"{where}: not a valid {c.kind.upper()} head for its config.json ({problem})")
    flat = {}
    for ours, (theirs, transpose) in names.items():
        x = np.asarray(tensors[theirs])
        x = x.T if transpose else x
        if ours in VOCAB_MAP_DTYPES:
            x = x.astype(VOCAB_MAP_DTYPES[ours])
        elif dtype is not None:
            x = x.astype(dtype)
        flat[ours] = x
    return unflatten(flat)


def tensors_from_params(params: dict, c: DraftConfig) -> dict[str, np.ndarray]:
    """Our parameter tree -> official keys, layouts and dtypes (d2t int64, t2d bool)."""
    flat = flatten(params)
    out = {}
    for ours, (theirs, transpose) in official_names(c).items():
        x = np.asarray(flat[ours])
        if ours == "d2t":
            x = x.astype(np.int64)
        out[theirs] = np.ascontiguousarray(x.T if transpose else x)
    return out


def load_head(
    head_dir: str | Path, target: TargetConfig, kind: str | None = None, dtype=None
) -> tuple[DraftConfig, dict]:
    """(config, host parameters) of an official head folder, checked to fit `target`.

    The kind is detected from the keys; `kind` asserts it (a mismatch is an error).
    """
    head_dir = Path(head_dir)
    if not head_dir.is_dir():
        raise EagleError(f"{head_dir}: draft directory not found")
    raw_cfg = files.read_json(head_dir / "config.json")
    tensors = read_tensors(head_dir)
    detected = detect_kind(set(tensors))
    if detected is None:
        raise EagleError(
            f"{head_dir}: no EAGLE head keys found (expected 'midlayer.*' for EAGLE-3 or 'layers.*' for EAGLE-1)"
        )
    if kind is not None and kind != detected:
        raise EagleError(
            f"{head_dir}: this is an {detected.upper()} head (by its keys) but {kind.upper()} was requested; "
            "drop the override"
        )
    cfg = draft_config_from_hf(raw_cfg, detected)
    check_draft_fits(cfg, target, str(head_dir))
    return cfg, params_from_tensors(tensors, cfg, str(head_dir), dtype)


def official_config(dcfg: DraftConfig, tcfg: TargetConfig) -> dict:
    """A head's config.json in upstream's format: EAGLE-3 as `eagle/traineagle3/config.json`, EAGLE-1 as the v1
    branch's `eagle/train/*_config.json` plus its fc's `bias` and the rope settings `eagle/model/cnets1.py` reads."""
    rope = dcfg.rope
    rope_scaling = None
    if rope.rope_type != "default":
        rope_scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
        if rope.rope_type == "llama3":
            rope_scaling.update(
                low_freq_factor=rope.low_freq_factor,
                high_freq_factor=rope.high_freq_factor,
                original_max_position_embeddings=rope.original_max_position_embeddings,
            )
    eos = list(tcfg.eos_token_ids)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if dcfg.kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "bos_token_id": tcfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": tcfg.pad_token_id,
        "hidden_act": "silu",
        "hidden_size": dcfg.hidden_size,
        "head_dim": dcfg.head_dim,
        "initializer_range": 0.02,
        "intermediate_size": dcfg.intermediate_size,
        "max_position_embeddings": rope.max_position_embeddings,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "num_hidden_layers": dcfg.num_layers,
        "pretraining_tp": 1,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_scaling": rope_scaling,
        "rope_theta": rope.theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": dcfg.vocab_size,
    }
    if dcfg.kind == "eagle1":
        return {**cfg, "bias": dcfg.fc_bias}
    cfg["draft_vocab_size"] = dcfg.draft_vocab_size
    if dcfg.target_hidden_size != dcfg.hidden_size:
        cfg["target_hidden_size"] = dcfg.target_hidden_size
    return cfg


def _torch_tensor(x: np.ndarray):
    import torch

    x = np.array(x)  # a writable copy
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _with_dtype_field(raw: dict, tensors: dict[str, np.ndarray]) -> dict:
    """The official config with its dtype field naming the written dtype."""
    dtype = next(str(v.dtype) for v in tensors.values() if jnp.issubdtype(v.dtype, jnp.floating))
    field = "dtype" if "dtype" in raw and "torch_dtype" not in raw else "torch_dtype"
    return {**raw, field: dtype}


def save_head(out: str | Path, config: dict, params: dict, dcfg: DraftConfig, overwrite: bool = False) -> list[str]:
    """Write an official head folder: config.json, model.safetensors and pytorch_model.bin (only
    where torch is installed). The folder appears complete or not at all; returns the file names."""
    from safetensors.numpy import save_file

    tensors = tensors_from_params(params, dcfg)
    with files.new_directory(out, overwrite, OFFICIAL_FILES) as tmp:
        (tmp / "config.json").write_text(json.dumps(_with_dtype_field(config, tensors), indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            import torch
        except ImportError:
            pass
        else:
            torch.save({k: _torch_tensor(v) for k, v in tensors.items()}, tmp / "pytorch_model.bin")
    return sorted(p.name for p in Path(out).iterdir())


def export_store_head(store_dir: str | Path, out: str | Path, dtype=None, overwrite: bool = False) -> list[str]:
    """Write the draft head of a store (e.g. a training run's) as an official head folder; returns the file names."""
    files.check_output_directory(out, (store_dir,), overwrite, OFFICIAL_FILES)
    dcfg, params = store.load_draft_store(store_dir, dtype=dtype)
    return save_head(out, store.read_manifest(store_dir).draft_config, params, dcfg, overwrite)

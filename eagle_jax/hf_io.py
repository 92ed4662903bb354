"""Read Hugging Face / official EAGLE weight files and map them onto our parameter trees.

Supported layouts: `model.safetensors`, `model.safetensors.index.json` (sharded), `pytorch_model.bin`
and `pytorch_model.bin.index.json` (these need torch). Every expected tensor is checked by name and
shape; missing, unexpected and mis-shaped tensors are reported together in one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from eagle_jax.config import TargetConfig, load_target_config
from eagle_jax.errors import EagleError
from eagle_jax.spec import check_against_specs, unflatten_dict
from eagle_jax import target as target_model

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _torch_load(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise EagleError(
            f"{path}: reading .bin checkpoints needs torch; pip install 'eagle-jax[torch]' or convert to safetensors"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt pickles
        raise EagleError(f"{path}: cannot read torch checkpoint ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    out = {}
    for name, t in state.items():
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[name] = t.numpy()
    return out


def _safetensors_load(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise EagleError(f"{path}: cannot read safetensors file ({exc}); the file may be truncated") from None


def _load_file(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise EagleError(f"{path}: file not found")
    return _safetensors_load(path) if path.suffix == ".safetensors" else _torch_load(path)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a directory, in the first layout found."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EagleError(f"{model_dir}: directory not found")
    for name in WEIGHT_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        if name.endswith(".index.json"):
            try:
                shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError):
                raise EagleError(f"{path}: not a valid weight index (needs a 'weight_map')") from None
            return [model_dir / s for s in shards]
        return [path]
    raise EagleError(f"{model_dir}: no weights found (expected one of {', '.join(WEIGHT_FILES)})")


def iter_tensors(model_dir: str | Path, progress: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    files = weight_files(model_dir)
    for path in tqdm(files, desc="reading weights", unit="file", disable=not progress or len(files) < 2):
        yield from _load_file(path).items()


def read_tensors(model_dir: str | Path, progress: bool = False) -> dict[str, np.ndarray]:
    return dict(iter_tensors(model_dir, progress))


# ---------------------------------------------------------------- target mapping


def _target_layer_names(cfg: TargetConfig) -> dict[str, tuple[str, bool]]:
    """Our per-layer leaf name -> (HF name template with {i}, transpose?)."""
    names = {
        "attn_norm": ("input_layernorm.weight", False),
        "q": ("self_attn.q_proj.weight", True),
        "k": ("self_attn.k_proj.weight", True),
        "v": ("self_attn.v_proj.weight", True),
        "o": ("self_attn.o_proj.weight", True),
        "mlp_norm": ("post_attention_layernorm.weight", False),
    }
    if cfg.qkv_bias:
        names.update({f"{x}_bias": (f"self_attn.{x}_proj.bias", False) for x in "qkv"})
    if cfg.o_bias:
        names["o_bias"] = ("self_attn.o_proj.bias", False)
    if cfg.qk_norm:
        names["q_norm"] = ("self_attn.q_norm.weight", False)
        names["k_norm"] = ("self_attn.k_norm.weight", False)
    if cfg.is_moe:
        names["mlp.router"] = ("block_sparse_moe.gate.weight", True)
        for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            names[f"mlp.{ours}"] = (f"block_sparse_moe.experts.{{e}}.{theirs}.weight", True)
    else:
        for x in ("gate", "up", "down"):
            names[f"mlp.{x}"] = (f"mlp.{x}_proj.weight", True)
    return names


def target_hf_names(cfg: TargetConfig) -> list[str]:
    """Flat HF tensor names expected for this config."""
    expected = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        expected.append("lm_head.weight")
    for i in range(cfg.num_layers):
        for template, _ in _target_layer_names(cfg).values():
            experts = range(cfg.num_experts) if "{e}" in template else [None]
            expected += [f"model.layers.{i}.{template.format(e=e)}" for e in experts]
    return expected


def target_params_from_tensors(tensors: dict[str, np.ndarray], cfg: TargetConfig, where: str,
                               dtype=None) -> dict:
    """Map HF tensors onto the target parameter tree, checking names and shapes against the specs."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    expected = set(target_hf_names(cfg))
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_summarise(missing)}")
        if unexpected:
            parts.append(f"unexpected {_summarise(unexpected)}")
        raise EagleError(f"{where}: weights do not match config.json ({'; '.join(parts)})")

    def cast(x: np.ndarray) -> np.ndarray:
        return x if dtype is None else np.asarray(x).astype(dtype)

    flat = {"embed": cast(tensors["model.embed_tokens.weight"]), "final_norm": cast(tensors["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        flat["lm_head"] = cast(tensors["lm_head.weight"]).T
    for ours, (template, transpose) in _target_layer_names(cfg).items():
        per_layer = []
        for i in range(cfg.num_layers):
            if "{e}" in template:
                mats = [tensors[f"model.layers.{i}.{template.format(e=e)}"] for e in range(cfg.num_experts)]
                per_layer.append(np.stack([m.T if transpose else m for m in mats]))
            else:
                t = tensors[f"model.layers.{i}.{template}"]
                per_layer.append(t.T if transpose else t)
        flat[f"layers.{ours}"] = cast(np.stack(per_layer))
    params = unflatten_dict(flat)
    check_against_specs(params, target_model.param_specs(cfg), where)
    return params


def _summarise(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def load_target(model_dir: str | Path, dtype=None, progress: bool = False) -> tuple[TargetConfig, dict]:
    """Config and host (numpy) parameters of an HF target directory."""
    cfg = load_target_config(model_dir)
    params = target_params_from_tensors(read_tensors(model_dir, progress), cfg, str(model_dir), dtype)
    return cfg, params

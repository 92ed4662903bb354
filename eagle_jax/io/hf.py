"""Hugging Face model folders: weight files in, target parameter trees out, and back.

Supported layouts: `model.safetensors`, `model.safetensors.index.json` (sharded), `pytorch_model.bin`
and `pytorch_model.bin.index.json` (these need torch). Every expected tensor is checked by name and
shape; missing, unexpected and mis-shaped tensors are reported together in one line. `save_target`
writes a dense target back as a folder transformers loads.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.models import target as target_model
from eagle_jax.models.config import TargetConfig, target_config_from_hf
from eagle_jax.models.params import check_against_specs, describe_mismatch, flatten, unflatten

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_target_config(model_dir: str | Path) -> TargetConfig:
    """The target config of an HF folder: `config.json` (+ `generation_config.json` for eos ids)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise EagleError(f"{model_dir}: directory not found (expected a Hugging Face model directory)")
    gen_path = model_dir / "generation_config.json"
    gen = files.read_json(gen_path) if gen_path.is_file() else None
    return target_config_from_hf(files.read_json(model_dir / "config.json"), gen)


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
        raise EagleError(
            f"{path}: cannot read torch checkpoint ({type(exc).__name__}: {files.first_line(exc)}); "
            "the file may be truncated"
        ) from None
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
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
    except (SafetensorError, OSError, ValueError) as exc:
        raise EagleError(
            f"{path}: cannot read safetensors file ({files.first_line(exc)}); the file may be truncated"
        ) from None


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
#
# Each leaf of our tree is read from one HF tensor per layer (or per layer and expert). A `_Source`
# names that tensor, its on-disk shape and how it becomes our [in, out] layout. Mixtral experts come in
# two layouts: the published one (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`, which
# transformers 5 still writes with `save_pretrained`) and the fused in-memory one of transformers 5
# (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`, `mlp.gate.weight`),
# which a raw `state_dict()` dump contains.

MOE_PER_EXPERT = "per_expert"
MOE_FUSED = "fused"


@dataclasses.dataclass(frozen=True)
class _Source:
    template: str  # HF name; {i} = layer, {e} = expert (stacked on a leading axis)
    shape: tuple[int, ...]  # on-disk shape of one tensor
    transposed: bool = False  # HF [out, in] -> our [in, out]
    rows: tuple[int, int] | None = None  # only rows [a, b) of the second-to-last axis (fused gate_up)

    def read(self, x: np.ndarray) -> np.ndarray:
        if self.rows is not None:
            x = x[..., self.rows[0] : self.rows[1], :]
        return np.swapaxes(x, -1, -2) if self.transposed else x

    def write(self, x: np.ndarray) -> np.ndarray:
        """Inverse of `read` (sources that read a part of a tensor are not written)."""
        return np.swapaxes(x, -1, -2) if self.transposed else x


def moe_layout(names: Iterable[str]) -> str:
    """Which Mixtral expert layout a set of tensor names uses."""
    return MOE_FUSED if any(n.endswith(".mlp.experts.gate_up_proj") for n in names) else MOE_PER_EXPERT


def _target_layer_sources(cfg: TargetConfig, layout: str = MOE_PER_EXPERT) -> dict[str, _Source]:
    """Our per-layer leaf name -> where it comes from in an HF checkpoint."""
    H, I, E, D = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.head_dim
    q_out, kv_out = cfg.num_heads * D, cfg.num_kv_heads * D
    src = {
        "attn_norm": _Source("input_layernorm.weight", (H,)),
        "q": _Source("self_attn.q_proj.weight", (q_out, H), True),
        "k": _Source("self_attn.k_proj.weight", (kv_out, H), True),
        "v": _Source("self_attn.v_proj.weight", (kv_out, H), True),
        "o": _Source("self_attn.o_proj.weight", (H, q_out), True),
        "mlp_norm": _Source("post_attention_layernorm.weight", (H,)),
    }
    if cfg.qkv_bias:
        src["q_bias"] = _Source("self_attn.q_proj.bias", (q_out,))
        src["k_bias"] = _Source("self_attn.k_proj.bias", (kv_out,))
        src["v_bias"] = _Source("self_attn.v_proj.bias", (kv_out,))
    if cfg.o_bias:
        src["o_bias"] = _Source("self_attn.o_proj.bias", (H,))
    if cfg.qk_norm:
        src["q_norm"] = _Source("self_attn.q_norm.weight", (D,))
        src["k_norm"] = _Source("self_attn.k_norm.weight", (D,))
    if cfg.is_moe and layout == MOE_FUSED:
        src["mlp.router"] = _Source("mlp.gate.weight", (E, H), True)
        src["mlp.gate"] = _Source("mlp.experts.gate_up_proj", (E, 2 * I, H), True, (0, I))
        src["mlp.up"] = _Source("mlp.experts.gate_up_proj", (E, 2 * I, H), True, (I, 2 * I))
        src["mlp.down"] = _Source("mlp.experts.down_proj", (E, H, I), True)
    elif cfg.is_moe:
        src["mlp.router"] = _Source("block_sparse_moe.gate.weight", (E, H), True)
        src["mlp.gate"] = _Source("block_sparse_moe.experts.{e}.w1.weight", (I, H), True)
        src["mlp.up"] = _Source("block_sparse_moe.experts.{e}.w3.weight", (I, H), True)
        src["mlp.down"] = _Source("block_sparse_moe.experts.{e}.w2.weight", (H, I), True)
    else:
        src["mlp.gate"] = _Source("mlp.gate_proj.weight", (I, H), True)
        src["mlp.up"] = _Source("mlp.up_proj.weight", (I, H), True)
        src["mlp.down"] = _Source("mlp.down_proj.weight", (H, I), True)
    return src


def _names(template: str, cfg: TargetConfig, i: int) -> list[str]:
    experts = range(cfg.num_experts) if "{e}" in template else [None]
    return [f"model.layers.{i}.{template.format(e=e)}" for e in experts]


def target_hf_shapes(cfg: TargetConfig, layout: str = MOE_PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> on-disk shape, for every tensor this config expects."""
    V, H = cfg.vocab_size, cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    sources = _target_layer_sources(cfg, layout)
    for i in range(cfg.num_layers):
        for s in sources.values():
            shapes.update({name: s.shape for name in _names(s.template, cfg, i)})
    return shapes


def target_params_from_tensors(tensors: dict[str, np.ndarray], cfg: TargetConfig, where: str, dtype=None) -> dict:
    """Map HF tensors onto the target parameter tree, checking every name and shape first."""
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    layout = moe_layout(tensors) if cfg.is_moe else MOE_PER_EXPERT
    expected = target_hf_shapes(cfg, layout)
    problem = describe_mismatch(expected, {k: np.shape(v) for k, v in tensors.items()})
    if problem:
        raise EagleError(f"{where}: weights do not match config.json ({problem})")

    def cast(x: np.ndarray) -> np.ndarray:
        return np.asarray(x) if dtype is None else np.asarray(x).astype(dtype)

    flat = {"embed": cast(tensors["model.embed_tokens.weight"]), "final_norm": cast(tensors["model.norm.weight"])}
    if not cfg.tie_word_embeddings:
        flat["lm_head"] = cast(tensors["lm_head.weight"]).T
    for ours, s in _target_layer_sources(cfg, layout).items():
        for i in range(cfg.num_layers):
            parts = [tensors[name] for name in _names(s.template, cfg, i)]
            flat[f"layers.{i}.{ours}"] = cast(s.read(np.stack(parts) if "{e}" in s.template else parts[0]))
    params = unflatten(flat)
    check_against_specs(params, target_model.param_specs(cfg), where)
    return params


def load_target(model_dir: str | Path, dtype=None, progress: bool = False) -> tuple[TargetConfig, dict]:
    """Config and host (numpy) parameters of an HF target directory."""
    cfg = load_target_config(model_dir)
    params = target_params_from_tensors(read_tensors(model_dir, progress), cfg, str(model_dir), dtype)
    return cfg, params


def target_tensors(params: dict, cfg: TargetConfig) -> dict[str, np.ndarray]:
    """Our target parameter tree -> HF tensor names and layouts (Mixtral experts in the per-expert layout)."""
    flat = {k: np.asarray(v) for k, v in flatten(params).items()}
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = flat["lm_head"].T
    for ours, s in _target_layer_sources(cfg, MOE_PER_EXPERT).items():
        for i in range(cfg.num_layers):
            stored = s.write(flat[f"layers.{i}.{ours}"])
            names = _names(s.template, cfg, i)
            out.update(zip(names, stored if "{e}" in s.template else [stored]))
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def save_target(
    out: str | Path,
    params: dict,
    cfg: TargetConfig,
    config: dict,
    generation_config: dict | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an HF folder (config.json, generation_config.json, model.safetensors, `extra_files` name -> text)
    that transformers and `load_target` read; it appears complete or not at all."""
    from safetensors.numpy import save_file

    check_against_specs(params, target_model.param_specs(cfg), "target")
    owned = ("config.json", "generation_config.json", "model.safetensors", *(extra_files or {}))
    with files.new_directory(out, overwrite, owned) as tmp:
        save_file(target_tensors(params, cfg), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        texts = {"config.json": json.dumps(config, indent=2) + "\n", **(extra_files or {})}
        if generation_config is not None:
            texts["generation_config.json"] = json.dumps(generation_config, indent=2) + "\n"
        for name, text in texts.items():
            (tmp / name).write_text(text)
    return Path(out)

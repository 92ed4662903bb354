"""Reading llama.cpp GGUF model files into Hugging Face form.

    model = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # config, float32 tensors under HF names
    gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-hf")  # an HF folder: config, weights, tokenizer

Only `llama` files are read (Llama 1/2/3, Mistral, SmolLM, ... as llama.cpp converts them). Quantised
tensors are dequantised to float32 with the `gguf` package, so the folder holds exactly the weights
llama.cpp computes with, at 4 bytes per parameter. llama.cpp's converter reorders the rows of each
query and key projection for its rotary layout; `read_gguf` restores the Hugging Face order. Llama 3
rope scaling, which llama.cpp stores as a `rope_freqs` tensor rather than as metadata, is recognised
and written back as `rope_scaling` (rope_type "llama3").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from tqdm import tqdm

from eagle_jax.errors import EagleError
from eagle_jax.io import files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SUPPORTED_ARCHITECTURES = ("llama",)
SUPPORTED_TYPES = (
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_ROPE_FREQS = "rope_freqs.weight"

# llama.<key> -> HF config field, for the keys every llama file carries
_REQUIRED_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
}
# Llama 3.x rope scaling apart from its factor; llama.cpp keeps only the per-frequency result (rope_freqs)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class GGUFModel:
    """A GGUF model in Hugging Face form."""

    config: dict  # config.json: LlamaForCausalLM, sizes, rope, token ids, torch_dtype "float32"
    generation_config: dict  # generation_config.json: bos/eos/pad ids (eos also lists eot/eom when they differ)
    tensors: dict[str, np.ndarray]  # HF names and layouts, float32: model.layers.{i}.self_attn.q_proj.weight [out, in]
    source_types: dict[str, str]  # HF name -> the GGUF type it was stored as ("Q4_K", "F32", ...)
    chat_template: str | None


def _open(path: Path) -> gguf.GGUFReader:
    """A reader of an existing, complete GGUF file; anything else is a one-line `EagleError`."""
    if not path.is_file():
        raise EagleError(f"{path}: file not found; pass the path of a llama.cpp .gguf model file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise EagleError(
            f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); pass a llama.cpp .gguf model file"
        )
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as exc:
        raise EagleError(
            f"{path}: unreadable GGUF file, truncated or corrupt ({files.first_line(exc)}); "
            "download or convert it again"
        ) from None


def _meta(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value (str, number, bool or list), or None when the key is absent."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _check_llama_file(reader: gguf.GGUFReader, path: Path) -> None:
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise EagleError(
            f"{path}: architecture {arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); convert the original Hugging Face checkpoint instead"
        )
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise EagleError(
            f"{path}: no tokenizer in the metadata (tokenizer.ggml.tokens is missing); use a GGUF file "
            "that carries its vocabulary, as llama.cpp's convert_hf_to_gguf.py writes"
        )
    model = _meta(reader, "tokenizer.ggml.model")
    if model == "gpt2" and "tokenizer.ggml.merges" not in reader.fields:
        raise EagleError(
            f"{path}: incomplete tokenizer in the metadata (a BPE vocabulary without tokenizer.ggml.merges); use a "
            "GGUF file that carries its whole tokenizer, as llama.cpp's convert_hf_to_gguf.py writes"
        )


def _required(reader: gguf.GGUFReader, path: Path, key: str) -> Any:
    value = _meta(reader, f"llama.{key}")
    if value is None:
        raise EagleError(
            f"{path}: metadata key llama.{key} is missing; the file is incomplete, "
            "convert it again with llama.cpp's convert_hf_to_gguf.py"
        )
    return value


def _token_ids(reader: gguf.GGUFReader) -> dict[str, int]:
    keys = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "padding_token_id"}
    ids = {hf: _meta(reader, f"tokenizer.ggml.{key}") for hf, key in keys.items()}
    return {k: v for k, v in ids.items() if v is not None}


def _generation_config(reader: gguf.GGUFReader) -> dict:
    """The token ids; eos lists every end-of-generation id llama.cpp stops at (eos, eot, eom) when they differ."""
    ids = _token_ids(reader)
    stops = [_meta(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    return {**ids, "eos_token_id": stops} if len(stops) > 1 else ids


def llama3_rope_factors(rope_scaling: dict, head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp's `rope_freqs` [head_dim / 2] for Llama 3 rope scaling (as convert_hf_to_gguf.py computes it)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / freqs
    factor, low, high = rope_scaling["factor"], rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    context = rope_scaling["original_max_position_embeddings"]
    smooth = (context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, medium))


def _llama3_rope_scaling(path: Path, factors: np.ndarray, head_dim: int, theta: float) -> dict:
    """Llama 3's `rope_scaling` from llama.cpp's `rope_freqs`, refused unless it reproduces them."""
    if factors.shape != (head_dim // 2,):
        raise EagleError(
            f"{path}: tensor {_ROPE_FREQS} has shape {list(factors.shape)}, expected [{head_dim // 2}] "
            "(head_dim / 2); the file is inconsistent, convert it again"
        )
    scaling = {"rope_type": "llama3", "factor": _f32(factors.max()), **_LLAMA3_ROPE}
    if not np.allclose(factors, llama3_rope_factors(scaling, head_dim, theta), rtol=1e-5, atol=0):
        raise EagleError(
            f"{path}: tensor {_ROPE_FREQS} is not Llama 3 rope scaling with factor {scaling['factor']} "
            f"and {_LLAMA3_ROPE}; convert the original Hugging Face checkpoint instead"
        )
    return scaling


def _rope_scaling(
    reader: gguf.GGUFReader, path: Path, freq_factors: np.ndarray | None, head_dim: int, theta: float
) -> dict | None:
    if freq_factors is not None:
        return _llama3_rope_scaling(path, freq_factors, head_dim, theta)
    kind = _meta(reader, "llama.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(_required(reader, path, "rope.scaling.factor"))}
    raise EagleError(
        f"{path}: llama.rope.scaling.type {kind!r} is not supported (supported: none, linear, and "
        f"Llama 3 scaling stored as {_ROPE_FREQS}); convert the original Hugging Face checkpoint instead"
    )


def _config(reader: gguf.GGUFReader, path: Path, tied: bool, freq_factors: np.ndarray | None) -> dict:
    """config.json for a LlamaForCausalLM from the llama.* metadata."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config |= {field: int(_required(reader, path, key)) for key, field in _REQUIRED_KEYS.items()}
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    kv_heads = _meta(reader, "llama.attention.head_count_kv")
    key_length = _meta(reader, "llama.attention.key_length")
    head_dim = int(key_length) if key_length is not None else hidden // heads
    rotary = _meta(reader, "llama.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise EagleError(
            f"{path}: llama.rope.dimension_count is {rotary} but the head dimension is {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    theta = _f32(_meta(reader, "llama.rope.freq_base") or 10000.0)
    config |= {
        "num_key_value_heads": int(kv_heads) if kv_heads is not None else heads,
        "rms_norm_eps": _f32(_required(reader, path, "attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        **_token_ids(reader),
        "torch_dtype": "float32",
    }
    if key_length is not None:
        config["head_dim"] = head_dim
    rope_scaling = _rope_scaling(reader, path, freq_factors, head_dim, theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _hf_names(num_layers: int, tied: bool) -> dict[str, str]:
    """GGUF tensor name -> HF tensor name, for every tensor a llama file holds (`output` only when untied)."""
    names = {f"{g}.weight": f"{h}.weight" for g, h in _GLOBAL_TENSORS.items() if not (tied and g == "output")}
    names |= {
        f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight"
        for i in range(num_layers)
        for g, h in _LAYER_TENSORS.items()
    }
    return names


def _hf_shape(hf_name: str, config: dict) -> tuple[int, ...]:
    """The HF shape ([out, in] for projections) of a tensor, from the config."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "embed_tokens": (vocab, hidden),
        "lm_head": (vocab, hidden),
        "norm": (hidden,),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[hf_name.split(".")[-2]]


def _shape(t: gguf.ReaderTensor) -> tuple[int, ...]:
    """A tensor's shape outermost first (GGUF lists ne[0], the innermost dimension, first)."""
    return tuple(reversed(t.shape.tolist()))


def _check_types(path: Path, tensors: dict[str, gguf.ReaderTensor]) -> None:
    for name, t in tensors.items():
        if t.tensor_type not in SUPPORTED_TYPES:
            raise EagleError(
                f"{path}: tensor {name} has type {t.tensor_type.name}, which is not supported "
                f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)}); use a file quantised "
                "to one of those"
            )


def _check_tensors(path: Path, tensors: dict[str, gguf.ReaderTensor], names: dict[str, str], config: dict) -> None:
    """Every expected tensor present with its HF shape, and nothing else."""
    for name in tensors:
        if name not in names and name != _ROPE_FREQS:
            raise EagleError(
                f"{path}: tensor {name} has no counterpart in a Hugging Face LlamaForCausalLM; "
                "only plain Llama models are supported"
            )
    for name, hf_name in names.items():
        if name not in tensors:
            raise EagleError(f"{path}: tensor {name} is missing; the file is incomplete, convert it again")
        shape, expected = _shape(tensors[name]), _hf_shape(hf_name, config)
        if shape != expected:
            raise EagleError(
                f"{path}: tensor {name} has shape {list(shape)}, but the metadata implies "
                f"{list(expected)}; the file is inconsistent, convert it again"
            )


def _dequantise(t: gguf.ReaderTensor) -> np.ndarray:
    """A tensor as a float32 array in its own memory (not the file's map), outermost dimension first."""
    values = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.array(values, dtype=np.float32).reshape(_shape(t))


def unpermute_rotary_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a q/k projection [n_head * head_dim, ...].

    llama.cpp writes `w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)` (d = head_dim), interleaving the
    two rotary halves of each head; this is its exact inverse.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_tensor(t: gguf.ReaderTensor, hf_name: str, config: dict) -> np.ndarray:
    w = _dequantise(t)
    if hf_name.endswith("q_proj.weight"):
        return unpermute_rotary_rows(w, config["num_attention_heads"])
    if hf_name.endswith("k_proj.weight"):
        return unpermute_rotary_rows(w, config["num_key_value_heads"])
    return w


def _read_header(path: Path) -> tuple[gguf.GGUFReader, dict[str, gguf.ReaderTensor], dict, dict[str, str]]:
    """(reader, tensors by GGUF name, HF config, GGUF name -> HF name), every tensor's type and shape checked."""
    reader = _open(path)
    _check_llama_file(reader, path)
    by_name = {t.name: t for t in reader.tensors}
    _check_types(path, by_name)
    tied = "output.weight" not in by_name
    freq_factors = _dequantise(by_name[_ROPE_FREQS]) if _ROPE_FREQS in by_name else None
    config = _config(reader, path, tied, freq_factors)
    names = _hf_names(config["num_hidden_layers"], tied)
    _check_tensors(path, by_name, names, config)
    return reader, by_name, config, names


def read_gguf_config(path: str | Path) -> tuple[dict, dict]:
    """(config.json, generation_config.json) dicts of a llama GGUF file, without dequantising its tensors."""
    reader, _, config, _ = _read_header(Path(path))
    return config, _generation_config(reader)


def read_gguf(path: str | Path, progress: bool = False) -> GGUFModel:
    """Config and float32 HF tensors of a llama GGUF file; bad input raises a one-line `EagleError`."""
    path = Path(path)
    reader, by_name, config, names = _read_header(path)
    tensors, types = {}, {}
    for name, hf_name in tqdm(names.items(), desc=f"dequantising {path.name}", disable=not progress):
        tensors[hf_name] = _hf_tensor(by_name[name], hf_name, config)
        types[hf_name] = by_name[name].tensor_type.name
    return GGUFModel(config, _generation_config(reader), tensors, types, _meta(reader, "tokenizer.chat_template"))


def tokenizer_from_gguf(path: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer transformers builds from the file's `tokenizer.ggml.*` metadata, with its chat template."""
    from transformers import AutoTokenizer

    path = Path(path)
    reader = _open(path)
    _check_llama_file(reader, path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, OSError) as exc:
        raise EagleError(f"{path}: transformers cannot build its tokenizer ({files.first_line(exc)})") from None
    tokenizer.chat_template = _meta(reader, "tokenizer.chat_template")
    return tokenizer


def _write_tokenizer(tokenizer: PreTrainedTokenizerFast, chat_template: str | None, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template, and a tokenizer class every transformers
    version knows) and special_tokens_map.json."""
    tokenizer.save_pretrained(folder, save_jinja_files=False)
    if not (folder / "tokenizer.json").is_file():
        raise EagleError(f"{folder}: the tokenizer wrote no tokenizer.json; pass a fast tokenizer")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(tokenizer.special_tokens_map, indent=2) + "\n")


def write_hf_folder(model: GGUFModel, tokenizer: PreTrainedTokenizerFast, out: str | Path) -> Path:
    """Write an HF model folder (float32 safetensors, tokenizer, chat template); it appears whole or not at all."""
    from safetensors.numpy import save_file

    with files.new_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2) + "\n")
        save_file(model.tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer(tokenizer, model.chat_template, tmp)
    return Path(out).absolute()


def gguf_to_hf(gguf_path: str | Path, out: str | Path, progress: bool = True) -> Path:
    """Convert a llama GGUF file to an HF model folder `out` (refused if it exists and is not empty)."""
    files.check_output_directory(out, (gguf_path,))
    model = read_gguf(gguf_path, progress)
    return write_hf_folder(model, tokenizer_from_gguf(gguf_path), out)

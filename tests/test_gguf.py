"""GGUF reading (`eagle_jax.io.gguf`, `convert.gguf_to_hf`) on tiny Llama files written here.

The files are written the way llama.cpp's convert_hf_to_gguf.py writes them: q/k rows permuted per head,
norms in F32, a byte-level BPE vocabulary with merges, token types, bos/eos ids and a chat template in
`tokenizer.ggml.*`. Two kinds of quantised tensors:

- quantised: random float weights through `gguf.quants.quantize` (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1),
  on a 64-wide model;
- packed: blocks packed here from random codes and scales, following ggml's block layouts
  (ggml-common.h / ggml-quants.c), for every quantised type read, K-quants included (their blocks span 256
  values, hence a 256-wide model). Their dequantised values are known exactly: d * q, d * (q - 8),
  d * q + m, d * scale * q - dmin * min, ...

Checks: our tensors against the originals (F32: bit for bit) or the packed values, our logits against
transformers' own GGUF loading of the same file, our JAX target on the converted folder, rope scaling
against the original HF model, the tokenizer round trip, and one-line errors for bad files.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a model from a GGUF file

import jax.numpy as jnp  # noqa: E402
from gguf import GGMLQuantizationType as QType  # noqa: E402
from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: E402

from eagle_jax.errors import EagleError  # noqa: E402
from eagle_jax.io.gguf import gguf_to_hf, read_gguf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# a byte-level BPE vocabulary over printable ASCII and newline: 3 control tokens, 96 bytes, 29 merges
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_CHARS = [bytes_to_unicode()[b] for b in [10, *range(32, 127)]]
MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "Ġ a",
    "e r",
    "o n",
    "r e",
    "a t",
    "e n",
    "Ġ s",
    "Ġ o",
    "Ġ w",
    "o u",
    "i s",
    "Ġ c",
    "a n",
    "o r",
    "e s",
    "Ġ f",
    "Ġ b",
    "i t",
    "l l",
    "Ġ p",
    "in g",
    "Ġ m",
    "e d",
    "Ġ h",
    "a r",
]
TOKENS = SPECIALS + BYTE_CHARS + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)
BOS, EOS = 0, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXTS = ["the cat sat on the mat", " Hello, World!\nIt's 2024: is it raining?", "<|im_start|>user\nhi<|im_end|>", ""]

LAYER_TENSORS = {
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


@dataclass(frozen=True)
class Spec:
    hidden: int = 64
    inter: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    tied: bool = False
    theta: float = 10000.0
    context: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SMALL = Spec()
WIDE = Spec(hidden=256, inter=512, layers=1)  # K-quant blocks hold 256 values: every row a multiple of 256


def names(spec: Spec) -> dict[str, str]:
    """GGUF name -> HF name."""
    out = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not spec.tied:
        out["output.weight"] = "lm_head.weight"
    for i in range(spec.layers):
        out |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in LAYER_TENSORS.items()}
    return out


def hf_shape(hf_name: str, spec: Spec) -> tuple[int, ...]:
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    return {
        "embed_tokens": (VOCAB, spec.hidden),
        "lm_head": (VOCAB, spec.hidden),
        "q_proj": (q, spec.hidden),
        "k_proj": (kv, spec.hidden),
        "v_proj": (kv, spec.hidden),
        "o_proj": (spec.hidden, q),
        "gate_proj": (spec.inter, spec.hidden),
        "up_proj": (spec.inter, spec.hidden),
        "down_proj": (spec.hidden, spec.inter),
    }.get(hf_name.split(".")[-2], (spec.hidden,))


def random_hf(spec: Spec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF tensors: weights ~ N(0, 0.08^2) (embeddings 0.5), norms ~ 1 + N(0, 0.3^2)."""
    rng = np.random.default_rng(seed)
    out = {}
    for hf_name in names(spec).values():
        shape = hf_shape(hf_name, spec)
        std = 0.5 if "embed" in hf_name else 0.08
        out[hf_name] = 1 + 0.3 * rng.standard_normal(shape) if len(shape) == 1 else std * rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in out.items()}


def llama_cpp_permutation(rows: int, n_head: int) -> np.ndarray:
    """Row order llama.cpp writes a q/k projection in (convert_hf_to_gguf.py, LlamaModel.permute)."""
    w = np.arange(rows)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2).swapaxes(1, 2).reshape(w.shape)


def n_head_of(gguf_name: str, spec: Spec) -> int | None:
    return spec.heads if ".attn_q." in gguf_name else spec.kv_heads if ".attn_k." in gguf_name else None


def to_gguf_rows(gguf_name: str, w: np.ndarray, spec: Spec) -> np.ndarray:
    n_head = n_head_of(gguf_name, spec)
    return w if n_head is None else w[llama_cpp_permutation(w.shape[0], n_head)]


def from_gguf_rows(gguf_name: str, w: np.ndarray, spec: Spec) -> np.ndarray:
    n_head = n_head_of(gguf_name, spec)
    if n_head is None:
        return w
    out = np.empty_like(w)
    out[llama_cpp_permutation(w.shape[0], n_head)] = w
    return out


# --- ggml blocks packed from known codes: (raw bytes [n, type size], values [n, block size]) ---------------------


def _f16(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    return (scale * rng.uniform(0.5, 1.5, n)).astype(np.float16)


def _b(x: np.ndarray) -> np.ndarray:
    """A [n] or [n, k] array as its little-endian bytes [n, bytes]."""
    return np.ascontiguousarray(x).reshape(len(x), -1).view(np.uint8)


def _col(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)[:, None]


def pack_q8_0(rng, n):  # d, int8 q[32]: d * q
    d, q = _f16(rng, n, 7e-4), rng.integers(-127, 128, (n, 32), dtype=np.int8)
    return np.hstack([_b(d), _b(q)]), _col(d) * q


def pack_q4_0(rng, n):  # d, qs[16] (element j low nibble, j + 16 high): d * (q - 8)
    d, q = _f16(rng, n, 0.011), rng.integers(0, 16, (n, 32), dtype=np.uint8)
    return np.hstack([_b(d), q[:, :16] | q[:, 16:] << 4]), _col(d) * (q.astype(np.float32) - 8)


def pack_q4_1(rng, n):  # d, m, qs[16]: d * q + m
    d, q = _f16(rng, n, 0.011), rng.integers(0, 16, (n, 32), dtype=np.uint8)
    m = (-7.5 * d).astype(np.float16)
    return np.hstack([_b(d), _b(m), q[:, :16] | q[:, 16:] << 4]), _col(d) * q + _col(m)


def _q5_bytes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qh: uint32 whose bit j is bit 4 of element j, qs[16] of the low nibbles as in Q4_0)."""
    qh = ((q.astype(np.uint32) >> 4) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return _b(qh.astype("<u4")), (q[:, :16] & 15) | (q[:, 16:] & 15) << 4


def pack_q5_0(rng, n):  # d, qh, qs: d * (q - 16)
    d, q = _f16(rng, n, 0.0054), rng.integers(0, 32, (n, 32), dtype=np.uint8)
    return np.hstack([_b(d), *_q5_bytes(q)]), _col(d) * (q.astype(np.float32) - 16)


def pack_q5_1(rng, n):  # d, m, qh, qs: d * q + m
    d, q = _f16(rng, n, 0.0054), rng.integers(0, 32, (n, 32), dtype=np.uint8)
    m = (-15.5 * d).astype(np.float16)
    return np.hstack([_b(d), _b(m), *_q5_bytes(q)]), _col(d) * q + _col(m)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes (the inverse of ggml's get_scale_min_k4)."""
    return np.hstack(
        [sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6, (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4]
    )


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """qs[128]: per 64 values, 32 bytes holding values 0..31 in the low nibbles and 32..63 in the high ones."""
    q = q.reshape(len(q), 4, 2, 32) & 15
    return (q[:, :, 0] | q[:, :, 1] << 4).reshape(len(q), 128)


def _k_values(d, dmin, sc, mn, q) -> np.ndarray:
    sub = np.arange(256) // 32  # 8 sub-blocks of 32, each with its own scale and min
    return _col(d) * sc[:, sub] * q - _col(dmin) * mn[:, sub]


def pack_q4_k(rng, n):  # d, dmin, scales[12], qs[128]: d * sc * q - dmin * mn per sub-block of 32
    d, q = _f16(rng, n, 3.4e-4), rng.integers(0, 16, (n, 256), dtype=np.uint8)
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    dmin, mn = (15 * d).astype(np.float16), sc >> 1  # centres the values
    raw = np.hstack([_b(d), _b(dmin), _k_scales(sc, mn), _k_nibbles(q)])
    return raw, _k_values(d, dmin, sc.astype(np.float32), mn.astype(np.float32), q)


def pack_q5_k(rng, n):  # d, dmin, scales[12], qh[32] (bit j: bit 4 of sub-block j's value), qs[128]
    d, q = _f16(rng, n, 1.7e-4), rng.integers(0, 32, (n, 256), dtype=np.uint8)
    sc = rng.integers(0, 64, (n, 8), dtype=np.uint8)
    dmin, mn = (31 * d).astype(np.float16), sc >> 1
    qh = ((q.reshape(n, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=1, dtype=np.uint8)
    raw = np.hstack([_b(d), _b(dmin), _k_scales(sc, mn), qh, _k_nibbles(q)])
    return raw, _k_values(d, dmin, sc.astype(np.float32), mn.astype(np.float32), q)


def pack_q6_k(rng, n):  # ql[128], qh[64], int8 scales[16], d: d * sc[e // 16] * (q - 32)
    d, q = _f16(rng, n, 7e-5), rng.integers(0, 64, (n, 256), dtype=np.uint8)
    sc = rng.integers(-60, 61, (n, 16), dtype=np.int8)
    g = q.reshape(n, 2, 4, 32)  # halves of 128, four groups of 32 in each
    ql = np.concatenate([g[:, :, 0] & 15 | (g[:, :, 2] & 15) << 4, g[:, :, 1] & 15 | (g[:, :, 3] & 15) << 4], axis=2)
    qh = g[:, :, 0] >> 4 | (g[:, :, 1] >> 4) << 2 | (g[:, :, 2] >> 4) << 4 | (g[:, :, 3] >> 4) << 6
    raw = np.hstack([ql.reshape(n, 128), qh.reshape(n, 64), _b(sc), _b(d)])
    return raw, _col(d) * sc[:, np.arange(256) // 16] * (q.astype(np.float32) - 32)


PACKERS: dict[QType, Callable] = {
    QType.Q8_0: pack_q8_0,
    QType.Q4_0: pack_q4_0,
    QType.Q4_1: pack_q4_1,
    QType.Q5_0: pack_q5_0,
    QType.Q5_1: pack_q5_1,
    QType.Q4_K: pack_q4_k,
    QType.Q5_K: pack_q5_k,
    QType.Q6_K: pack_q6_k,
}


def packed_tensor(rng, qtype: QType, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [rows, row bytes], values [rows, cols]) of a tensor of packed random blocks."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw, values = PACKERS[qtype](rng, shape[0] * shape[1] // block)
    assert raw.shape[1] == size, (qtype.name, raw.shape)
    return raw.reshape(shape[0], -1), values.astype(np.float32).reshape(shape)


# --- files --------------------------------------------------------------------------------------------------------

Stored = dict[str, tuple[np.ndarray, "QType | None"]]  # GGUF name -> (data, raw type; None: the array's own dtype)


def quantised(hf: dict[str, np.ndarray], spec: Spec, qtype: QType) -> Stored:
    """The HF tensors as llama.cpp writes them: q/k permuted, 2-D ones in `qtype`, norms in F32."""
    out = {}
    for gguf_name, hf_name in names(spec).items():
        w = to_gguf_rows(gguf_name, hf[hf_name], spec)
        if w.ndim == 1 or qtype == QType.F32:
            out[gguf_name] = (w, None)
        elif qtype == QType.F16:
            out[gguf_name] = (w.astype(np.float16), None)
        else:
            out[gguf_name] = (gguf.quants.quantize(w, qtype), qtype)
    return out


def packed(spec: Spec, qtype: QType, seed: int = 0) -> tuple[Stored, dict[str, np.ndarray]]:
    """(stored tensors with every 2-D one packed in `qtype`, the HF tensors they hold)."""
    rng = np.random.default_rng(seed)
    hf = random_hf(spec, seed)
    stored = {}
    for gguf_name, hf_name in names(spec).items():
        if hf[hf_name].ndim == 1:
            stored[gguf_name] = (hf[hf_name], None)
            continue
        raw, values = packed_tensor(rng, qtype, hf_shape(hf_name, spec))
        stored[gguf_name] = (raw, qtype)
        hf[hf_name] = from_gguf_rows(gguf_name, values, spec)
    return stored, hf


def write_gguf(
    path: Path,
    spec: Spec,
    stored: Stored,
    arch: str = "llama",
    tokenizer: bool = True,
    merges: bool = True,
    omit: tuple[str, ...] = (),
    extra: Callable | None = None,
) -> Path:
    """A GGUF file as llama.cpp writes it; `omit` drops llama.* keys, `extra(writer)` adds metadata."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    ints = {
        "context_length": spec.context,
        "embedding_length": spec.hidden,
        "feed_forward_length": spec.inter,
        "block_count": spec.layers,
        "attention.head_count": spec.heads,
        "attention.head_count_kv": spec.kv_heads,
        "rope.dimension_count": spec.head_dim,
        "vocab_size": VOCAB,
    }
    for key, value in ints.items():
        if key not in omit:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", spec.theta)
    if extra is not None:
        extra(w)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(TOKENS)
        w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (VOCAB - len(SPECIALS)))
        if merges:
            w.add_token_merges(MERGES)
        w.add_bos_token_id(BOS)
        w.add_eos_token_id(EOS)
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE)
    for name, (data, raw_dtype) in stored.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


QUANTISED = {
    "f32": QType.F32,
    "f16": QType.F16,
    "bf16": QType.BF16,
    "q8_0": QType.Q8_0,
    "q4_0": QType.Q4_0,
    "q4_1": QType.Q4_1,
    "q5_0": QType.Q5_0,
    "q5_1": QType.Q5_1,
}
PACKED = {f"packed_{q.name.lower()}": q for q in PACKERS}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (GGUF file, the HF tensors it holds), written once per module."""
    root = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(name: str):
        if name not in cache:
            spec = WIDE if name in PACKED else replace(SMALL, tied=name == "tied")
            if name in PACKED:
                stored, hf = packed(spec, PACKED[name])
            else:
                hf = random_hf(spec)
                stored = quantised(hf, spec, QUANTISED.get(name, QType.F32))
            cache[name] = (write_gguf(root / f"{name}.gguf", spec, stored), hf)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def folders(files, tmp_path_factory):
    """name -> the HF folder gguf_to_hf writes for that file."""
    root = tmp_path_factory.mktemp("hf")
    cache = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = gguf_to_hf(files(name)[0], root / name, progress=False)
        return cache[name]

    return get


TOKEN_IDS = np.random.default_rng(1).integers(0, VOCAB, size=(2, 12))


def hf_logits(model, tokens: np.ndarray = TOKEN_IDS, positions: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        pos = None if positions is None else torch.from_numpy(positions)
        return model(torch.from_numpy(tokens), position_ids=pos).logits.numpy()


def load_hf(folder: Path, gguf_file: str | None = None):
    kwargs = {} if gguf_file is None else {"gguf_file": gguf_file}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    return model.eval()


def transformers_gguf(path: Path):
    """transformers' own loading of the GGUF file (the reference)."""
    return load_hf(path.parent, path.name)


def assert_close(actual, expected, what: str, rel: float = 1e-4):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err, scale = np.max(np.abs(actual - expected)), np.max(np.abs(expected))
    assert err <= rel * scale, f"{what}: max abs diff {err:.3g} > {rel} * max |ref| {scale:.3g}"


# --- tests --------------------------------------------------------------------------------------------------------


def test_f32_tensors_are_the_originals_bit_for_bit(files):
    path, hf = files("f32")
    model = read_gguf(path)
    assert model.tensors.keys() == hf.keys()
    for name, w in hf.items():
        assert model.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(model.tensors[name], w, err_msg=name)
    assert set(model.source_types.values()) == {"F32"}


@pytest.mark.parametrize("name", sorted(set(QUANTISED) - {"f32"}))
def test_quantised_tensors_near_the_originals(name, files):
    """gguf.quants.quantize'd weights come back in HF layout, within the format's rounding."""
    path, hf = files(name)
    model = read_gguf(path)
    assert model.tensors.keys() == hf.keys()
    for hf_name, w in hf.items():
        err = np.abs(model.tensors[hf_name] - w).mean() / np.abs(w).mean()
        assert err < 0.15, (hf_name, err)  # 4-bit rounding: up to 0.09; a misplaced row or block: ~1.4
    assert model.source_types["model.layers.0.self_attn.q_proj.weight"] == QUANTISED[name].name


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_blocks_dequantise_to_their_codes(name, files):
    """Every quantised type read: blocks packed from known codes give d * q (...) exactly, in HF layout."""
    path, hf = files(name)
    model = read_gguf(path)
    assert model.tensors.keys() == hf.keys()
    for hf_name, w in hf.items():
        np.testing.assert_allclose(model.tensors[hf_name], w, rtol=1e-6, atol=1e-7, err_msg=hf_name)
    assert model.source_types["model.layers.0.self_attn.q_proj.weight"] == PACKED[name].name


@pytest.mark.parametrize("name", sorted(QUANTISED) + ["packed_q4_k", "packed_q5_k", "packed_q6_k", "tied"])
def test_logits_match_transformers_gguf_loading(name, files, folders):
    ours = load_hf(folders(name))
    ref = transformers_gguf(files(name)[0])
    assert_close(hf_logits(ours), hf_logits(ref), f"{name} logits")


@pytest.mark.parametrize("name", ["q4_0", "tied", "packed_q6_k"])
def test_jax_target_matches_transformers(name, files, folders):
    from eagle_jax.io import hf
    from eagle_jax.models import target

    cfg, params = hf.load_target(folders(name))
    b, t = TOKEN_IDS.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = target.init_cache(cfg, b, t)
    out = target.forward(params, cfg, jnp.asarray(TOKEN_IDS), positions, cache, feature_layers=())
    assert_close(out.logits, hf_logits(transformers_gguf(files(name)[0])), f"{name} JAX logits")


def test_tied_embeddings_stay_tied(files, folders):
    model = read_gguf(files("tied")[0])
    assert model.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in model.tensors
    loaded = load_hf(folders("tied"))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()

    untied = read_gguf(files("f32")[0])
    assert untied.config["tie_word_embeddings"] is False
    np.testing.assert_array_equal(untied.tensors["lm_head.weight"], files("f32")[1]["lm_head.weight"])
    assert not np.array_equal(untied.tensors["lm_head.weight"], untied.tensors["model.embed_tokens.weight"])


def test_config_and_generation_config(folders):
    config = json.loads((folders("f32") / "config.json").read_text())
    assert config == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
    }
    assert json.loads((folders("f32") / "generation_config.json").read_text()) == {
        "bos_token_id": BOS,
        "eos_token_id": EOS,
    }
    files_written = {p.name for p in folders("f32").iterdir()}
    assert files_written == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }


def test_eot_joins_the_stop_ids(tmp_path):
    stored = quantised(random_hf(SMALL), SMALL, QType.F32)
    path = write_gguf(tmp_path / "eot.gguf", SMALL, stored, extra=lambda w: w.add_eot_token_id(1))
    assert read_gguf(path).generation_config == {"bos_token_id": BOS, "eos_token_id": [EOS, 1]}


def test_tokenizer_round_trip(files, folders):
    path = files("f32")[0]
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = transformers.AutoTokenizer.from_pretrained(str(folders("f32")))
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ids[0] == BOS  # tokenizer.ggml.add_bos_token survives
        assert ours.decode(ids) == ref.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert TOKENS.index("Ġthe") in ours(" the").input_ids  # merges applied
    messages = [{"role": "user", "content": "hi"}]
    rendered = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (ours.bos_token, ours.eos_token) == (TOKENS[BOS], TOKENS[EOS])


def llama_config(spec: Spec, rope: dict):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=spec.hidden,
        intermediate_size=spec.inter,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.context,
        rms_norm_eps=1e-5,
        rope_parameters={**rope, "rope_theta": spec.theta},
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    config._attn_implementation = "eager"
    return config


ROPES = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_scaling_matches_the_original_model(kind, tmp_path):
    """Llama 3 scaling is stored by llama.cpp as a rope_freqs tensor, linear as metadata; both come back."""
    spec, rope = replace(SMALL, theta=500000.0, context=16384), ROPES[kind]
    hf = random_hf(spec)
    original = transformers.LlamaForCausalLM(llama_config(spec, rope)).eval()
    original.load_state_dict({k: torch.from_numpy(v) for k, v in hf.items()})
    stored = quantised(hf, spec, QType.F32)
    extra = None
    if kind == "llama3":
        stored["rope_freqs.weight"] = (llama_cpp_rope_factors(spec.head_dim, spec.theta, rope), None)
    else:

        def extra(w):
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])

    folder = gguf_to_hf(write_gguf(tmp_path / "rope.gguf", spec, stored, extra=extra), tmp_path / "hf", progress=False)
    ours = load_hf(folder)
    assert {k: ours.config.rope_parameters[k] for k in rope} == rope
    # rotary attention sees position differences: 8000 apart, low frequencies (the scaled ones) matter
    positions = np.broadcast_to(np.r_[np.arange(6), 8000 + np.arange(6)], TOKEN_IDS.shape).copy()
    expected = hf_logits(original, positions=positions)
    assert_close(hf_logits(ours, positions=positions), expected, f"{kind} logits")
    unscaled = transformers.LlamaForCausalLM(llama_config(spec, {"rope_type": "default"})).eval()
    unscaled.load_state_dict(original.state_dict())
    assert np.abs(hf_logits(unscaled, positions=positions) - expected).max() > 1e-2, "positions miss the scaling"


def llama_cpp_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it for rope_type llama3."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            factors.append(1)
        elif wavelen > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# --- bad input ----------------------------------------------------------------------------------------------------


def _bad_file(kind: str, good: Path, tmp: Path) -> Path:
    path = tmp / f"{kind}.gguf"
    small = quantised(random_hf(SMALL), SMALL, QType.F32)
    if kind == "truncated":
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif kind == "truncated_header":
        path.write_bytes(good.read_bytes()[:64])
    elif kind == "magic":
        path.write_bytes(b"GGML" + good.read_bytes()[4:])
    elif kind == "architecture":
        write_gguf(path, SMALL, small, arch="gpt2")
    elif kind == "tensor_type":
        raw = np.random.default_rng(0).integers(0, 256, (SMALL.kv_heads * SMALL.head_dim, 2 * 18), dtype=np.uint8)
        write_gguf(path, SMALL, small | {"blk.0.attn_v.weight": (raw, QType.IQ4_NL)})
    elif kind == "no_tokenizer":
        write_gguf(path, SMALL, small, tokenizer=False)
    elif kind == "no_merges":
        write_gguf(path, SMALL, small, merges=False)
    elif kind == "missing_key":
        write_gguf(path, SMALL, small, omit=("block_count",))
    elif kind == "rope_freqs":
        write_gguf(path, SMALL, small | {"rope_freqs.weight": (np.full(SMALL.head_dim // 2, 3.0, np.float32), None)})
    return path


BAD = {
    "missing": "file not found",
    "truncated": "truncated or corrupt",
    "truncated_header": "truncated or corrupt",
    "magic": "not a GGUF file (it starts with b'GGML'",
    "architecture": "architecture 'gpt2' is not supported (supported: llama)",
    "tensor_type": "tensor blk.0.attn_v.weight has type IQ4_NL, which is not supported",
    "no_tokenizer": "tokenizer.ggml.tokens is missing",
    "no_merges": "without tokenizer.ggml.merges",
    "missing_key": "metadata key llama.block_count is missing",
    "rope_freqs": "rope_freqs.weight is not Llama 3 rope scaling",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_is_one_line_error(kind, files, tmp_path):
    path = _bad_file(kind, files("f32")[0], tmp_path)
    with pytest.raises(EagleError) as info:
        read_gguf(path)
    message = str(info.value)
    assert BAD[kind] in message and str(path) in message and "\n" not in message, message
    with pytest.raises(EagleError, match=re.escape(BAD[kind])):
        gguf_to_hf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def _cli(*args: str, module: str = "convert.gguf_to_hf") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("kind", sorted(BAD))
def test_cli_bad_input_exits_2_with_one_error_line(kind, files, tmp_path):
    path = _bad_file(kind, files("f32")[0], tmp_path)
    out = tmp_path / "out"
    result = _cli("--gguf", str(path), "--out", str(out))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and BAD[kind] in lines[0], result.stderr
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("kind", ["truncated", "architecture", "tensor_type", "no_tokenizer"])
def test_generate_on_a_bad_gguf_exits_2_with_one_error_line(kind, files, tmp_path):
    """`infer.generate --target FILE.gguf` reads the file itself: the same one-line errors."""
    path = _bad_file(kind, files("f32")[0], tmp_path)
    result = _cli("--target", str(path), "--no-spec", "--prompt", "Hi", module="infer.generate")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and BAD[kind] in lines[0], result.stderr


def test_cli_converts_and_refuses_a_non_empty_out(files, tmp_path):
    out = tmp_path / "hf"
    result = _cli("--gguf", str(files("q8_0")[0]), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert f"to {out}" in result.stdout and "float32 from Q8_0 x16, F32 x5" in result.stdout, result.stdout
    assert (out / "model.safetensors").is_file() and not (tmp_path / ".hf.partial").exists()
    again = _cli("--gguf", str(files("q8_0")[0]), "--out", str(out))
    assert again.returncode == 2 and "already exists and is not empty" in again.stderr, again.stderr

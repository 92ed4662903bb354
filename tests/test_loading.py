"""Loading HF target directories: every file layout, weight dtypes, and one-line errors for bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from eagle_jax.errors import EagleError  # noqa: E402
from eagle_jax.io import hf, loading  # noqa: E402
from eagle_jax.io.hf import load_target_config  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.models.config import target_config_from_hf  # noqa: E402
from eagle_jax.models.params import flatten  # noqa: E402

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.08,
)
NAMES_FP32 = ("model.safetensors",)


def _llama(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(model, directory) of a 2-layer fp32 Llama saved as one model.safetensors."""
    model = _llama()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def reference_params(llama):
    return flatten(hf.load_target(llama[1])[1])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _raises_one_line(match: str, fn, *args, **kwargs) -> str:
    with pytest.raises(EagleError, match=match) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, f"error message spans lines: {message!r}"
    return message


def _assert_same(params, reference):
    flat = flatten(params)
    assert flat.keys() == reference.keys()
    for k in flat:
        np.testing.assert_array_equal(flat[k], reference[k], err_msg=k)


# ---------------------------------------------------------------- layouts


def test_single_safetensors_layout(llama, reference_params):
    model, path = llama
    assert [p.name for p in hf.weight_files(path)] == ["model.safetensors"]
    flat = reference_params
    sd = model.state_dict()
    np.testing.assert_array_equal(flat["layers.1.q"], sd["model.layers.1.self_attn.q_proj.weight"].numpy().T)
    np.testing.assert_array_equal(flat["layers.0.mlp.down"], sd["model.layers.0.mlp.down_proj.weight"].numpy().T)
    np.testing.assert_array_equal(flat["lm_head"], sd["lm_head.weight"].numpy().T)
    np.testing.assert_array_equal(flat["embed"], sd["model.embed_tokens.weight"].numpy())


def test_sharded_safetensors_index(llama, reference_params, tmp_path):
    model, _ = llama
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    files = hf.weight_files(tmp_path)
    assert len(files) > 2 and all(f.suffix == ".safetensors" for f in files)
    _assert_same(hf.load_target(tmp_path)[1], reference_params)


def test_sharded_index_with_missing_shard(llama, tmp_path):
    model, _ = llama
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = hf.weight_files(tmp_path)[1]
    shard.unlink()
    _raises_one_line(rf"{shard.name}: file not found", hf.load_target, tmp_path)


def _write_bin_dir(llama, path, state=None):
    """A transformers-4 style `.bin` directory (transformers 5 only writes safetensors)."""
    model, src = llama
    path.mkdir(exist_ok=True)
    shutil.copy(src / "config.json", path / "config.json")
    torch.save(state if state is not None else model.state_dict(), path / "pytorch_model.bin")
    return path


def test_pytorch_model_bin(llama, reference_params, tmp_path):
    path = _write_bin_dir(llama, tmp_path / "bin")
    assert [p.name for p in hf.weight_files(path)] == ["pytorch_model.bin"]
    _assert_same(hf.load_target(path)[1], reference_params)


def test_pytorch_model_bin_index(llama, reference_params, tmp_path):
    model, src = llama
    shutil.copy(src / "config.json", tmp_path / "config.json")
    state = model.state_dict()
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / shard)
        weight_map.update({k: shard for k in keys})
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len(hf.weight_files(tmp_path)) == 2
    _assert_same(hf.load_target(tmp_path)[1], reference_params)


@pytest.mark.parametrize(
    "torch_dtype,np_name,fmt",
    [
        (torch.bfloat16, "bfloat16", "safetensors"),
        (torch.float16, "float16", "safetensors"),
        (torch.bfloat16, "bfloat16", "bin"),
    ],
)
def test_half_precision_weights(llama, reference_params, tmp_path, torch_dtype, np_name, fmt):
    model, _ = llama
    half = _llama().to(torch_dtype)
    if fmt == "bin":
        path = _write_bin_dir(llama, tmp_path / "bin", half.state_dict())
    else:
        half.save_pretrained(tmp_path)
        path = tmp_path
    cfg, params = hf.load_target(path)
    flat = flatten(params)
    for k, v in flat.items():
        assert v.dtype.name == np_name, (k, v.dtype)
    # the stored values are exactly the rounded fp32 weights
    sd = half.state_dict()
    np.testing.assert_array_equal(
        flat["layers.0.q"].astype(np.float32), sd["model.layers.0.self_attn.q_proj.weight"].float().numpy().T
    )
    rel = 2.0**-8 if np_name == "bfloat16" else 2.0**-11
    for k, ref in reference_params.items():
        np.testing.assert_allclose(flat[k].astype(np.float32), ref, rtol=rel, atol=1e-6, err_msg=k)

    # an explicit dtype casts on load
    _, as32 = hf.load_target(path, dtype=np.float32)
    assert all(v.dtype == np.float32 for v in flatten(as32).values())

    # and the half-precision model still computes the fp32 model's logits, roughly
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 8)))
    positions = jnp.arange(8)[None]
    fp32_params = hf.load_target(llama[1])[1]
    ref = target.forward(fp32_params, cfg, tokens, positions, target.init_cache(cfg, 1, 8), feature_layers=())
    out = target.forward(
        jax_tree(params), cfg, tokens, positions, target.init_cache(cfg, 1, 8, jnp.dtype(np_name)), feature_layers=()
    )
    scale = float(jnp.max(jnp.abs(ref.logits)))
    assert float(jnp.max(jnp.abs(out.logits - ref.logits))) < 0.05 * scale


def jax_tree(params):
    import jax

    return jax.tree.map(jnp.asarray, params)


# ---------------------------------------------------------------- bad weight files


def _edit_safetensors(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_tensor(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    _edit_safetensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    msg = _raises_one_line(r"missing model\.layers\.1\.mlp\.up_proj\.weight", hf.load_target, path)
    assert "unexpected" not in msg and str(path) in msg


def test_unexpected_tensor(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    _edit_safetensors(path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros((2, 2), np.float32)}))
    msg = _raises_one_line(r"unexpected model\.layers\.0\.self_attn\.extra\.weight", hf.load_target, path)
    assert "missing" not in msg


def test_unexpected_layer(llama, tmp_path):
    """A checkpoint with more layers than config.json says."""
    path = _copy(llama[1], tmp_path / "m")
    _edit_safetensors(path, lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}))
    _raises_one_line(r"unexpected model\.layers\.2\.input_layernorm\.weight", hf.load_target, path)


def test_misshaped_tensor(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    _edit_safetensors(
        path, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.zeros((48, 64), np.float32)})
    )
    _raises_one_line(
        r"mis-shaped model\.layers\.1\.self_attn\.k_proj\.weight \(48, 64\) \(expected \(32, 64\)\)",
        hf.load_target,
        path,
    )


def test_config_disagreeing_with_weights(llama, tmp_path):
    """config.json saying a wider MLP than the weights: each such tensor is reported as mis-shaped, in one line."""
    path = _copy(llama[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    msg = _raises_one_line(
        r"mis-shaped model\.layers\.0\.mlp\.down_proj\.weight \(64, 96\) \(expected \(64, 128\)\)", hf.load_target, path
    )
    assert "model.layers.1.mlp.up_proj.weight (96, 64) (expected (128, 64))" in msg


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_safetensors(llama, tmp_path, keep):
    path = _copy(llama[1], tmp_path / "m")
    f = path / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(max(8, int(size * keep)))
    _raises_one_line(r"model\.safetensors: cannot read safetensors file .*truncated", hf.load_target, path)


def test_truncated_bin(llama, tmp_path):
    path = _write_bin_dir(llama, tmp_path / "bin")
    f = path / "pytorch_model.bin"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    _raises_one_line(r"pytorch_model\.bin: cannot read torch checkpoint", hf.load_target, path)


def test_a_generic_fast_tokenizer_loads_as_auto_tokenizer_does_without_importing_torch(golden_dir, tmp_path):
    from convdata import templated_tokenizer_dir

    folder = templated_tokenizer_dir(golden_dir, tmp_path / "tok")
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] in loading.GENERIC_TOKENIZERS
    code = "import sys; from eagle_jax.io import loading; loading.load_tokenizer(sys.argv[1]); "
    code += "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code, folder], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]

    ours, auto = loading.load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    msgs = [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e"}]
    text = auto.apply_chat_template(msgs, tokenize=False)
    assert ours.apply_chat_template(msgs, tokenize=False) == text
    ids = auto(text).input_ids
    assert ours(text).input_ids == ids and ours.decode(ids) == auto.decode(ids)
    specials = lambda tok: (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)  # noqa: E731
    assert specials(ours) == specials(auto)


def test_missing_directory(tmp_path):
    _raises_one_line(r"nope: directory not found", hf.load_target, tmp_path / "nope")


def test_missing_config(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    (path / "config.json").unlink()
    _raises_one_line(r"config\.json: file not found", hf.load_target, path)


def test_no_weights(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    (path / "model.safetensors").unlink()
    _raises_one_line(r"no weights found", hf.load_target, path)


def test_bad_config_json(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    (path / "config.json").write_text("{not json")
    _raises_one_line(r"config\.json: not valid JSON", hf.load_target, path)


# ---------------------------------------------------------------- unsupported configs


def _hf_dict(**overrides):
    base = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"),
            r"architectures=\['GPT2LMHeadModel'\] is not supported",
        ),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling\.rope_type='yarn' is not supported"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), r"rope_parameters\.rope_type='longrope'"),
        (dict(rope_scaling={"type": "su"}), r"rope_scaling\.rope_type='su'"),
        (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5 is not supported"),
        (dict(mlp_bias=True), r"mlp_bias=true is not supported"),
        (
            dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True, sliding_window=32),
            r"use_sliding_window=true is not supported",
        ),
        (
            dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=True, sliding_window=32),
            r"use_sliding_window=true is not supported",
        ),
    ],
)
def test_unsupported_config(overrides, match):
    _raises_one_line(match, target_config_from_hf, _hf_dict(**overrides))


def test_unsupported_config_from_directory(llama, tmp_path):
    path = _copy(llama[1], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(cfg))
    _raises_one_line(r"hidden_act='gelu'", hf.load_target, path)


def test_supported_rope_fields_are_read():
    cfg = target_config_from_hf(_hf_dict(rope_scaling={"type": "linear", "factor": 2.0}))
    assert (cfg.rope.rope_type, cfg.rope.factor) == ("linear", 2.0)
    cfg = target_config_from_hf(
        _hf_dict(
            rope_theta=None,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
    )
    assert (cfg.rope.theta, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == (5e5, 8.0, 32)
    cfg = target_config_from_hf(
        _hf_dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=4096)
    )
    assert cfg.sliding_window is None  # Qwen2.5 ships sliding_window with use_sliding_window false


# ---------------------------------------------------------------- Mistral sliding window


def test_mistral_sliding_window_capacity(tmp_path):
    window = 16
    torch.manual_seed(0)
    config = transformers.MistralConfig(**SMALL, sliding_window=window)
    config._attn_implementation = "eager"
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    cfg, params = hf.load_target(tmp_path)
    assert cfg.sliding_window == window

    target.check_capacity(cfg, window)  # exact up to the window
    msg = _raises_one_line(r"cache capacity 17 exceeds sliding_window=16", target.check_capacity, cfg, window + 1)
    assert "not implemented" in msg
    _raises_one_line(r"sliding_window=16", target.init_cache, cfg, 1, 64)
    no_window = load_target_config(tmp_path).__class__(**{**cfg.__dict__, "sliding_window": None})
    target.check_capacity(no_window, 10**6)

    # why: up to the window the full-attention model equals HF's sliding one; beyond it, it does not
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2 * window))
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens)).logits.numpy()
    big = cfg.__class__(**{**cfg.__dict__, "sliding_window": None})
    out = target.forward(
        params,
        big,
        jnp.asarray(tokens),
        jnp.arange(2 * window)[None],
        target.init_cache(big, 1, 2 * window),
        feature_layers=(),
    )
    diff = np.abs(np.asarray(out.logits) - ref).max(axis=-1)[0]
    scale = np.abs(ref).max()
    assert diff[:window].max() <= 1e-4 * scale
    assert diff[window] > 1e-3 * scale  # position 16 no longer sees key 0 in HF (i - j < W)

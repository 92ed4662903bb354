"""Logit parity with the transformers PyTorch models, for every supported target family.

Each case builds a tiny random HF model (fp32, fixed torch seed), perturbs every norm weight and bias
away from its 1/0 initialisation (so a dropped norm or bias shows up), saves it with `save_pretrained`
(safetensors), loads it with `hf.load_target` and compares

- the logits: max |ours - HF| <= 1e-4 * max |HF|,
- the final normed hidden state: HF `output_hidden_states[-1]`, which in transformers is the output of
  the final norm (equal to `last_hidden_state`; checked below),
- the EAGLE-3 features: HF `output_hidden_states[i]` for the feature layers i, i.e. the inputs of
  decoder layer i (index 0 is the embedding output).

Dynamic NTK rope: transformers recomputes `inv_freq` in every forward from `seq_len = max(position_ids) + 1`
over the whole batch, with `base * (factor * seq_len / max_pos - (factor - 1)) ** (d / (d - 2))` once
`seq_len > max_position_embeddings`, and the unscaled frequencies below that. Our `forward` is a pure
function of the same quantity (the largest position in the call). The HF module additionally keeps the
largest `seq_len` it has seen and does not shrink `inv_freq` until a call is again below
`max_position_embeddings`; a fresh HF model, as used here, has seen nothing, so one forward of each
model is compared.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402

from eagle_jax.errors import EagleError  # noqa: E402
from eagle_jax.io import hf  # noqa: E402
from eagle_jax.io.hf import load_target_config  # noqa: E402
from eagle_jax.models import target  # noqa: E402
from eagle_jax.models.config import default_eagle3_layers  # noqa: E402
from eagle_jax.models.params import flatten  # noqa: E402

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _cfg(cls_name: str, **overrides):
    return getattr(transformers, cls_name)(**{**BASE, **overrides})


# name -> (model class, config class, config overrides, sequence length, feature layers or None for the rule)
CASES = {
    "llama_mha": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=4), 12, None),
    "llama_gqa": ("LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=1), 12, None),
    "llama_rope_llama3": (
        "LlamaForCausalLM",
        "LlamaConfig",
        # head_dim 16, theta 1e4: wavelengths 6..2e4 cover the high, smoothed and low-frequency bands
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            )
        ),
        40,
        None,
    ),
    "llama_rope_linear": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
        20,
        None,
    ),
    "llama_rope_dynamic_short": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(max_position_embeddings=32, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
        20,
        None,
    ),
    "llama_rope_dynamic_long": (  # positions up to 55 > max_position_embeddings = 32: the base is rescaled
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(max_position_embeddings=32, rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)),
        56,
        None,
    ),
    "llama_tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True, num_hidden_layers=3), 12, (0, 2)),
    "llama_attention_bias": ("LlamaForCausalLM", "LlamaConfig", dict(attention_bias=True), 12, None),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(use_sliding_window=False), 12, None),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=24, use_sliding_window=False), 12, None),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=None), 12, None),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, num_hidden_layers=3),
        12,
        (1, 2),
    ),
}


def build_hf(name: str, seed: int = 0):
    """A tiny random HF model with every norm weight and bias perturbed, in eval mode, eager attention."""
    model_cls, config_cls, overrides, _, _ = CASES[name]
    torch.manual_seed(seed)
    config = _cfg(config_cls, **overrides)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif pname.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):  # the Mixtral router (Llama's is gate_proj)
                p.mul_(10.0)  # router: spread the expert probabilities so top-2 is not a near tie
    return model


def hf_outputs(model, tokens: np.ndarray):
    with torch.no_grad():
        out = model(torch.from_numpy(tokens), output_hidden_states=True)
        last = model.model(torch.from_numpy(tokens)).last_hidden_state
    hidden_states = [h.numpy() for h in out.hidden_states]
    # transformers' last entry of hidden_states is the final-norm output (what EAGLE-1 calls the feature)
    np.testing.assert_array_equal(hidden_states[-1], last.numpy())
    return out.logits.numpy(), hidden_states


def ours(cfg, params, tokens: np.ndarray, feature_layers):
    b, t = tokens.shape
    cache = target.init_cache(cfg, b, t)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = target.forward(params, cfg, jnp.asarray(tokens), positions, cache, feature_layers=feature_layers)
    return out


def assert_close(actual, expected, what: str, rel: float = 1e-4):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = np.max(np.abs(actual - expected))
    scale = np.max(np.abs(expected))
    assert err <= rel * scale, f"{what}: max abs diff {err:.3g} > {rel} * max |ref| {scale:.3g}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (HF model, directory it was saved to), built lazily once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_hf(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            cache[name] = (model, path)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_hidden_features_match_transformers(name, saved):
    model, path = saved(name)
    _, _, _, seq_len, feature_layers = CASES[name]
    cfg, params = hf.load_target(path)
    feature_layers = feature_layers if feature_layers is not None else default_eagle3_layers(cfg.num_layers)
    assert cfg.num_layers == model.config.num_hidden_layers
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, seq_len))
    ref_logits, ref_hidden = hf_outputs(model, tokens)
    out = ours(cfg, params, tokens, feature_layers)

    assert_close(out.logits, ref_logits, f"{name} logits")
    assert_close(out.hidden, ref_hidden[-1], f"{name} final normed hidden")
    layers = feature_layers
    assert len(set(layers)) == len(layers) >= 2
    ref_features = np.concatenate([ref_hidden[i] for i in layers], axis=-1)
    assert_close(out.features, ref_features, f"{name} features of layers {layers}")


def test_parsed_configs(saved):
    """The loaded configs carry the features each case is meant to exercise."""
    expect = {
        "llama_mha": dict(num_kv_heads=4, family="llama"),
        "llama_gqa": dict(num_kv_heads=1),
        "llama_tied": dict(tie_word_embeddings=True),
        "llama_attention_bias": dict(qkv_bias=True, o_bias=True),
        "qwen2": dict(family="qwen2", qkv_bias=True, o_bias=False),
        "qwen3": dict(family="qwen3", qk_norm=True, head_dim=24),
        "mistral": dict(family="mistral", sliding_window=None),
        "mixtral": dict(family="mixtral", num_experts=4, experts_per_token=2),
    }
    for name, fields in expect.items():
        cfg = load_target_config(saved(name)[1])
        for field, value in fields.items():
            assert getattr(cfg, field) == value, (name, field)
    for name, rope_type in [
        ("llama_rope_llama3", "llama3"),
        ("llama_rope_linear", "linear"),
        ("llama_rope_dynamic_long", "dynamic"),
    ]:
        assert load_target_config(saved(name)[1]).rope.rope_type == rope_type
    # the dynamic case really runs past max_position_embeddings, where the base is rescaled
    cfg = load_target_config(saved("llama_rope_dynamic_long")[1])
    assert CASES["llama_rope_dynamic_long"][3] > cfg.rope.max_position_embeddings


def test_qwen3_head_dim_differs_from_hidden_over_heads(saved):
    cfg = load_target_config(saved("qwen3")[1])
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size


def _mixtral_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def test_mixtral_both_expert_layouts(saved, tmp_path):
    """The published per-expert layout (what save_pretrained writes) and the fused transformers-5
    in-memory layout (a raw state_dict dump) load to the same parameters."""
    from safetensors.numpy import save_file

    model, path = saved("mixtral")
    on_disk = set(hf.read_tensors(path))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in on_disk
    assert "model.layers.0.block_sparse_moe.gate.weight" in on_disk
    cfg, per_expert = hf.load_target(path)

    state = _mixtral_state(model)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((path / "config.json").read_text())
    save_file(state, str(fused_dir / "model.safetensors"))
    cfg2, fused = hf.load_target(fused_dir)
    assert cfg2 == cfg
    flat_a, flat_b = flatten(per_expert), flatten(fused)
    assert flat_a.keys() == flat_b.keys()
    for k in flat_a:
        np.testing.assert_array_equal(flat_a[k], flat_b[k], err_msg=k)

    # a fused checkpoint missing one tensor is reported by its fused name
    del state["model.layers.1.mlp.experts.down_proj"]
    save_file(state, str(fused_dir / "model.safetensors"))
    with pytest.raises(EagleError, match=r"missing model\.layers\.1\.mlp\.experts\.down_proj"):
        hf.load_target(fused_dir)

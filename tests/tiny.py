"""Tiny random targets and draft heads for tests (no files, no downloads)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN
from eagle_jax.models import draft, target
from eagle_jax.models.config import RopeConfig, TargetConfig
from eagle_jax.models.draft import DraftConfig
from eagle_jax.models.params import init_params

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "mixtral")


def tiny_target_config(
    family: str = "llama",
    vocab: int = 64,
    layers: int = 8,
    tied: bool = False,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    eos: tuple[int, ...] = (),
) -> TargetConfig:
    return TargetConfig(
        family=family,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads if family != "qwen3" else 16,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        tie_word_embeddings=tied,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        num_experts=4 if family == "mixtral" else 0,
        experts_per_token=2 if family == "mixtral" else 0,
        eos_token_ids=eos,
        pad_token_id=0,
    )


def random_params(specs: dict, seed: int, scale: float = 0.3) -> dict:
    """Random parameters with a larger scale than training init, so argmaxes are well separated."""
    params = init_params(specs, jax.random.key(seed))

    def rescale(x):
        return x * (scale / 0.02) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2 else x

    return jax.tree.map(rescale, params)


def tiny_target(family: str = "llama", seed: int = 0, **kw) -> tuple[TargetConfig, dict]:
    cfg = tiny_target_config(family, **kw)
    return cfg, random_params(target.param_specs(cfg), seed)


def tiny_draft(
    kind: str, tcfg: TargetConfig, seed: int = 1, draft_vocab: int | None = None
) -> tuple[DraftConfig, dict]:
    """A random head fitting `tcfg`; EAGLE-3 with a vocabulary map when draft_vocab < vocab."""
    vd = draft_vocab or tcfg.vocab_size
    cfg = DraftConfig(
        kind=kind,
        hidden_size=tcfg.hidden_size,
        intermediate_size=2 * tcfg.hidden_size,
        num_layers=1,
        num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.hidden_size // tcfg.num_heads,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0),
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=vd if kind == "eagle3" else tcfg.vocab_size,
        target_hidden_size=tcfg.hidden_size,
        fc_bias=kind == "eagle1",
    )
    params = random_params(draft.param_specs(cfg), seed)
    if cfg.has_vocab_map:
        used = np.sort(np.random.default_rng(seed).choice(tcfg.vocab_size, vd, replace=False))
        params["d2t"] = jnp.asarray(used - np.arange(vd), jnp.int32)
        params["t2d"] = jnp.asarray(np.isin(np.arange(tcfg.vocab_size), used))
    return cfg, params


def with_eos(cfg: TargetConfig, eos: tuple[int, ...]) -> TargetConfig:
    return dataclasses.replace(cfg, eos_token_ids=eos)


def plain_generate(
    params: dict,
    cfg: TargetConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    **kw,
):
    """Plain decoding: the engine with `tree.PLAIN` and no head (`generation.generate`'s seed and capacity)."""
    return generation.generate(
        params, None, prompts, max_new_tokens, speculative.DecodeConfig(cfg, None, PLAIN, sampling), **kw
    )


def target_logprobs(params: dict, cfg: TargetConfig, prompt: list[int], tokens: list[int], k: int):
    """Raw logprobs of `tokens` following `prompt` from one causal forward of the whole sequence: the chosen ones [T]
    and the top-k ids and logprobs [T, k] (numpy)."""
    seq = jnp.asarray([prompt + tokens], jnp.int32)
    n = seq.shape[1]
    cache = target.init_cache(cfg, 1, n, jnp.float32)
    logits = target.forward(params, cfg, seq, jnp.arange(n)[None], cache).logits[0]
    logp = jax.nn.log_softmax(logits[len(prompt) - 1 : n - 1], axis=-1)  # [T, V]: the distribution of each token
    top, ids = jax.lax.top_k(logp, k)
    chosen = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, None], axis=1)[:, 0]
    return np.asarray(chosen), np.asarray(ids), np.asarray(top)

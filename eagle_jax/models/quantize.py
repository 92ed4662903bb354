"""Weight-only int8 targets, through qwix (Google's JAX quantisation library).

`TargetConfig.quantize = "int8"`: every decoder layer's projections (q, k, v, o, gate, up, down) and an untied
lm_head are `qwix.QArray`s, int8 values with one scale per output channel (absmax), in the target's floating
dtype; the embedding (read by row), the norms, biases and a tied readout stay as they are, and so does the head.
`layers.linear` dequantises a weight where the product reads it: XLA fuses that into the matmul, so a decode step
reads half of bf16's bytes for those weights. Plain decoding and speculation run the same quantised model, so
speculation stays lossless against it, and a head trained on the float target drafts for it unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import qwix

from eagle_jax.errors import EagleError
from eagle_jax.models.config import TargetConfig
from eagle_jax.models.params import ParamSpec

METHODS = ("int8",)
ATTENTION, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")  # weights [in, out]


def check(cfg: TargetConfig, method: str) -> None:
    """Refuse a method this project does not quantise with, or a target it does not quantise."""
    if method not in METHODS:
        raise EagleError(f"{method!r} is not a method here; choose from {', '.join(METHODS)}", "quantize")
    if cfg.is_moe:
        raise EagleError(f"{method} covers dense targets only; this target has experts: leave it out", "quantize")


def map_weights(fn: Callable[[Any], Any], tree: dict) -> dict:
    """`tree` (a target's parameters or their specs) with `fn` applied to the weights int8 covers."""

    def layer(p: dict) -> dict:
        mlp = {**p["mlp"], **{n: fn(p["mlp"][n]) for n in MLP}}
        return {**p, **{n: fn(p[n]) for n in ATTENTION}, "mlp": mlp}

    out = {**tree, "layers": [layer(p) for p in tree["layers"]]}
    if "lm_head" in out:
        out["lm_head"] = fn(out["lm_head"])
    return out


def spec(s: ParamSpec) -> qwix.QArray:
    """A weight [in, out]'s quantised spec: int8 values [in, out] and scales [1, out] sharded like its columns."""
    scale = ParamSpec((1, s.shape[1]), (None, s.axes[1]), s.dtype, "ones")
    return qwix.QArray(qvalue=ParamSpec(s.shape, s.axes, jnp.int8), scale=scale, qtype=jnp.int8)


@jax.jit
def weight(w: jax.Array) -> qwix.QArray:
    """w [in, out] as int8 with one absmax scale per output column, in w's dtype (computed in float32: qwix
    quantises float16 input to zeros with unit scales)."""
    return qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=(1,), scale_dtype=w.dtype)


def quantized_config(cfg: TargetConfig, method: str) -> TargetConfig:
    """A float target's config with its weights quantised by `method` (checked)."""
    check(cfg, method)
    return dataclasses.replace(cfg, quantize=method)


def quantize_target(cfg: TargetConfig, params: dict, method: str) -> tuple[TargetConfig, dict]:
    """A float target's (config, parameters) quantised by `method` (weight by weight, on their devices)."""
    return quantized_config(cfg, method), map_weights(weight, params)

"""Mixtral experts: only the routed experts run, and every path equals the dense weighted sum."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.models import layers

E, K, H, I = 8, 2, 16, 24


def _params(seed: int, experts: int = E) -> dict:
    keys = jax.random.split(jax.random.key(seed), 4)
    return {
        "router": jax.random.normal(keys[0], (H, experts)),
        "gate": jax.random.normal(keys[1], (experts, H, I)) * 0.3,
        "up": jax.random.normal(keys[2], (experts, H, I)) * 0.3,
        "down": jax.random.normal(keys[3], (experts, I, H)) * 0.3,
    }


def _routed(path, x, p, k=K):
    xs = x.reshape(-1, x.shape[-1])
    top_p, top_i = layers.route(xs, p["router"], k)
    return path(xs, top_p, top_i, p).reshape(x.shape)


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 1), (1, 60), (8, 7)])
@pytest.mark.parametrize("seed", [0, 1])
def test_routed_equals_dense(shape, seed):
    p = _params(seed)
    x = jax.random.normal(jax.random.key(100 + seed), (*shape, H))
    dense = np.asarray(layers.moe_dense(x, p, K))
    np.testing.assert_allclose(np.asarray(jax.jit(layers.sparse_moe, static_argnums=2)(x, p, K)), dense, atol=1e-5)
    # the routed path on every shape (sparse_moe takes it for N * k < E only)
    np.testing.assert_allclose(np.asarray(_routed(layers._moe_switched, x, p)), dense, atol=1e-5)


def test_routed_catches_a_wrong_expert(monkeypatch):
    """A routed path that runs the neighbouring expert differs from the dense sum (the test above can fail)."""
    p = _params(0)
    x = jax.random.normal(jax.random.key(7), (1, 1, H))
    real = layers._expert
    monkeypatch.setattr(layers, "_expert", lambda v, p, e: real(v, p, (e + 1) % E))
    wrong = np.asarray(_routed(layers._moe_switched, x, p))
    assert np.abs(wrong - np.asarray(layers.moe_dense(x, p, K))).max() > 1e-2


def _cost(f, *args) -> dict:
    return jax.jit(f).lower(*args).compile().cost_analysis()


def test_decode_runs_only_the_routed_experts():
    """One token: the compiled step does k/E of the dense flops and reads about k/E of the expert bytes."""
    p = _params(0)
    x = jnp.ones((1, 1, H))
    dense = _cost(functools.partial(layers.moe_dense, experts_per_token=K), x, p)
    routed = _cost(functools.partial(layers.sparse_moe, experts_per_token=K), x, p)
    assert routed["flops"] < dense["flops"] * (K / E) * 1.2
    expert_bytes = 3 * E * H * I * 4
    assert routed["bytes accessed"] < dense["bytes accessed"] - expert_bytes / 2

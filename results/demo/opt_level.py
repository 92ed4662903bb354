"""Warm-up seconds and plain-step milliseconds of SmolLM2 under the XLA_FLAGS of the environment (LLVM's
optimisation level against compile time). usage: [XLA_FLAGS=--xla_backend_optimization_level=0] \
EAGLE_JAX_COMPILE_CACHE=0 PYTHONPATH=. python results/demo/opt_level.py"""

import os
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import engine
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN
from eagle_jax.io import loading

tcfg, tparams = loading.load_target(Path.home() / ".cache/eagle-jax/smollm2", jnp.float32)
rows = engine.Engine(tparams, None, DecodeConfig(tcfg, None, PLAIN), 1, 1024)
t0 = time.perf_counter()
rows.warm_up()
warm = time.perf_counter() - t0
rows.admit(0, np.random.default_rng(0).integers(10, 1000, 100).tolist(), 200)
steps = []
for _ in range(60):
    t0 = time.perf_counter()
    rows.cycle()
    steps.append(time.perf_counter() - t0)
print(
    f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}: warm-up {warm:.1f} s for {len(rows.programs())} programs; "
    f"plain step median {np.median(steps) * 1e3:.1f} ms, min {min(steps) * 1e3:.1f} ms"
)

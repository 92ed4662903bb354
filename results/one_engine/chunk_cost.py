"""One prefill call per chunk size on a target: its time against the positions it computes (what
`engine.CALL_COST` weighs). usage: PYTHONPATH=. python results/one_engine/chunk_cost.py TARGET"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding import engine
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN
from eagle_jax.io import loading

SIZES, ROUNDS = (512, 256, 128, 64, 32, 16), 5

tcfg, tparams = loading.load_target(sys.argv[1], jnp.float32)
rows = engine.Engine(tparams, None, DecodeConfig(tcfg, None, PLAIN), 1, 2048, SIZES)
rows.warm_up()
rng = np.random.default_rng(0)
for size in SIZES:
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        rows.admit(0, rng.integers(10, 1000, size).tolist(), 1)  # a fresh prompt of exactly one chunk
        jax.block_until_ready(rows.state)
        times.append(time.perf_counter() - t0)
        rows.cancel([0])
    print(f"chunk {size:>3}: min {min(times) * 1e3:.1f} ms, median {np.median(times) * 1e3:.1f} ms", flush=True)

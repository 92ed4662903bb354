"""What a `ctx7` cycle costs against a plain step when it finds no candidate, on one target (default SmolLM2).

    python results/context/no_match.py [--target DIR] [--cycles 150] [--capacity 1024]

Two greedy answers to the same question advance cycle by cycle in lockstep, one with plain decoding and one
with `ctx7` (the jitted `speculative.cycle`, attention span fixed), so that each ctx7 cycle is timed right
after a plain step: on a shared machine only such paired ratios mean anything. Prints the median plain step, and
the median paired ratio of the ctx7 cycles that found no candidate (their tree holds the root alone) and of
those that found some.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from cli import demo
from eagle_jax.decoding import context, speculative
from eagle_jax.decoding.tree import PLAIN, NoDraft
from eagle_jax.io import loading

PROMPT = "What are some tips for writing a good resume?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=str(demo.smol_target()))
    p.add_argument("--cycles", type=int, default=150)
    p.add_argument("--capacity", type=int, default=1024)
    a = p.parse_args()
    tcfg, tparams = loading.load_target(a.target)
    tok = loading.load_tokenizer(a.target)
    prompt = loading.encode_chat(tok, [{"role": "user", "content": PROMPT}], True)
    cfgs = [speculative.DecodeConfig(tcfg, None, t) for t in (PLAIN, NoDraft(7, 2))]
    states = [speculative.init_state(tparams, None, [prompt], a.capacity // 2, c, 0, a.capacity) for c in cfgs]
    step, ratio, found = [], [], []
    for i in range(a.cycles + 2):  # the first two compile
        seconds = []
        for j, cfg in enumerate(cfgs):
            t0 = time.perf_counter()
            states[j], tr = speculative.cycle(tparams, None, states[j], cfg=cfg, span=a.capacity)
            jax.block_until_ready(states[j].counts)
            seconds.append(time.perf_counter() - t0)
        if i >= 2:
            step.append(seconds[0])
            ratio.append(seconds[1] / seconds[0])
            found.append(bool(np.any(np.asarray(tr.tokens)[:, 1:] != context.NO_TOKEN)))
    ratio, found = np.array(ratio), np.array(found)
    print(f"target {a.target}, span {a.capacity}, {jax.devices()[0].device_kind}, load {os.getloadavg()[0]:.1f}")
    print(f"plain step: median {1000 * np.median(step):.1f} ms over {len(step)} cycles")
    for name, sel in (("no candidate", ~found), ("candidates", found)):
        if sel.any():
            print(f"ctx7 cycle, {name}: {np.median(ratio[sel]):.2f} plain steps (median paired ratio, n={sel.sum()})")


if __name__ == "__main__":
    main()

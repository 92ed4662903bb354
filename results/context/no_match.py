"""What a `ctx7` cycle costs against a plain step when it finds no candidate, on one target (default SmolLM2).

    PYTHONPATH=. python results/context/no_match.py [--target DIR] [--cycles 150] [--capacity 1024] [--rounds 3]

Two engines (`decoding.engine`, one row each) answer the same fresh question greedily, one with plain decoding
and one with `ctx7` (context drafts, no head). First cycle by cycle in lockstep, so that each ctx7 cycle is
timed right after a plain step (on a shared machine only such paired ratios mean anything): the median paired
ratio of the ctx7 cycles that found no candidate (searched on the row's history before the cycle, untimed) and
of those that found some. Then whole answers as the demo and the benchmark run them (on-device loops), the two
modes alternating: the median of the paired ratios of their decoding times. Both engines are warmed up first.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np

from cli import demo
from eagle_jax.decoding import context, engine
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, NoDraft
from eagle_jax.io import loading

PROMPT = "What are some tips for writing a good resume?"
CTX7 = NoDraft(7, 2)


def timed(e: engine.Engine, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(seconds, tokens) of one whole answer, cycles after the admission."""
    e.admit(0, prompt, max_tokens)
    jax.block_until_ready(e.state)
    t0, tokens = time.perf_counter(), 0
    while e.live:
        tokens += sum(len(s.tokens) for s in e.cycle())
    return time.perf_counter() - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default=str(demo.smol_target()))
    p.add_argument("--cycles", type=int, default=150)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="whole answers per mode, alternating")
    a = p.parse_args()
    tcfg, tparams = loading.load_target(a.target)
    tok = loading.load_tokenizer(a.target)
    prompt = loading.encode_chat(tok, [{"role": "user", "content": PROMPT}], True)
    cfgs = [DecodeConfig(tcfg, None, t) for t in (PLAIN, CTX7)]

    steps = [engine.Engine(tparams, None, c, 1, a.capacity) for c in cfgs]  # one cycle at a time
    for e in steps:
        e.warm_up()
        e.admit(0, prompt, a.capacity // 2)
    step, ratio, found = [], [], []
    for i in range(a.cycles + 2):  # the first two run programs for the first time
        state = steps[1].state
        candidates = context.propose(state.history, state.target_cache.lengths, CTX7.context, CTX7.min_match)
        seconds = []
        for e in steps:
            t0 = time.perf_counter()
            e.cycle()
            jax.block_until_ready(e.state.counts)
            seconds.append(time.perf_counter() - t0)
        if i >= 2:
            step.append(seconds[0])
            ratio.append(seconds[1] / seconds[0])
            found.append(bool(np.asarray(candidates[1]).any()))
    ratio, found = np.array(ratio), np.array(found)
    print(f"target {a.target}, capacity {a.capacity}, {jax.devices()[0].device_kind}, load {os.getloadavg()[0]:.1f}")
    print(f"plain step: median {1000 * np.median(step):.1f} ms over {len(step)} cycles")
    for name, sel in (("no candidate", ~found), ("candidates", found)):
        if sel.any():
            print(f"ctx7 cycle, {name}: {np.median(ratio[sel]):.2f} plain steps (median paired ratio, n={sel.sum()})")

    loops = [engine.Engine(tparams, None, c, 1, a.capacity, loop=True) for c in cfgs]  # as the demo runs them
    for e in loops:
        e.warm_up()
        timed(e, prompt, a.cycles)  # every program run once
    pairs = []
    for _ in range(a.rounds):
        (plain_s, plain_n), (ctx_s, ctx_n) = (timed(e, prompt, a.cycles) for e in loops)
        pairs.append((plain_s / plain_n, ctx_s / ctx_n))
    per_token = np.array(pairs)
    print(
        f"whole answers ({a.cycles} tokens, on-device loops): plain {1000 * np.median(per_token[:, 0]):.1f} ms/token, "
        f"ctx7 takes {np.median(per_token[:, 1] / per_token[:, 0]):.2f}x plain's time per token "
        f"(median paired ratio, n={a.rounds})"
    )


if __name__ == "__main__":
    main()

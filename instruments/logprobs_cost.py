"""What recording logprobs costs a cycle: the engine without logprob buffers, with them (K alternatives) and no row
asking, and with every row asking (the device's top-K and the host's read of the rows' buffers).

    python -m instruments.logprobs_cost [--target DIR --draft DIR] [--slots 4] [--cycles 24] [--repeats 3]
        [--json OUT]

Each setting runs the same greedy answers (so the same cycles) for a speculative tree and for plain decoding, after
an untimed run of them (which compiles their programs); the engines take turns cycle by cycle, `--repeats` times.
The figures are the median ratio of a cycle's time to the same cycle's without buffers (one run, one machine).
Without --target: SmolLM2-135M and its EAGLE-3 head.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.logprobs import MAX_TOP
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree
from eagle_jax.io import loading

QUESTIONS = [
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "Give me three ideas for a birthday party.",
    "What is the capital of France and what is it known for?",
    "How does a refrigerator keep food cold?",
    "Tell me about the history of the bicycle.",
    "What are some tips for writing a good resume?",
]
SETTINGS = {
    "no buffers": (0, False),
    f"K={MAX_TOP}, none asks": (MAX_TOP, False),
    f"K={MAX_TOP}, all ask": (MAX_TOP, True),
}


def cycle_seconds(engines: dict, prompts: list[list[int]], cycles: int) -> tuple[dict, dict]:
    """Per engine (keyed by (tree, setting)), the seconds of each of `cycles` cycles of greedy answers to `prompts`
    (one row each), and its tokens: the engines take turns cycle by cycle, so a busy machine slows them alike."""
    for (_, setting), engine in engines.items():
        for slot, prompt in enumerate(prompts):
            greedy = SamplingConfig(temperature=0.0)
            engine.admit(slot, prompt, 8 * cycles, greedy, owner=slot, logprobs=SETTINGS[setting][1])
    seconds, tokens = {key: [] for key in engines}, dict.fromkeys(engines, 0)
    for _ in range(cycles):
        for key, engine in engines.items():
            t0 = time.perf_counter()
            tokens[key] += sum(len(s.tokens) for s in engine.cycle())
            seconds[key].append(time.perf_counter() - t0)
    for engine in engines.values():
        engine.cancel(engine.live)
    return seconds, tokens


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=Path("~/.cache/eagle-jax/smollm2").expanduser())
    p.add_argument("--draft", type=Path, default=Path("demo/smollm2-eagle3"))
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--cycles", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    tcfg, tparams = loading.load_target(args.target)
    dcfg, dparams = loading.load_draft(args.draft, tcfg)
    tok = loading.load_tokenizer(args.target)
    prompts = [loading.encode_chat(tok, [{"role": "user", "content": q}]) for q in QUESTIONS[: args.slots]]
    trees = {"tree 16/4/4": DynamicTree(16, 4, 4), "plain": PLAIN}
    engines = {
        (tree, setting): Engine(
            tparams,
            dparams if trees[tree].needs_head else None,
            DecodeConfig(tcfg, dcfg if trees[tree].needs_head else None, trees[tree], logprobs=k),
            args.slots,
            args.capacity,
            per_row=True,
        )
        for tree in trees
        for setting, (k, _) in SETTINGS.items()
    }
    cycle_seconds(engines, prompts, args.cycles)  # compiles the programs the measured cycles run
    seconds: dict = {key: [] for key in engines}
    for _ in range(args.repeats):
        got, tokens = cycle_seconds(engines, prompts, args.cycles)
        for key in engines:
            seconds[key] += got[key]
    rows = []
    for tree, setting in engines:
        base = np.asarray(seconds[tree, "no buffers"])
        mine = np.asarray(seconds[tree, setting])
        ms, ratio = 1000 * float(np.median(mine)), float(np.median(mine / base))  # paired: the same cycle's turn
        rows.append({"tree": tree, "setting": setting, "cycle_ms": ms, "ratio": ratio, "tokens": tokens[tree, setting]})
    report = {
        "target": str(args.target.name),
        "draft": str(args.draft),
        "device": f"{jax.devices()[0].platform} {jax.devices()[0].device_kind}",
        "slots": args.slots,
        "capacity": args.capacity,
        "cycles": args.cycles,
        "repeats": args.repeats,
        "buffer_bytes": args.slots * args.capacity * (1 + 2 * MAX_TOP) * 4,
        "rows": rows,
    }
    print("| tree | setting | median ms per cycle | median ratio to no buffers, cycle by cycle | tokens |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tree']} | {r['setting']} | {r['cycle_ms']:.2f} | {r['ratio']:.3f} | {r['tokens']} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()

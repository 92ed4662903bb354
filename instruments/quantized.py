"""An int8 target (`--quantize int8`) against its float32 self: quality, the head's acceptance and speed, measured.

    python -m instruments.quantized --target DIR --draft DIR [--per-set 2] [--new-tokens 256] [--speed 4]
        [--tree 5/4/1] [--json results/quantize/FILE.json]

- greedy agreement: the first `--per-set` questions of each of the six question sets (first turns, in the chat
  template), decoded greedily for `--new-tokens` tokens by both; the tokens both produce before they first differ,
  and the share of positions where they agree;
- perplexity of both on held-out text: every turn of those questions, read as plain text (teacher-forced);
- speed on MT-bench's first `--speed` questions, batch 1: plain and speculative decoding (`--tree`) of both
  models, in alternating order in one process, every program warmed first; tokens/s and the head's tau.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cli import command
from cli.timing import Runner, read_questions
from eagle_jax.decoding.tree import parse_envelopes
from eagle_jax.io import files
from eagle_jax.models import target

SETS = ("mt_bench", "alpaca", "gsm8k", "humaneval", "qa", "sum")
METHOD = "int8"


def agreement(a: list[int], b: list[int]) -> tuple[int, float]:
    """(tokens before the first difference, share of equal positions over the shorter)."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return first, float(np.mean([a[i] == b[i] for i in range(n)])) if n else 1.0


def perplexity(runner: Runner, texts: list[str]) -> float:
    """exp(mean next-token NLL) of the texts, each read alone from position 0."""
    nll, count = 0.0, 0
    for text in texts:
        ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"][: runner.max_prompt_tokens]
        tokens = jnp.asarray([ids])
        cache = target.init_cache(runner.tcfg, 1, len(ids), jnp.float32)
        logits = target.forward(runner.tparams, runner.tcfg, tokens, jnp.arange(len(ids))[None], cache).logits[0]
        logp = jax.nn.log_softmax(logits[:-1], axis=-1)
        nll -= float(jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1).sum())
        count += len(ids) - 1
    return float(np.exp(nll / count))


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.quantized", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--questions", default="data/eval", help="folder of the six question sets")
    p.add_argument("--per-set", type=int, default=2, help="questions per set for agreement and perplexity")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--speed", type=int, default=4, help="MT-bench questions timed at batch 1")
    p.add_argument("--tree", default="5/4/1", help="the speculative envelope TOTAL/DEPTH/TOP_K")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    (tree,) = parse_envelopes(a.tree)
    runners = {
        name: Runner(a.target, a.draft, 0.0, a.new_tokens, 384, quantize=q)
        for name, q in (("float32", None), (METHOD, METHOD))
    }
    questions = {s: read_questions(Path(a.questions) / f"{s}.jsonl", a.per_set) for s in SETS}
    first_turn = lambda q: runners["float32"].prompt([{"role": "user", "content": q["turns"][0]}])  # noqa: E731
    prompts = {s: [first_turn(q) for q in qs] for s, qs in questions.items()}
    report: dict = {"target": command.shown_path(a.target), "draft": command.shown_path(a.draft), "tree": a.tree}

    answers = {name: {} for name in runners}
    for name, runner in tqdm(runners.items(), desc="greedy answers", file=sys.stderr):
        for s, batch in prompts.items():
            runner.warm(batch)
            answers[name][s] = runner.plain(batch)["tokens"]
    report["agreement"] = {}
    for s in SETS:
        pairs = [agreement(x, y) for x, y in zip(answers["float32"][s], answers[METHOD][s])]
        report["agreement"][s] = {"first_difference": [f for f, _ in pairs], "equal_share": [e for _, e in pairs]}
    texts = [t for qs in questions.values() for q in qs for t in q["turns"]]
    report["perplexity"] = {name: perplexity(r, texts) for name, r in runners.items()}

    speed = [first_turn(q) for q in read_questions(Path(a.questions) / "mt_bench.jsonl", a.speed)]
    for r in runners.values():
        r.set_tree(tree)
        for prompt in speed:
            r.warm([prompt])
    timed = {name: {"plain": [0.0, 0], "speculative": [0.0, 0], "accepted": [0, 0]} for name in runners}
    for prompt in tqdm(speed, desc="speed", file=sys.stderr):
        for name, r in runners.items():  # alternating: float32, int8 for each prompt
            for mode in ("plain", "speculative"):
                out = getattr(r, mode)([prompt])
                timed[name][mode][0] += out["decode_s"]
                timed[name][mode][1] += len(out["tokens"][0])
                if mode == "speculative":
                    timed[name]["accepted"][0] += sum(out["accept_lengths"][0]) + len(out["accept_lengths"][0])
                    timed[name]["accepted"][1] += len(out["accept_lengths"][0])
    report["speed"] = {
        name: {
            "plain_tokens_per_s": t["plain"][1] / t["plain"][0],
            "speculative_tokens_per_s": t["speculative"][1] / t["speculative"][0],
            "tau": t["accepted"][0] / t["accepted"][1],
        }
        for name, t in timed.items()
    }
    firsts = [f for s in SETS for f in report["agreement"][s]["first_difference"]]
    shares = [e for s in SETS for e in report["agreement"][s]["equal_share"]]
    report["summary"] = {"mean_first_difference": float(np.mean(firsts)), "mean_equal_share": float(np.mean(shares))}
    print(
        f"greedy agreement over {a.new_tokens} tokens, {len(firsts)} questions of six sets: first difference after "
        f"{np.mean(firsts):.1f} tokens on average; {np.mean(shares):.1%} of positions equal"
    )
    print("perplexity: " + ", ".join(f"{n} {v:.3f}" for n, v in report["perplexity"].items()))
    for name, s in report["speed"].items():
        print(
            f"{name}: plain {s['plain_tokens_per_s']:.1f} tok/s, speculative ({a.tree}) "
            f"{s['speculative_tokens_per_s']:.1f} tok/s, tau {s['tau']:.2f}"
        )
    if a.json:
        files.write_json_atomic(Path(a.json), report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Pick the prompts the demo target answers for its EAGLE-3 head (input of `python -m train.regenerate`).

    python -m train.demo_prompts --out runs/demo/prompts.jsonl [--n 3000] [--max-chars 600] [--seed 0]

Takes the first user turn of mostly-ASCII ShareGPT conversations whose first user turn is at most
--max-chars characters, shuffled with --seed, and writes them as ShareGPT JSON Lines (the user turn
and the original first answer, which train.regenerate replaces with the target's own).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--max-chars", type=int, default=600)
    ap.add_argument("--min-chars", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from train.tokenizer import english_conversations, sharegpt_path

    convs = english_conversations(Path(args.data) if args.data else sharegpt_path())
    firsts = [c[:2] for c in convs if c[0]["role"] == "user" and args.min_chars <= len(c[0]["content"]) <= args.max_chars]
    random.Random(args.seed).shuffle(firsts)
    firsts = firsts[: args.n]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for i, (u, a) in enumerate(firsts):
            f.write(json.dumps({"id": f"demo-{i}", "conversations": [
                {"from": "human", "value": u["content"]}, {"from": "gpt", "value": a["content"]}]}) + "\n")
    print(f"wrote {len(firsts)} prompts to {out}")


if __name__ == "__main__":
    main()

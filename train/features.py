"""Run the frozen target once over the training conversations and store what head training reads from it.

    python -m train.features --target T --data FILE [FILE...] --out FEATS [--max-length L] [--batch-size B]
        [--shard-size N] [--dtype bf16|fp32] [--mesh data=D,fsdp=F,tensor=T] [--chat-template FILE]

Then `python -m train.eagle3 --target T --data FILE... --features FEATS ...` trains without running the
target (the same batches and, up to the storage dtype, the same losses as without --features). Running the
same command again continues after the shards already written (after a crash or kill -9 too); a folder made
with other settings, or holding files that are not a features folder, is refused. Layout and bytes per token:
`eagle_jax.training.features`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cli import command
from eagle_jax.parallel import sharding
from eagle_jax.training.features import DTYPES, FeaturesConfig, extract


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m train.features", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target: Hugging Face directory, eagle-jax store or GGUF file")
    p.add_argument("--data", required=True, nargs="+", help="ShareGPT / UltraChat files (.json, .jsonl, .parquet)")
    p.add_argument("--out", required=True, help="features folder (new or empty); an earlier one's is continued")
    p.add_argument("--max-length", type=int, default=2048, help="longer conversations are dropped (as in training)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations per target call")
    p.add_argument("--shard-size", type=int, default=256, help="conversations per shard")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="storage dtype of features")
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T to shard the target (default: one device)")
    p.add_argument("--chat-template", default=None, help="jinja chat template file (if the tokenizer has none)")
    a = p.parse_args(argv)
    with command.flag("--mesh"):
        mesh = sharding.make_mesh(a.mesh) if a.mesh else None
    resolve = command.absolute
    fc = FeaturesConfig(
        target=resolve(a.target),
        data=tuple(resolve(d) for d in a.data),
        out=resolve(a.out),
        max_length=a.max_length,
        batch_size=a.batch_size,
        shard_size=a.shard_size,
        dtype=a.dtype,
        chat_template=resolve(a.chat_template),
    )
    index = extract(fc, mesh)
    gib = index["tokens"] * index["bytes_per_token"] / 2**30
    print(
        f"{fc.out}: {index['conversations']} conversations, {index['tokens']} tokens, "
        f"{index['bytes_per_token']} bytes per token ({gib:.2f} GiB)",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

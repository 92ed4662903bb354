"""Train an EAGLE-3 draft head with training-time test (TTT) against a frozen target.

    python -m train.eagle3 --target DIR --data FILE [FILE...] --out DIR [--steps N] [--batch-size B]
        [--max-length L] [--ttt-steps 7] [--lr X] [--mesh data=D,fsdp=F,tensor=T] [--seed S]
        [--features FEATS] ...

With --features (a `python -m train.features` folder of the same target, data and maximum length) the
target's outputs are read from the folder instead of computed: the same batches, and the same losses up to
the storage dtype, without the target's decoder layers in memory (they load only for --tau-prompts).

Re-running with the same --out resumes from the newest intact checkpoint (a damaged newer one is
reported and skipped) and continues with the same batches and losses as an uninterrupted run (the flags
that define the run must repeat; --mesh, --save-every, --keep, --log-every and the tau flags may change,
--steps may be raised but not lowered). Ctrl-C or SIGTERM stops after the step under way with a
checkpoint and the head exported (exit code 130; a second one stops at once). An --out that exists,
is not empty and holds no run.json is refused: a run never writes into a folder it did not make. OUT
holds run.json (the flags), vocab_map.npz, ckpt/, metrics.jsonl, tau.jsonl (the real tau on --tau-prompts), curves.png,
head/ (the final head as an orbax store) and export/ (in the official format); see
`eagle_jax.training.trainer`. `--plan` prints the compiled memory plan of a training step instead
(as `python -m infer.plan --train`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cli import command, training
from eagle_jax.training.trainer import RunConfig


def parse_args(argv: Sequence[str] | None) -> RunConfig:
    return training.parse_args(argv, "eagle3", __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(lambda a: training.run(a, "eagle3", __doc__), argv)


if __name__ == "__main__":
    sys.exit(main())

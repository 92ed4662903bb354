"""Train an EAGLE-1 draft head with the v1 objective (feature regression) against a frozen target.

    python -m train.eagle1 --target DIR --data FILE [FILE...] --out DIR [--steps N] [--batch-size B]
        [--max-length L] [--lr 3e-5] [--mesh data=D,fsdp=F,tensor=T] [--seed S] [--no-noise]
        [--features FEATS] ...

The head (fc over [embedding, feature] with a bias, one decoder layer without its input norm, the target's
embedding and lm_head frozen) learns to predict the target's next final normed hidden state, with the v1 branch's
loss (SmoothL1 on the feature + 0.1 x cross-entropy of the target lm_head's distributions, over the assistant's
tokens), its uniform noise on the input features (--no-noise: none) and its optimiser (AdamW betas (0.9, 0.95),
weight decay 0.01, each gradient clipped to +-0.5, linear warm-up from 0 then linear decay). The head reads the
target's full vocabulary: there is no draft vocabulary and no TTT.

With --features (a `python -m train.features` folder of the same target, data and maximum length) the final
hidden states are read from the folder: no target layers in memory (they load only for --tau-prompts).

Runs behave as `train.eagle3`'s: re-running with the same --out resumes (the flags that define the run must
repeat); Ctrl-C or SIGTERM stops after the step under way with a checkpoint and the head exported (exit code
130). OUT holds run.json, ckpt/, metrics.jsonl (loss, vloss, ploss, top-1/2/3 accuracies, tokens/s), tau.jsonl,
curves.png, head/ (an orbax store) and export/ (the official EAGLE-1 format: config.json and weights, no
lm_head), which `infer.generate --draft` and the official code (`use_eagle3=False`) load.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cli import command, training
from eagle_jax.training.trainer import RunConfig


def parse_args(argv: Sequence[str] | None) -> RunConfig:
    return training.parse_args(argv, "eagle1", __doc__)


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(lambda a: training.run(a, "eagle1", __doc__), argv)


if __name__ == "__main__":
    sys.exit(main())

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

import jax

from cli import command, plan
from eagle_jax.decoding.tree import parse_envelopes
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.models.config import eagle3_head_like
from eagle_jax.parallel import sharding
from eagle_jax.training.trainer import RunConfig, RunMismatch, train


def parse_args(argv: Sequence[str] | None) -> RunConfig:
    p = command.ArgumentParser(prog="python -m train.eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--target",
        required=True,
        help="target: Hugging Face directory (weights, config, tokenizer), eagle-jax store or GGUF file",
    )
    p.add_argument("--data", required=True, nargs="+", help="ShareGPT / UltraChat files (.json, .jsonl, .parquet)")
    p.add_argument("--out", required=True, help="run directory (new or empty); reusing a run's resumes it")
    p.add_argument("--steps", type=int, default=1000, help="optimiser updates")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--max-length", type=int, default=2048, help="longer sequences are dropped")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup updates (default 5%% of --steps)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T (default: fsdp over all devices)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default min(32000, target vocab)")
    p.add_argument("--init-head", default=None, help="start from this official EAGLE-3 head directory")
    p.add_argument("--bf16", action="store_true", help="bf16 target and draft compute, fp32 master weights and loss")
    p.add_argument("--chat-template", default=None, help="jinja chat template file (if the tokenizer has none)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--tau-prompts", default=None, help="held-out prompts (JSONL with 'turns' or conversations) for the real tau"
    )
    p.add_argument("--tau-every", type=int, default=0, help="measure the real tau every K steps (needs --tau-prompts)")
    p.add_argument("--tau-max-new-tokens", type=int, default=64)
    p.add_argument("--tau-tree", default=None, help="TOTAL/DEPTH/TOP_K for the tau (default: upstream's dynamic tree)")
    p.add_argument(
        "--features",
        default=None,
        help="a python -m train.features folder made from this --target, --data and --max-length: train without "
        "running the target",
    )
    a = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_length", "ttt_steps", "grad_accum", "save_every", "keep", "log_every"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not a.lr > 0:
        raise EagleError(f"--lr must be > 0, got {a.lr}")
    if a.tau_every and not a.tau_prompts:
        raise EagleError("--tau-every needs --tau-prompts FILE")
    if a.tau_tree is not None:
        with command.flag("--tau-tree"):
            parse_envelopes(a.tau_tree)
    with command.flag("--mesh"):
        mesh = sharding.make_mesh(a.mesh or f"fsdp={jax.device_count()}")
    with command.flag("--batch-size"):
        sharding.check_dims(mesh, {"batch": a.batch_size}, "batch")
    if a.draft_vocab_size is not None:
        with command.flag("--draft-vocab-size"):
            eagle3_head_like(loading.target_config(a.target), a.draft_vocab_size)
    resolve = command.absolute
    return RunConfig(
        target=resolve(a.target),
        data=tuple(resolve(d) for d in a.data),
        out=resolve(a.out),
        steps=a.steps,
        batch_size=a.batch_size,
        max_length=a.max_length,
        ttt_steps=a.ttt_steps,
        lr=a.lr,
        warmup=a.warmup,
        grad_accum=a.grad_accum,
        mesh=a.mesh,
        seed=a.seed,
        draft_vocab_size=a.draft_vocab_size,
        init_head=resolve(a.init_head),
        bf16=a.bf16,
        chat_template=resolve(a.chat_template),
        save_every=a.save_every,
        keep=a.keep,
        log_every=a.log_every,
        tau_prompts=resolve(a.tau_prompts),
        tau_every=a.tau_every,
        tau_max_new_tokens=a.tau_max_new_tokens,
        tau_tree=a.tau_tree,
        features=resolve(a.features),
    )


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:
        return plan.main(argv)
    try:
        train(parse_args(argv))
    except RunMismatch as exc:
        shown = "; ".join(f"--{k.replace('_', '-')} {saved!r} (now {now!r})" for k, saved, now in exc.diffs)
        raise EagleError(
            f"{exc.out} holds a run started with {shown}; repeat those flags to resume or use a new --out"
        ) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

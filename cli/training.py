"""The flags of the head-training commands (`train.eagle3`, `train.eagle1`), parsed into one `RunConfig`."""

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
from eagle_jax.training.loop import RunMismatch
from eagle_jax.training.trainer import RunConfig, train

LR = {"eagle3": 5e-5, "eagle1": 3e-5}  # the official recipes' peak learning rates


def parse_args(argv: Sequence[str] | None, kind: str, doc: str) -> RunConfig:
    """The run a `train.<kind>` command line asks for (`doc`: the command's docstring); bad flags raise
    `EagleError`."""
    p = command.ArgumentParser(prog=f"python -m train.{kind}", description=doc.split("\n\n")[0])
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
    if kind == "eagle3":
        p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--lr", type=float, default=LR[kind], help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup updates (default 5%% of --steps)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T (default: fsdp over all devices)")
    p.add_argument("--seed", type=int, default=0)
    if kind == "eagle3":
        p.add_argument("--draft-vocab-size", type=int, default=None, help="default min(32000, target vocab)")
    else:
        p.add_argument("--no-noise", action="store_true", help="no uniform noise on the input features (v1 adds it)")
    p.add_argument("--init-head", default=None, help=f"start from this official {kind.upper()} head directory")
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
    counts = ("steps", "batch_size", "max_length", "ttt_steps", "grad_accum", "save_every", "keep", "log_every")
    for name in counts:
        if getattr(a, name, 1) < 1:
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
    draft_vocab_size = getattr(a, "draft_vocab_size", None)
    if draft_vocab_size is not None:
        with command.flag("--draft-vocab-size"):
            eagle3_head_like(loading.target_config(a.target), draft_vocab_size)
    resolve = command.absolute
    return RunConfig(
        target=resolve(a.target),
        data=tuple(resolve(d) for d in a.data),
        out=resolve(a.out),
        steps=a.steps,
        batch_size=a.batch_size,
        max_length=a.max_length,
        ttt_steps=getattr(a, "ttt_steps", RunConfig.ttt_steps),
        lr=a.lr,
        warmup=a.warmup,
        grad_accum=a.grad_accum,
        mesh=a.mesh,
        seed=a.seed,
        draft_vocab_size=draft_vocab_size,
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
        kind=kind,
        noise=not getattr(a, "no_noise", False),
    )


def run(argv: Sequence[str] | None, kind: str, doc: str) -> int:
    """A `train.<kind>` command: train (or resume) the run its flags describe; EAGLE-3's `--plan` prints the
    compiled memory plan of a step instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if kind == "eagle3" and "--plan" in argv:
        return plan.main(argv)
    try:
        train(parse_args(argv, kind, doc))
    except RunMismatch as exc:
        shown = "; ".join(_flag(k, saved, now) for k, saved, now in exc.diffs)
        raise EagleError(
            f"{exc.out} holds a run started with {shown}; repeat those flags to resume or use a new --out"
        ) from None
    return 0


def _flag(name: str, saved: object, now: object) -> str:
    """A resume mismatch as the command lines that differ would show it."""
    if name == "kind":
        return f"python -m train.{saved} (this is train.{now})"
    if name == "noise":
        shown = {True: "noise on", False: "--no-noise"}
        return f"{shown[saved]} (now {shown[now]})"
    return f"--{name.replace('_', '-')} {saved!r} (now {now!r})"

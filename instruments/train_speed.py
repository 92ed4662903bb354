"""Training speed with the target (online) against from stored features (offline), paired in one run.

    python -m instruments.train_speed --target T --data FILE --features FEATS [--init-head DIR] [--steps 30]
        [--rounds 2] [--baseline DIR] [--json results/train_speed/OUT.json] -- [train.eagle3 flags: --batch-size 8 ...]

Each round runs `train.eagle3` online then offline for --steps steps on the same batches (a fresh run folder
each time, the same flags), in this order, and reads tokens/s and the head's FLOP rate from its
metrics.jsonl, leaving out the first logged interval. A first, unreported round fills the persistent
compilation cache, so that the measured rounds compile nothing (each new batch length compiles a program).
`--baseline DIR`, a checkout of an earlier revision (`git worktree add DIR REV`), runs the same two trainings
with that revision's code first in each round. Printed and written: per round and mode the median tokens/s,
head GFLOP/s and fraction of the measured matmul peak, offline / online, and with a baseline each mode against
the baseline's online and offline.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import files


def one_run(args: list[str], out: Path, code: Path | None = None) -> dict:
    """One training run; `code`: the checkout whose `train.eagle3` runs (paths in `args` made absolute for it)."""
    if code is not None:
        args = [str(Path(x).resolve()) if Path(x).exists() else x for x in args]
    done = subprocess.run(
        [sys.executable, "-m", "train.eagle3", *args, "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=code,
        env=None if code is None else {**os.environ, "PYTHONPATH": str(code)},
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
    p.add_argument("--baseline", default=None, help="a checkout of an earlier revision to time first in each round")
    p.add_argument("--json", default=None)
    a = p.parse_args(own)
    baseline = Path(a.baseline).resolve() if a.baseline else None
    if baseline is not None and not (baseline / "train" / "eagle3.py").is_file():
        raise EagleError(f"--baseline {a.baseline}: not a checkout of this project (git worktree add DIR REV)")
    base = ["--target", a.target, "--data", *a.data, "--steps", str(a.steps), "--log-every", str(a.log_every), *rest]
    offline = [*base, "--features", a.features]
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(-1, a.rounds):
            runs = {}
            for code, prefix in ((baseline, "baseline_"), (None, "")) if baseline else ((None, ""),):
                runs[prefix + "online"] = one_run(base, Path(tmp) / f"{prefix}online{r}", code)
                runs[prefix + "offline"] = one_run(offline, Path(tmp) / f"{prefix}offline{r}", code)
            if r < 0:
                continue  # the warm-up round
            speed = {k: v["tokens_per_s"] for k, v in runs.items()}
            rounds.append({**runs, "ratio": speed["offline"] / speed["online"]})
            if baseline:
                rounds[-1]["ratio_to_baseline_online"] = speed["offline"] / speed["baseline_online"]
                rounds[-1]["online_to_baseline"] = speed["online"] / speed["baseline_online"]
                rounds[-1]["offline_to_baseline"] = speed["offline"] / speed["baseline_offline"]
            print(
                f"round {r + 1}: "
                + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s ({v['of_peak']:.0%} of peak)" for k, v in runs.items())
                + f"; offline / online {rounds[-1]['ratio']:.2f}x"
                + (f", / the baseline's online {rounds[-1]['ratio_to_baseline_online']:.2f}x" if baseline else ""),
                flush=True,
            )
    shown = " ".join(argv).replace(str(Path.home()), "~")  # the report is shared, this machine's folders are not
    report = {"command": f"python -m instruments.train_speed {shown}", "rounds": rounds}
    ratios = ("ratio", "ratio_to_baseline_online", "online_to_baseline", "offline_to_baseline")
    report.update({k: statistics.median(r[k] for r in rounds) for k in ratios if k in rounds[0]})
    print(f"offline / online tokens/s: {report['ratio']:.2f}x (median of {len(rounds)} rounds)")
    if baseline:
        print(
            f"against the baseline: offline / its online {report['ratio_to_baseline_online']:.2f}x, online "
            f"{report['online_to_baseline']:.2f}x, offline {report['offline_to_baseline']:.2f}x"
        )
    if a.json:
        files.write_json_atomic(Path(a.json), report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

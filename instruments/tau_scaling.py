"""Held-out tau against the training tokens a head has seen, and the tokens a log-linear fit puts at a goal.

    python -m instruments.tau_scaling \
        --curve "EAGLE-3 from scratch=demo/results/smollm2/race2h_eagle3_tau.jsonl" \
        --curve "shipped head, stage 4=demo/results/smollm2/stage4_tau.jsonl@2329945" \
        --fit-from 600000 --goal 2.0 --tokens-per-s 463 --json demo/results/smollm2/tau_scaling.json

Each --curve is NAME=FILE[@OFFSET]: a tau log (`train.eagle3 --tau-prompts`: `tokens_seen` and `tau` per line)
of a run that started from a head which had seen OFFSET tokens. Over every point at or past --fit-from tokens
(runs measured alike: same questions, chain and length) the fit is tau = a + b * log2(tokens); printed and
written: a, b (tau per doubling of the tokens), the tokens at --goal and, at --tokens-per-s, the CPU days it
takes to train them. A .png next to the JSON: the points, the fit and the goal, tokens on a log axis.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import files

PNG_TITLE = "held-out tau against training tokens seen"  # also in the PNG's metadata: how a rerun knows its own


@dataclasses.dataclass(frozen=True)
class Curve:
    name: str
    path: Path
    offset: int  # tokens the head had seen before the run


def parse_curve(spec: str) -> Curve:
    """NAME=FILE[@OFFSET] -> Curve."""
    name, sep, rest = spec.partition("=")
    path, _, offset = rest.rpartition("@") if "@" in rest else (rest, "", "0")
    if not sep or not name or not path or not offset.isdigit():
        raise EagleError(f"{spec!r}: give NAME=FILE or NAME=FILE@OFFSET (OFFSET: tokens seen before the run)", "curve")
    return Curve(name, Path(path), int(offset))


def read_points(curve: Curve) -> list[tuple[int, float]]:
    """(tokens seen in all, tau) of each line of the curve's log, in order."""
    if not curve.path.is_file():
        raise EagleError(f"{curve.path}: no such tau log", "curve")
    points = []
    for i, line in enumerate(curve.path.read_text().splitlines()):
        try:
            row = json.loads(line)
            points.append((curve.offset + int(row["tokens_seen"]), float(row["tau"])))
        except (ValueError, KeyError, TypeError):
            raise EagleError(
                f"{curve.path}: line {i + 1} is not a tau log row with tokens_seen and tau", "curve"
            ) from None
    return points


def fit(points: Sequence[tuple[int, float]], goal: float) -> dict:
    """Least-squares tau = a + b log2(tokens) over `points` [(tokens, tau)]; with the tokens at `goal` (None when
    tau does not rise with the tokens)."""
    if len({t for t, _ in points}) < 2:
        raise EagleError(f"{len(points)} points to fit: need two token counts at or past it; lower it", "fit_from")
    x = np.log2([t for t, _ in points])
    y = np.array([tau for _, tau in points])
    b, a = np.polyfit(x, y, 1)
    at_goal = 2 ** ((goal - a) / b) if b > 0 else None
    first, last = min(t for t, _ in points), max(t for t, _ in points)
    return {
        "a": float(a),
        "per_doubling": float(b),
        "points": len(points),
        "tokens": [first, last],
        "tokens_at_goal": at_goal,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, points in report["curves"].items():
        ax.plot(*zip(*[(t, tau) for t, tau in points if t > 0]), "o-", label=name)
    f, goal = report["fit"], report["goal"]
    xs = np.geomspace(f["tokens"][0], f["tokens_at_goal"] or f["tokens"][1], 50)
    ax.plot(xs, f["a"] + f["per_doubling"] * np.log2(xs), "k--", label=f"fit: +{f['per_doubling']:.3f} per doubling")
    ax.axhline(goal, color="grey", lw=0.8)
    ax.set(xscale="log", xlabel="training tokens seen", ylabel="tau", title=PNG_TITLE)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": PNG_TITLE})
    plt.close(fig)


def _main(argv: Sequence[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m instruments.tau_scaling", description=__doc__.split("\n")[0])
    p.add_argument("--curve", action="append", required=True, help="NAME=FILE[@OFFSET]")
    p.add_argument("--fit-from", type=int, default=0, help="fit the points at or past this many tokens")
    p.add_argument("--goal", type=float, default=2.0)
    p.add_argument("--tokens-per-s", type=float, help="training tokens/s for the CPU days to the goal")
    p.add_argument("--json", help="write the report here (and a .png next to it)")
    a = p.parse_args(argv)
    curves = [parse_curve(spec) for spec in a.curve]
    if a.json:
        png = Path(a.json).with_suffix(".png")
        inputs = [c.path for c in curves]
        files.check_output_file(a.json, "json", inputs, files.json_with("fit", "curves"))
        files.check_output_file(png, "json", inputs, files.holds_bytes(PNG_TITLE.encode()))
    points = {c.name: read_points(c) for c in curves}
    f = fit([pt for pts in points.values() for pt in pts if pt[0] >= max(a.fit_from, 1)], a.goal)
    days = f["tokens_at_goal"] / a.tokens_per_s / 86400 if a.tokens_per_s and f["tokens_at_goal"] else None
    report = {
        "command": shlex.join(["python", "-m", "instruments.tau_scaling", *(sys.argv[1:] if argv is None else argv)]),
        "curves": points,
        "fit_from": a.fit_from,
        "goal": a.goal,
        "fit": f,
        "tokens_per_s": a.tokens_per_s,
        "cpu_days_to_goal": days,
    }
    at_goal = (
        "never (tau does not rise)" if f["tokens_at_goal"] is None else f"{f['tokens_at_goal'] / 1e6:,.0f}M tokens"
    )
    print(f"fit over {f['points']} points: tau = {f['a']:.3f} + {f['per_doubling']:.4f} log2(tokens)")
    print(f"tau {a.goal}: {at_goal}" + (f", {days:,.1f} CPU days at {a.tokens_per_s:g} tokens/s" if days else ""))
    if a.json:
        files.write_json_atomic(a.json, report)
        plot(report, png)
        print(f"wrote {a.json} and {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

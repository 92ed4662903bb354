"""The head's chain, context candidates and both, side by side: summary.md and summary.png from the benchmark
JSONs that run.sh wrote (those present). Run from the repository root: python results/context/report.py"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

OUT = Path(__file__).parent
MODES = {"head": "head 5/4/1", "context": "context ctx7", "both": "both 5/4/1+ctx7"}
SETS = ("alpaca", "gsm8k", "humaneval", "mt_bench", "qa", "sum")


def load(name: str) -> dict | None:
    path = OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def cell(r: dict | None) -> str:
    return "-" if r is None else f"{r['tau']:.2f} / {r['speedup']:.2f}x"


def main() -> None:
    lines = ["# SmolLM2 + its head: the head's chain, context candidates, both\n\n"]
    lines.append("tau / speedup over plain decoding in the same run (greedy, 256 new tokens, mismatches in brackets)\n")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, batch in zip(axes, (1, 8)):
        runs = {mode: load(f"six_b{batch}_{mode}") for mode in MODES}
        if not any(runs.values()):
            continue
        lines.append(f"\n## batch {batch}\n\n| set | " + " | ".join(MODES.values()) + " |\n")
        lines.append("|---|" + "---|" * len(MODES) + "\n")
        for name in ("all", *SETS):
            row = []
            for run in runs.values():
                r = None if run is None else (run if name == "all" else run["files"].get(name))
                row.append(cell(r) + ("" if r is None else f" ({r['mismatches']})"))
            lines.append(f"| {name} | " + " | ".join(row) + " |\n")
        for i, (mode, run) in enumerate(runs.items()):
            if run is None:
                continue
            values = [run["speedup"], *(run["files"][s]["speedup"] for s in SETS if s in run["files"])]
            ax.bar([x + 0.27 * (i - 1) for x in range(len(values))], values, 0.27, label=MODES[mode])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(SETS) + 1))
        ax.set_xticklabels(["all", *SETS], rotation=30)
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("speedup over plain decoding")
    for name in ("long_sum_b1_context", "long_sum_b1_both", "mt_bench_all_b1_context"):
        run = load(name)
        if run is not None:
            lines.append(f"\n{name}: {cell(run)} over {run['questions']} questions ({run['mismatches']} mismatches)\n")
    fig.suptitle("SmolLM2-135M + head on a 2-core CPU: speedup by question set")
    fig.tight_layout()
    fig.savefig(OUT / "summary.png", dpi=100)
    (OUT / "summary.md").write_text("".join(lines))
    print("".join(lines))


if __name__ == "__main__":
    main()

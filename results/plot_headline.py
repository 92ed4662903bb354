"""The README's picture: speedup over plain decoding per MT-bench category and turn, from a committed benchmark JSON.

python results/plot_headline.py [results/context/mt_bench_all_b1_context.json] [results/headline.png]
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else "results/context/mt_bench_all_b1_context.json"
    out = sys.argv[2] if len(sys.argv) > 2 else "results/headline.png"
    with open(src) as f:
        d = json.load(f)
    rows = sorted(d["categories"].items(), key=lambda kv: kv[1]["speedup"])
    rows += [(f"turn {t}", v) for t, v in sorted(d["by_turn"].items())] + [("all 160 turns", d)]
    names, speed = [n for n, _ in rows], [v["speedup"] for _, v in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    colors = ["#4c72b0"] * (len(rows) - 3) + ["#dd8452"] * 2 + ["#55a868"]
    ax.barh(names, speed, color=colors)
    ax.axvline(1.0, color="black", lw=0.8)
    for i, (s, (_, v)) in enumerate(zip(speed, rows)):
        ax.text(s + 0.02, i, f"{s:.2f}x (tau {v['tau']:.2f})", va="center", fontsize=8)
    ax.set_xlim(0, max(speed) * 1.35)
    ax.set_xlabel("speedup over plain decoding (greedy, outputs identical)")
    ax.set_title(
        f"SmolLM2-135M, drafts from the context ({d['target']}, {d['device']}), MT-bench, 80 questions", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

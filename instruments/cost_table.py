"""Cost table on the machine at hand: speculative vs plain decoding of the golden pair, ours and (optionally) official.

    python -m instruments.cost_table [--target tests/golden/target --draft tests/golden/eagle3]
        [--prompts-npz tests/golden/reference.npz | --questions FILE --limit 4]
        [--envelopes 60/7/10,16/4/4,5/4/1] [--batches 1,8]
        [--max-new-tokens 64] [--repeats 3] [--official-python PY --eagle-repo DIR [--threads 1]] [--json OUT]

Greedy decoding of the golden prompts (p{i}.input_ids of reference.npz). Batch 1 decodes the prompts one at
a time; a larger batch decodes them together, repeated to fill its rows. Each batch size runs every envelope
and, above batch 1, also the one `eagle_jax.decoding.budget` chooses for it (`budget.calibrate` on the same
prompts, here; plain decoding when no envelope wins). Every program is compiled and run once
before the timings (`cli.timing.Runner`); times are medians over --repeats of the time summed over the
prompts, prefill included. Reported: spec and plain tokens/s, speedup, tau, c = (speculative loop time / cycles)
/ (plain loop time / steps) - 1, and whether the speculative outputs equal the plain ones.

With --official-python and --eagle-repo, `instruments/official_timing.py` then times the official PyTorch code on
the same prompts and envelopes (batch 1: the official code decodes one sequence) in a subprocess under that
Python, and the table adds its tokens/s, c, the ratio ours / official and whether each prompt's tokens and drafts
accepted per cycle are the official run's (batch 1).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cli import command
from cli.timing import Runner, read_questions
from eagle_jax.decoding import budget
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import DynamicTree, TreeConfig, envelope_name, parse_envelopes
from eagle_jax.errors import EagleError
from eagle_jax.io import files
from instruments import cost

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
ENVELOPES = "60/7/10,16/4/4,5/4/1"


def figures(spec: list[list[dict]], plain: list[list[dict]], speculative: bool = True) -> dict:
    """Tokens/s, speedup, tau and c from the timed runs of one setting: per repeat, one run per batch of
    prompts ({tokens, accept_lengths, seconds, decode_s, cycles}); medians over repeats of the sums over
    batches. Not `speculative`: the spec side decoded plainly too (no c)."""

    def med(runs: list[list[dict]], what: str) -> float:
        return statistics.median(sum(r[what] for r in rep) for rep in runs)

    spec_tokens = sum(sum(map(len, r["tokens"])) for r in spec[0])
    plain_tokens = sum(sum(map(len, r["tokens"])) for r in plain[0])
    cycles = sum(r["cycles"] for r in spec[0])
    steps = sum(r["cycles"] for r in plain[0])  # a plain cycle is one decode step
    spec_tps, plain_tps = spec_tokens / med(spec, "seconds"), plain_tokens / med(plain, "seconds")
    row_cycles = sum(len(a) for r in spec[0] for a in r["accept_lengths"])
    cycle_s, step_s = med(spec, "decode_s") / max(1, cycles), med(plain, "decode_s") / max(1, steps)
    return {
        "spec_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps,
        "tau": spec_tokens / max(1, row_cycles),
        "c": cost.overhead(cycle_s, step_s) if speculative else None,
        "cycle_ms": 1000 * cycle_s if speculative else None,
        "plain_step_ms": 1000 * step_s,
        "new_tokens": spec_tokens,
        "identical": all(s["tokens"] == p["tokens"] for s, p in zip(spec[0], plain[0], strict=True)),
        "per_row": [
            {"tokens": t, "accept_lengths": a} for r in spec[0] for t, a in zip(r["tokens"], r["accept_lengths"])
        ],
    }


def same_as_official(ours: list[dict], theirs: list[dict]) -> bool:
    """Whether each prompt's tokens and drafts accepted per cycle (batch 1) are the official run's: the official
    loop overshoots the token limit, ours stops at it, so ours is a prefix (its last cycle possibly cut short)."""
    for o, t in zip(ours, theirs, strict=True):
        a, b = o["accept_lengths"], t["accept_lengths"]
        if o["tokens"] != t["output_ids"][: len(o["tokens"])] or len(a) > len(b):
            return False
        if a and (a[:-1] != b[: len(a) - 1] or a[-1] > b[len(a) - 1]):
            return False
    return True


def npz_prompts(path: str) -> list[list[int]]:
    """The token ids p{i}.input_ids of a reference .npz (the golden prompts)."""
    ref = np.load(path)
    return [ref[f"p{i}.input_ids"].tolist() for i in range(len(ref.files)) if f"p{i}.input_ids" in ref.files]


def question_prompts(runner: Runner, path: Path, limit: int) -> list[list[int]]:
    """The first turns of the first `limit` questions of a JSONL file, in the target's chat template."""
    return [runner.prompt([{"role": "user", "content": q["turns"][0]}]) for q in read_questions(path, limit)]


def time_setting(runner: Runner, tree: TreeConfig, batches: list[list[list[int]]], repeats: int) -> dict:
    """Warm, then time speculative and plain generation of every batch of prompts, interleaved, `repeats` times."""
    runner.set_tree(tree)
    for rows in batches:
        runner.warm(rows)
    spec, plain = [], []
    for _ in range(repeats):
        spec.append([runner.speculative(rows) for rows in batches])
        plain.append([runner.plain(rows) for rows in batches])
    return figures(spec, plain, tree.drafts)


def run_official(args, envelopes: list[DynamicTree]) -> dict:
    """instruments/official_timing.py under the official code's Python; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "official.json"
        cmd = [
            args.official_python,
            str(REPO / "instruments" / "official_timing.py"),
            "--eagle-repo",
            args.eagle_repo,
            "--target",
            args.target,
            "--draft",
            args.draft,
            "--prompts-npz",
            args.prompts_npz,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--envelopes",
            ",".join(envelope_name(t) for t in envelopes),
            "--repeats",
            str(args.repeats),
            "--threads",
            str(args.threads),
            "--json",
            str(out),
        ]
        done = subprocess.run(cmd, cwd=REPO, stdout=sys.stderr, check=False)
        if done.returncode:
            raise EagleError(f"instruments/official_timing.py exited with {done.returncode}")
        return files.read_json(out)


def table(report: dict) -> str:
    official = any("official" in r for r in report["rows"])
    cols = ["batch", "envelope", "spec tok/s", "plain tok/s", "speedup", "tau"]
    cols += ["cycle ms", "plain step ms", "c", "identical"]
    if official:
        cols += ["official spec tok/s", "official plain tok/s", "official c", "spec ours/official", "same as official"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in report["rows"]:
        env = r["envelope"] + (" (budget)" if r.get("budget") else "")
        cells = [
            str(r["batch"]),
            env,
            f"{r['spec_tokens_per_s']:.1f}",
            f"{r['plain_tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['tau']:.2f}",
            *("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("cycle_ms", "plain_step_ms", "c")),
            "yes" if r["identical"] else "NO",
        ]
        if official:
            o = r.get("official")
            cells += (
                [
                    f"{o['spec_tokens_per_s']:.1f}",
                    f"{o['plain_tokens_per_s']:.1f}",
                    f"{o['c']:.2f}",
                    f"{r['spec_tokens_per_s'] / o['spec_tokens_per_s']:.2f}x",
                    "yes" if o["same_tokens_and_accepts"] else "NO",
                ]
                if o
                else ["-"] * 5
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(path: Path, report: dict) -> None:
    """The report as JSON and its table as Markdown next to it (.md)."""
    files.write_json_atomic(path, report)
    path.with_suffix(".md").write_text(table(report) + "\n")


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.cost_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(GOLDEN / "target"))
    p.add_argument("--draft", default=str(GOLDEN / "eagle3"))
    p.add_argument("--prompts-npz", default=str(GOLDEN / "reference.npz"))
    p.add_argument("--questions", help="first turns of these questions (JSONL) in the target's chat template instead")
    p.add_argument("--limit", type=int, default=4, help="with --questions: the first N")
    p.add_argument("--envelopes", default=ENVELOPES, help="TOTAL/DEPTH/TOP_K, comma-separated")
    p.add_argument("--batches", default="1,8", help="batch sizes, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--official-python", help="Python of the official EAGLE code's environment")
    p.add_argument("--eagle-repo", help="checkout of SafeAILab/EAGLE (with --official-python)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the official run")
    p.add_argument("--json", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    if bool(a.official_python) != bool(a.eagle_repo):
        raise EagleError("--official-python and --eagle-repo go together")
    envelopes = parse_envelopes(a.envelopes)
    with command.flag("--batches"):
        batch_sizes = [int(b) for b in a.batches.split(",")]
    runner = Runner(a.target, a.draft, 0.0, a.max_new_tokens, 1 << 20)
    prompts = question_prompts(runner, Path(a.questions), a.limit) if a.questions else npz_prompts(a.prompts_npz)
    settings: list[tuple[int, TreeConfig, bool]] = []
    for b in batch_sizes:
        settings += [(b, t, False) for t in envelopes]
        if b > 1:
            tcfg, tparams, dcfg, dparams = runner.models
            rows = [prompts[i % len(prompts)] for i in range(b)]
            measured = budget.calibrate(
                tparams, dparams, DecodeConfig(tcfg, dcfg), rows, [b], a.max_new_tokens, log=print
            )
            settings.append((b, measured.choices[b], True))
    rows = []
    for b, tree, chosen in tqdm(settings, desc="settings", unit="setting", file=sys.stderr):
        batches = [[x] for x in prompts] if b == 1 else [[prompts[i % len(prompts)] for i in range(b)]]
        rows.append(
            {
                "batch": b,
                "envelope": envelope_name(tree),
                "budget": chosen,
                **time_setting(runner, tree, batches, a.repeats),
            }
        )
    report = {
        "target": command.shown_path(a.target),
        "draft": command.shown_path(a.draft),
        "prompts": f"{command.shown_path(a.questions or a.prompts_npz)} ({len(prompts)} prompts)",
        "max_new_tokens": a.max_new_tokens,
        "repeats": a.repeats,
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    report["load_average_end"] = os.getloadavg()
    print(table(report))
    if a.json:
        write(Path(a.json), report)
    if a.official_python:
        official = run_official(a, envelopes)
        by_env = {e["envelope"]: e for e in official["envelopes"]}
        report["official"] = {k: official[k] for k in ("kind", "threads", "torch", "transformers", "repeats")}
        for r in rows:
            if r["batch"] == 1 and r["envelope"] in by_env:
                theirs = by_env[r["envelope"]]
                r["official"] = {
                    k: theirs[k]
                    for k in ("spec_tokens_per_s", "plain_tokens_per_s", "speedup", "tau", "c", "spec_matches_greedy")
                }
                r["official"]["same_tokens_and_accepts"] = same_as_official(r["per_row"], theirs["per_prompt"])
        report["load_average_end"] = os.getloadavg()
        print(table(report))
        if a.json:
            write(Path(a.json), report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

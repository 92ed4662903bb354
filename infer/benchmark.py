"""Speculative vs plain decoding of one target on benchmark questions: tau, tokens/s, speedup, c, n-alpha.

    python -m infer.benchmark --questions data/eval/mt_bench.jsonl [--limit N] [--batch B] [--temperature 0]
        [--max-new-tokens N] [--target DIR --draft DIR] [--json OUT]
        [--total-tokens N --depth D --tree-top-k K] [--context K]
        [--auto-budget [--save-budget FILE --budget-batches 1,4,8,16]]

Questions are upstream's format (one JSON object a line: question_id, category, turns[]). A multi-turn
question is answered turn by turn: each turn's prompt is the chat history (earlier user turns and the
plain decoder's answers) rendered with the tokenizer's chat template. --batch B decodes B questions'
turns together (rows of different lengths), both ways. Every batch is generated twice in the same
process, speculatively and plainly, in alternating order, after a warm-up that compiles its prompt
bucket (prefill and every attention span of its cache) outside the timings. Both use the same cache
capacity, sized as infer.generate does (prompt bucket + budget + one tree). Times include prefill.

Reported per file, per category, per turn (when questions have several) and overall: tau (tokens per
cycle), tokens/s both ways, speedup, c = (speculative cycle time) / (plain decode step time) - 1, measured
in this run, n-alpha per depth
(acceptance rate at depth n given depth n-1 was accepted), and mismatches (greedy: questions whose
speculative output differs from the plain one). Writes JSON (--json, default
runs/benchmark/<questions>.json), a Markdown table (.md) and a PNG next to it.

Without a tree the envelope is the one measured fastest on this machine for the batch size (the head's
budget.json or a cached measurement, see `cli.envelope`; plain decoding unless one wins by 5%). --auto-budget
measures plain decoding and the candidate envelopes (`eagle_jax.decoding.budget.CANDIDATES`: the head's
chains of 2-7 drafts, narrow and wide trees up to 60 / 7 / 10, context candidates alone and grafted onto
chains and trees) here, on calibration questions from the ends of the files, and uses the fastest;
--save-budget writes those measurements for --budget-batches as a budget.json. --context K adds K context
candidates (prompt lookup in the row's own tokens) to the tree the flags give, or alone: the only drafts
of `--draft context`, which needs no head.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cli import command, envelope, models, presets
from cli.timing import Runner, read_questions
from eagle_jax.decoding import acceptance, budget
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import (
    DynamicTree,
    NoDraft,
    check_fits,
    envelope_from_json,
    envelope_json,
    envelope_name,
    parse_envelopes,
)
from eagle_jax.errors import EagleError
from eagle_jax.io import files

# ---------------------------------------------------------------- statistics


def summarise(records: list[dict], timings: dict[int, dict], max_accept: int) -> dict:
    """Aggregate row records (question turns) into the reported figures. Times are per batch (`timings`, by
    batch id); a subset of a batch's rows gets the batch's time in proportion to its share of the tokens."""
    spec_tokens = sum(len(r["spec"]["tokens"]) for r in records)
    plain_tokens = sum(len(r["plain"]["tokens"]) for r in records)
    cycles = sum(len(r["spec"]["accept_lengths"]) for r in records)

    def share(side: str, what: str) -> float:
        total = 0.0
        for bid, t in timings.items():
            mine = sum(len(r[side]["tokens"]) for r in records if r["batch"] == bid)
            total += t[side][what] * mine / max(1, t[side]["tokens"])
        return total

    spec_s, plain_s = share("spec", "seconds"), share("plain", "seconds")
    batches = {r["batch"] for r in records}
    loop_cycles = sum(timings[b]["spec"]["cycles"] for b in batches)
    loop_steps = sum(timings[b]["plain"]["cycles"] for b in batches)
    cycle_s = sum(timings[b]["spec"]["decode_s"] for b in batches) / max(1, loop_cycles)
    step_s = sum(timings[b]["plain"]["decode_s"] for b in batches) / max(1, loop_steps)
    hist = acceptance.accept_histogram([a for r in records for a in r["spec"]["accept_lengths"]], max_accept)
    tps_spec = spec_tokens / spec_s if spec_s else 0.0
    tps_plain = plain_tokens / plain_s if plain_s else 0.0
    bad = {f"{r['file']}:{r['question_id']}" for r in records if r["mismatch"]}  # ids repeat across files
    return {
        "questions": len({(r["file"], r["question_id"]) for r in records}),
        "turns": len(records),
        "tau": round(spec_tokens / max(1, cycles), 4),
        "tokens_per_s_spec": round(tps_spec, 2),
        "tokens_per_s_plain": round(tps_plain, 2),
        "speedup": round(tps_spec / tps_plain, 4) if tps_plain else None,
        "c": round(cycle_s / step_s - 1, 4) if step_s else None,
        "cycle_ms": round(1000 * cycle_s, 3),
        "plain_step_ms": round(1000 * step_s, 3),
        "prefill_ms_spec": round(1000 * share("spec", "prefill_s") / max(1, len(records)), 3),
        "prefill_ms_plain": round(1000 * share("plain", "prefill_s") / max(1, len(records)), 3),
        "new_tokens_spec": spec_tokens,
        "new_tokens_plain": plain_tokens,
        "n_alpha": [None if a is None else round(a, 4) for a in acceptance.n_alpha(hist)],
        "accept_histogram": hist,
        "mismatches": len(bad),
        "mismatched_questions": sorted(bad, key=str),
    }


def markdown(report: dict) -> str:
    head = MD_HEAD + "|---|---|---|---|---|---|---|---|---|\n"

    def row(name, s):
        sp = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        c = f"{s['c']:.2f}" if s["c"] is not None else "-"
        mm = s["mismatches"] if s["mismatches"] is not None else "n/a"
        return (
            f"| {name} | {s['questions']} | {s['turns']} | {s['tau']:.2f} | {s['tokens_per_s_spec']:.1f} | "
            f"{s['tokens_per_s_plain']:.1f} | {sp} | {c} | {mm} |\n"
        )

    tree = "plain decoding" if report["tree"] is None else f"envelope {_envelope(report['tree'])}"
    lines = [
        f"# Benchmark: {report['target']} + {report['draft']}\n\n",
        f"{tree}{' (auto-budget)' if report.get('auto_budget') else ''}; batch {report['batch']}; temperature "
        f"{report['temperature']}; max_new_tokens {report['max_new_tokens']}; device {report['device']}\n\n",
        head,
        row("**all**", report),
    ]
    for name, s in report["files"].items():
        lines.append(row(name, s))
    for name, s in report["categories"].items():
        lines.append(row(f"{name} (category)", s))
    for turn, s in report.get("by_turn", {}).items() if len(report.get("by_turn", {})) > 1 else ():
        lines.append(row(f"turn {turn}", s))
    lines.append(
        "\nn-alpha (acceptance at depth n given depth n-1 accepted): "
        + ", ".join(f"{i + 1}: {a:.2f}" if a is not None else f"{i + 1}: -" for i, a in enumerate(report["n_alpha"]))
        + "\n"
    )
    lines.append(
        f"\ncycle {report['cycle_ms']:.2f} ms; plain decode step {report['plain_step_ms']:.2f} ms; "
        f"decoding alone: tau/(1+c) = {report['tau'] / (1 + report['c']):.2f}x; prefill per turn "
        f"{report['prefill_ms_spec']:.1f} ms (speculative, target + draft) / "
        f"{report['prefill_ms_plain']:.1f} ms (plain)\n"
    )
    for b, rows in (report.get("auto_budget") or {}).get("measured", {}).items():
        lines.append(f"\nauto-budget, batch {b}:\n\n| envelope | tau | tokens/s |\n|---|---|---|\n")
        for r in rows:
            lines.append(f"| {_envelope(r['tree'])} | {r['tau']:.2f} | {r['tokens_per_s']:.1f} |\n")
    return "".join(lines)


def _envelope(doc: dict | None) -> str:
    """A report's envelope by name: 5/4/1, 5/4/1+ctx7, ctx7 or plain."""
    return envelope_name(envelope_from_json(doc))


PNG_TITLE = "eagle-jax infer.benchmark"  # written into the PNG: how a rerun recognises its own plot
MD_HEAD = "| set | questions | turns | tau | spec tok/s | plain tok/s | speedup | c | mismatches |\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {"all": report, **report["files"], **{f"cat:{k}": v for k, v in report["categories"].items()}}
    names = list(groups)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [g["tokens_per_s_spec"] for g in groups.values()], 0.4, label="speculative")
    axes[0].bar(x + 0.2, [g["tokens_per_s_plain"] for g in groups.values()], 0.4, label="plain")
    axes[0].set_ylabel("tokens/s")
    axes[0].legend()
    axes[1].bar(x - 0.2, [g["tau"] for g in groups.values()], 0.4, label="tau")
    axes[1].bar(x + 0.2, [g["speedup"] or 0 for g in groups.values()], 0.4, label="speedup")
    axes[1].legend()
    for ax in axes[:2]:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    na = [a if a is not None else np.nan for a in report["n_alpha"]]
    axes[2].plot(np.arange(1, len(na) + 1), na, marker="o")
    axes[2].set_xlabel("depth n")
    axes[2].set_ylabel("n-alpha")
    axes[2].set_ylim(0, 1)
    tree = _envelope(report["tree"])
    fig.suptitle(
        f"tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x, c {report['c']:.2f} ({tree}, batch "
        f"{report['batch']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Title": PNG_TITLE})
    plt.close(fig)


# ---------------------------------------------------------------- main


def calibration_questions(files_: list[Path], n: int) -> list[dict]:
    """n questions for --auto-budget, taken round-robin from the ends of the files, so that with --limit they
    are not the measured ones (unless a file has no others)."""
    tails = [read_questions(f, None)[::-1] for f in files_]
    return [t[i] for i in range(max(map(len, tails))) for t in tails if i < len(t)][:n]


def choose_tree(runner: Runner, args, files_: list[Path], log) -> tuple[budget.Envelope, dict | None]:
    """The envelope: the flags', or measured here (--auto-budget), or the machine's budget; with what
    --auto-budget measured."""
    if args.total_tokens is not None:
        return DynamicTree(args.total_tokens, args.depth, args.tree_top_k, args.context or 0), None
    if args.context is not None and not args.auto_budget:
        return NoDraft(args.context), None

    def calibration() -> list[list[int]]:
        questions = calibration_questions(files_, args.calibration_prompts)
        return [runner.prompt([{"role": "user", "content": q["turns"][0]}]) for q in questions]

    if not args.auto_budget:
        return envelope.default_tree(runner.models, runner.paths, args.batch, calibration, log=log), None
    batches = sorted({args.batch, *(args.budget_batches if args.save_budget else ())})
    measured = budget.calibrate(
        runner.tparams,
        runner.dparams,
        DecodeConfig(runner.tcfg, runner.dcfg),
        calibration(),
        batches,
        min(128, args.max_new_tokens),
        args.budget_candidates,
        log=log,
    )
    if args.save_budget:
        files.write_json_atomic(Path(args.save_budget), measured.to_json())
        log(f"wrote {args.save_budget}")
    return measured.choices[args.batch], measured.to_json()


def run_benchmark(args, log=print) -> dict:
    files_ = [Path(q) for q in args.questions]
    sets = {f.stem: read_questions(f, args.limit) for f in files_}
    runner = Runner(
        args.target,
        None if args.draft == presets.CONTEXT_DRAFT else args.draft,
        args.temperature,
        args.max_new_tokens,
        args.max_prompt_tokens,
        args.chat_template,
        args.seed,
        args.quantize,
    )
    assert runner.tokenizer.chat_template  # questions are chat prompts: fail now if there is no template
    tree, auto = choose_tree(runner, args, files_, log)
    if runner.dcfg is not None:
        check_fits(tree, runner.dcfg.draft_vocab_size)
    runner.set_tree(tree)
    chosen = envelope_name(tree) if tree.drafts else "plain decoding (no envelope wins here)"
    log(f"envelope for batch {args.batch}: {chosen}")
    max_accept = tree.max_accept
    greedy = runner.sampling.greedy
    records: list[dict] = []
    timings: dict[int, dict] = {}
    questions = [(name, q) for name, qs in sets.items() for q in qs]
    for constraint in dict.fromkeys(q["constraint"] for _, q in questions if q["constraint"]):
        runner.grammars.check(constraint)  # a bad schema is refused before any timing
    bar = tqdm(total=sum(len(q["turns"]) for _, q in questions), unit="turn", file=sys.stderr, disable=args.quiet)
    for start in range(0, len(questions), args.batch):
        group = questions[start : start + args.batch]
        histories: list[list[dict]] = [[] for _ in group]
        for turn in range(max(len(q["turns"]) for _, q in group)):
            rows = [i for i, (_, q) in enumerate(group) if turn < len(q["turns"])]
            for i in rows:
                histories[i].append({"role": "user", "content": group[i][1]["turns"][turn]})
            prompts = [runner.prompt(histories[i]) for i in rows]
            constraints = [group[i][1]["constraint"] for i in rows]
            runner.warm(prompts, constraints)
            bid = len(timings)
            first, second = (runner.speculative, runner.plain) if bid % 2 == 0 else (runner.plain, runner.speculative)
            out = {side.__name__: side(prompts, None, constraints) for side in (first, second)}
            spec, base = out["speculative"], out["plain"]
            timings[bid] = {
                side: {
                    **{k: v for k, v in res.items() if k not in ("tokens", "accept_lengths")},
                    "tokens": sum(map(len, res["tokens"])),
                }
                for side, res in (("spec", spec), ("plain", base))
            }
            for j, i in enumerate(rows):
                name, q = group[i]
                records.append(
                    {
                        "file": name,
                        "question_id": q["question_id"],
                        "category": q["category"],
                        "turn": turn,
                        "prompt_tokens": len(prompts[j]),
                        "batch": bid,
                        "spec": {"tokens": spec["tokens"][j], "accept_lengths": spec["accept_lengths"][j]},
                        "plain": {"tokens": base["tokens"][j]},
                        "mismatch": greedy and spec["tokens"][j] != base["tokens"][j],
                        "constraint": constraints[j] and constraints[j].kind,
                    }
                )
                histories[i].append({"role": "assistant", "content": runner.decode(base["tokens"][j])})
            bar.update(len(rows))
            tau = sum(len(r["spec"]["tokens"]) for r in records) / max(
                1, sum(len(r["spec"]["accept_lengths"]) for r in records)
            )
            bar.set_postfix(tau=f"{tau:.2f}")
    bar.close()
    report = summarise(records, timings, max_accept)
    groups = {
        "files": {n: [r for r in records if r["file"] == n] for n in sets},
        "categories": {
            c: [r for r in records if r["category"] == c] for c in dict.fromkeys(r["category"] for r in records)
        },
        "by_turn": {t + 1: [r for r in records if r["turn"] == t] for t in sorted({r["turn"] for r in records})},
    }
    report.update(
        {
            "target": command.shown_path(args.target),
            "draft": command.shown_path(args.draft),
            "quantize": args.quantize,
            "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens,
            "batch": args.batch,
            "device": budget.device_kind(),
            "tree": envelope_json(tree),
            "question_files": [str(f) for f in files_],
            **{kind: {n: summarise(rs, timings, max_accept) for n, rs in g.items()} for kind, g in groups.items()},
            "auto_budget": auto,
        }
    )
    if not greedy:
        for group in [report, *report["files"].values(), *report["categories"].values()]:
            group["mismatches"] = group["mismatched_questions"] = None
    if args.save_outputs:
        report["outputs"] = [
            {
                "file": r["file"],
                "question_id": r["question_id"],
                "turn": r["turn"],
                "answer": runner.decode(r["plain"]["tokens"]),
                "mismatch": r["mismatch"],
                "constraint": r["constraint"],
            }
            for r in records
        ]
    return report


def parse_args(argv=None) -> argparse.Namespace:
    ap = command.ArgumentParser(prog="python -m infer.benchmark", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--questions", nargs="+", required=True, help="question files (JSONL: question_id, category, turns)"
    )
    ap.add_argument("--limit", type=int, default=None, help="first N >= 1 questions of each file (default: all)")
    ap.add_argument("--batch", type=int, default=1, help="questions decoded together")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts keep their last tokens")
    models.add_flags(ap, config=False, dtype=False, mesh=False)
    ap.add_argument("--chat-template", default=None, help="jinja file, if the tokenizer has no chat template")
    models.add_tree_flags(ap, static=False)
    ap.add_argument("--calibration-prompts", type=int, default=4, help="--auto-budget: calibration questions")
    ap.add_argument("--save-budget", default=None, help="--auto-budget: write the measurements as a budget.json")
    ap.add_argument("--budget-batches", default="1,4,8,16", help="--save-budget: batch sizes to measure")
    ap.add_argument(
        "--budget-candidates",
        default=None,
        help="--auto-budget: envelopes to time, e.g. 3/2/1,5/4/1+ctx7,ctx7 (default: chains, narrow and wide "
        "trees, context candidates alone and grafted on)",
    )
    ap.add_argument(
        "--json",
        default=None,
        help="output JSON (default runs/benchmark/<questions>.json); .md and .png are written next to it",
    )
    ap.add_argument("--save-outputs", action="store_true", help="include the answers in the JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    tree_flags = [args.total_tokens, args.depth, args.tree_top_k]
    if any(x is not None for x in tree_flags) and (args.auto_budget or None in tree_flags):
        raise EagleError(
            "give all of --total-tokens, --depth, --tree-top-k, or none of them (with --auto-budget "
            "or the machine's budget choosing)"
        )
    if args.draft == presets.CONTEXT_DRAFT and args.total_tokens is not None:
        raise EagleError("--draft context has no head to grow a tree: give --context K alone")
    if args.context is not None and args.auto_budget:
        raise EagleError("--context names the envelope that --auto-budget would measure: give one of them")
    if args.save_budget and not args.auto_budget:
        raise EagleError("--save-budget writes what --auto-budget measures: add --auto-budget")
    if args.batch < 1:
        raise EagleError(f"--batch must be >= 1, got {args.batch}")
    if args.limit is not None and args.limit < 1:
        raise EagleError(f"--limit must be >= 1, got {args.limit}; leave it out to run every question")
    if args.max_prompt_tokens < 1:
        raise EagleError(f"--max-prompt-tokens must be >= 1, got {args.max_prompt_tokens}")
    batches = [b.strip() for b in args.budget_batches.split(",") if b.strip()]
    if not batches or not all(b.isdigit() and int(b) >= 1 for b in batches):
        raise EagleError(f"--budget-batches {args.budget_batches!r}: expected batch sizes >= 1, e.g. 1,4,8,16")
    args.budget_batches = [int(b) for b in batches]
    with command.flag("--budget-candidates"):
        args.budget_candidates = parse_envelopes(args.budget_candidates) if args.budget_candidates else None
    pair = models.choose(args)
    args.pair_note = pair.note  # which demo pair stands in, said once the flags and outputs are checked
    args.target, args.draft = str(pair.target), str(pair.draft) if pair.draft else presets.CONTEXT_DRAFT
    return args


def output_paths(args) -> tuple[Path, Path, Path]:
    """(JSON, Markdown, PNG) report paths, checked before any work: distinct, writable, no input, and
    new or this command's earlier reports; --save-budget is checked the same way."""
    out = (
        Path(args.json)
        if args.json
        else Path("runs/benchmark") / ("_".join(Path(q).stem for q in args.questions) + ".json")
    )
    if out.suffix != ".json":
        raise EagleError(f"--json {out}: name a .json file (the .md and .png reports are written next to it)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EagleError(f"--json {out}: cannot create its folder ({exc.strerror}); choose another path") from None
    inputs = [*args.questions, args.target, args.draft, *([args.chat_template] if args.chat_template else [])]
    paths = (out, out.with_suffix(".md"), out.with_suffix(".png"))
    for path, ours in zip(paths, REPORTS):
        files.check_output_file(path, "json", inputs, ours)
    if args.save_budget:
        if Path(args.save_budget).absolute() in {p.absolute() for p in paths}:
            raise EagleError(f"--save-budget {args.save_budget}: is also a report path; name another file")
        files.check_output_file(args.save_budget, "save_budget", inputs, files.json_with("device", "choices"))
    return paths


REPORTS = (
    files.json_with("tau", "speedup", "n_alpha"),
    files.holds_bytes(MD_HEAD.encode()),
    files.holds_bytes(PNG_TITLE.encode()),
)


def _main(argv=None) -> int:
    args = parse_args(argv)
    out, md_path, png_path = output_paths(args)
    log = (lambda *a: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    if args.pair_note:
        log(args.pair_note)
    report = run_benchmark(args, log)
    files.write_text_atomic(out, json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    files.write_text_atomic(md_path, md)
    plot(report, png_path)
    print(md)
    print(f"wrote {out}, {md_path}, {png_path}")
    return 0


def main(argv=None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

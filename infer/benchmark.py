"""Speculative vs plain decoding of one target on benchmark questions: tau, tokens/s, speedup, c, n-alpha.

    python -m infer.benchmark --questions data/eval/mt_bench.jsonl [--limit N] [--temperature 0]
        [--max-new-tokens N] [--target DIR --draft DIR] [--json OUT]
        [--total-tokens N --depth D --tree-top-k K | --auto-budget]

Questions are upstream's format (one JSON object a line: question_id, category, turns[]). A
multi-turn question is answered turn by turn: each turn's prompt is the chat history (earlier user
turns and the plain decoder's answers) rendered with the tokenizer's chat template. Every turn is
generated twice in the same process, speculatively (engine) and plainly (eagle_jax.generate), in
alternating order, after a warm-up that compiles each prompt bucket (prefill and every attention
span of its cache) outside the timings. Both use the same cache capacity, sized per turn as
infer.generate does (prompt bucket + budget + one tree). Times include prefill.

Reported per file, per category and overall: tau (tokens per cycle), tokens/s both ways, speedup,
c = (speculative cycle time) / (plain decode step time, i.e. one target forward over one token) - 1,
measured in this run, n-alpha per depth (acceptance rate at depth n given depth n-1 was accepted),
and mismatches (greedy: questions whose speculative output differs from the plain one).
Writes JSON (--json, default runs/benchmark/<questions>.json), a Markdown table (.md) and a PNG next to it.

--auto-budget times speculative cycles of ten tree envelopes (chains of 3-7 drafts, deep narrow trees
of 8-24 nodes, wide ones up to 60 / 7 / 10) on the machine at hand, on calibration questions from
the ends of the files, and uses the envelope with the highest measured tokens/s (tau / cycle time;
median of three interleaved rounds); it also reports the target forward over that many tokens
against one token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cli import demo
from eagle_jax.decoding import acceptance, plain, schedule, speculative
from eagle_jax.decoding.sampling import SamplingConfig, argmax
from eagle_jax.decoding.tree import DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.models import kv_cache, target
from eagle_jax.training import data

# (total_tokens, depth, top_k): chains of 3-7 drafts (top-k 1, depth + 1 levels: what an accurate head wants
# where verifying is not free), deep narrow trees of 8-24 nodes, and wide ones up to upstream's 60 / 7 / 10
AUTO_CANDIDATES = (
    (4, 2, 1),
    (5, 3, 1),
    (6, 4, 1),
    (8, 6, 1),
    (8, 5, 2),
    (12, 5, 2),
    (16, 6, 2),
    (24, 7, 2),
    (32, 7, 4),
    (60, 7, 10),
)


def read_questions(path: Path, limit: int | None) -> list[dict]:
    if not path.is_file():
        raise EagleError(f"{path}: question file not found")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EagleError(f"{path}:{n}: not JSON ({exc.msg})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise EagleError(f"{path}:{n}: expected an object with 'turns' (a non-empty list of strings)")
        out.append(
            {"question_id": q.get("question_id", n), "category": str(q.get("category") or path.stem), "turns": turns}
        )
        if limit and len(out) >= limit:
            break
    if not out:
        raise EagleError(f"{path}: no questions")
    return out


class Runner:
    """One target + draft + tokenizer; times plain and speculative generation of one prompt."""

    def __init__(
        self,
        target_dir,
        draft_dir,
        tree,
        temperature: float,
        max_new_tokens: int,
        max_prompt_tokens: int,
        chat_template: str | None = None,
        seed: int = 0,
    ):
        # float32 compute: half-precision checkpoints (the shipped demo pair) are upcast
        self.tcfg, self.tparams = loading.load_target(target_dir, dtype=np.float32)
        self.dcfg, self.dparams = loading.load_draft(draft_dir, self.tcfg, dtype=np.float32)
        self.tokenizer = data.chat_tokenizer(target_dir, chat_template)
        self.sampling = SamplingConfig(temperature=temperature)
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.set_tree(tree)
        self._warm: set = set()

    def set_tree(self, tree) -> None:
        total, depth, top_k = tree
        self.tree = DynamicTree(total_tokens=total, depth=depth, top_k=top_k)
        self.capacity = self.capacity_for(self.max_prompt_tokens)  # the largest any turn gets
        self._warm = set()

    # ------------------------------------------------------------ prompts
    def prompt(self, history: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.max_prompt_tokens :]  # keep the end (the question and the generation prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def capacity_for(self, prompt_len: int) -> int:
        """A turn's cache capacity, as infer.generate sizes it: its prompt bucket + the budget + one tree."""
        return schedule.plan([prompt_len], self.max_new_tokens, self.tree.cache_overhead).capacity

    def prepare(self, ids: list[int], max_new_tokens: int) -> schedule.Prompts:
        return speculative.prepare([ids], max_new_tokens, self.tree, self.tcfg, self.capacity_for(len(ids)))

    # ------------------------------------------------------------ timed runs
    def plain(self, ids: list[int], max_new_tokens: int | None = None) -> dict:
        p = self.prepare(ids, max_new_tokens or self.max_new_tokens)
        key = jax.random.key(self.seed)
        t0 = time.perf_counter()
        cache, first = jax.block_until_ready(
            plain.prefill(self.tparams, p.tokens, p.lengths, key, cfg=self.tcfg, sc=self.sampling, capacity=p.capacity)
        )
        t1 = time.perf_counter()
        state = jax.block_until_ready(
            plain.decode(self.tparams, cache, first, p.limits, key, cfg=self.tcfg, sc=self.sampling)
        )
        t2 = time.perf_counter()
        toks = plain.result(state, p.tokens.shape[1]).tokens[0]
        return {
            "tokens": toks,
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "seconds": t2 - t0,
            "steps": max(0, len(toks) - 1),
        }

    def speculative(self, ids: list[int], max_new_tokens: int | None = None) -> dict:
        p = self.prepare(ids, max_new_tokens or self.max_new_tokens)
        static = dict(tcfg=self.tcfg, dcfg=self.dcfg, tree=self.tree, sampling=self.sampling)
        t0 = time.perf_counter()
        state = jax.block_until_ready(
            speculative.prefill(
                self.tparams,
                self.dparams,
                p.tokens,
                p.lengths,
                p.limits,
                jax.random.key(self.seed),
                capacity=p.capacity,
                **static,
            )
        )
        t1 = time.perf_counter()
        state = jax.block_until_ready(speculative.run(self.tparams, self.dparams, state, **static))
        t2 = time.perf_counter()
        res = speculative.result(state)
        return {
            "tokens": res.tokens[0],
            "accept_lengths": res.accept_lengths[0],
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "seconds": t2 - t0,
            "cycles": len(res.accept_lengths[0]),
        }

    def warm(self, ids: list[int]) -> None:
        """Compile the prompt's bucket for both decoders, prefill and every attention span (untimed)."""
        b = schedule.prompt_bucket(len(ids))
        if b in self._warm:
            return
        p = self.prepare(ids, 1)
        key, idle = jax.random.key(self.seed), p.limits * 0  # rows with no budget: every loop exits at once
        static = dict(tcfg=self.tcfg, dcfg=self.dcfg, tree=self.tree, sampling=self.sampling)
        cache, first = plain.prefill(
            self.tparams, p.tokens, p.lengths, key, cfg=self.tcfg, sc=self.sampling, capacity=p.capacity
        )
        plain_state = plain.init_state(cache, first, idle, self.tcfg)
        spec_state = speculative.prefill(
            self.tparams, self.dparams, p.tokens, p.lengths, idle, key, capacity=p.capacity, **static
        )
        for span in schedule.all_spans(p.capacity):
            plain_state = plain.decode_span(self.tparams, plain_state, key, cfg=self.tcfg, sc=self.sampling, span=span)
            spec_state = speculative.run_span(self.tparams, self.dparams, spec_state, span=span, **static)
        jax.block_until_ready((plain_state, spec_state))
        self._warm.add(b)


# ---------------------------------------------------------------- statistics


def summarise(records: list[dict], max_accept: int) -> dict:
    """Aggregate turn records (each with plain and spec timings) into the reported figures."""
    spec_tokens = sum(len(r["spec"]["tokens"]) for r in records)
    plain_tokens = sum(len(r["plain"]["tokens"]) for r in records)
    spec_s = sum(r["spec"]["seconds"] for r in records)
    plain_s = sum(r["plain"]["seconds"] for r in records)
    cycles = sum(r["spec"]["cycles"] for r in records)
    cycle_s = sum(r["spec"]["decode_s"] for r in records) / max(1, cycles)
    steps = sum(r["plain"]["steps"] for r in records)
    step_s = sum(r["plain"]["decode_s"] for r in records) / max(1, steps)
    acc = [a for r in records for a in r["spec"]["accept_lengths"]]
    hist = acceptance.accept_histogram(acc, max_accept)
    n_alpha = [None if a is None else round(a, 4) for a in acceptance.n_alpha(hist)]
    tps_spec = spec_tokens / spec_s if spec_s else 0.0
    tps_plain = plain_tokens / plain_s if plain_s else 0.0
    questions = {r["question_id"] for r in records}
    bad = {r["question_id"] for r in records if r["mismatch"]}
    return {
        "questions": len(questions),
        "turns": len(records),
        "tau": round(spec_tokens / max(1, cycles), 4),
        "tokens_per_s_spec": round(tps_spec, 2),
        "tokens_per_s_plain": round(tps_plain, 2),
        "speedup": round(tps_spec / tps_plain, 4) if tps_plain else None,
        "c": round(cycle_s / step_s - 1, 4) if step_s else None,
        "cycle_ms": round(1000 * cycle_s, 3),
        "plain_step_ms": round(1000 * step_s, 3),
        "prefill_ms_spec": round(1000 * sum(r["spec"]["prefill_s"] for r in records) / max(1, len(records)), 3),
        "prefill_ms_plain": round(1000 * sum(r["plain"]["prefill_s"] for r in records) / max(1, len(records)), 3),
        "new_tokens_spec": spec_tokens,
        "new_tokens_plain": plain_tokens,
        "n_alpha": n_alpha,
        "accept_histogram": hist,
        "mismatches": len(bad),
        "mismatched_questions": sorted(bad, key=str),
    }


def target_forward_ms(runner: Runner, n: int, reps: int = 20) -> float:
    """Milliseconds of one target forward over n new tokens (logits and argmax included) against a
    half-full cache, attending over the span decoding would use there: what verifying an n-node tree
    costs. Timed as `reps` forwards inside one jitted loop, so dispatch does not count."""
    ctx = min(256, runner.capacity // 2)
    cache = kv_cache.set_lengths(target.init_cache(runner.tcfg, 1, runner.capacity), jnp.full((1,), ctx, jnp.int32))

    @jax.jit
    def forwards(params, cache):
        def one(i, cache):
            tokens = jnp.full((1, n), i, jnp.int32)
            out = target.forward(
                params,
                runner.tcfg,
                tokens,
                cache.lengths[:, None] + jnp.arange(n)[None],
                cache,
                span=schedule.attention_span(ctx + n, runner.capacity),
            )
            # lengths stay at ctx, but depend on the logits so that nothing is skipped
            return kv_cache.advance(out.cache, jnp.minimum(jnp.sum(argmax(out.logits)), 0)[None])

        return jax.lax.fori_loop(0, reps, one, cache).lengths

    forwards(runner.tparams, cache).block_until_ready()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        forwards(runner.tparams, cache).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times) / reps


def auto_budget(
    runner: Runner, prompts: list[list[int]], candidates, max_new_tokens: int, log, rounds: int = 3
) -> dict:
    """Measure tokens/s of each tree envelope on the calibration prompts; pick the fastest.

    After one compiling pass, the candidates are timed in `rounds` interleaved rounds, so that a slow
    spell of the machine does not land on one candidate only; each gets its median round."""
    verify_ms = {n: target_forward_ms(runner, n) for n in sorted({1} | {c[0] for c in candidates})}
    for cand in candidates:
        runner.set_tree(cand)
        for ids in prompts:
            runner.warm(ids)
    runs: dict[tuple, list[tuple[int, int, float]]] = {c: [] for c in candidates}  # (tokens, cycles, seconds)
    for _ in range(rounds):
        for cand in candidates:
            runner.set_tree(cand)
            done = [runner.speculative(ids, max_new_tokens) for ids in prompts]
            runs[cand].append(
                (sum(len(r["tokens"]) for r in done), sum(r["cycles"] for r in done), sum(r["decode_s"] for r in done))
            )
    rows = []
    for cand in candidates:
        tokens, cycles, seconds = sorted(runs[cand], key=lambda r: r[0] / r[2])[rounds // 2]
        row = {
            "total_tokens": cand[0],
            "depth": cand[1],
            "top_k": cand[2],
            "tau": round(tokens / max(1, cycles), 3),
            "cycle_ms": round(1000 * seconds / max(1, cycles), 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "verify_ms": round(verify_ms[cand[0]], 3),
            "verify_over_one_token": round(verify_ms[cand[0]] / verify_ms[1], 3),
        }
        rows.append(row)
        log(
            f"auto-budget: total_tokens={cand[0]} depth={cand[1]} top_k={cand[2]}: tau {row['tau']}, "
            f"cycle {row['cycle_ms']} ms, {row['tokens_per_s']} tokens/s (target over {cand[0]} tokens: "
            f"{row['verify_over_one_token']}x one token)"
        )
    best = max(rows, key=lambda r: r["tokens_per_s"])
    runner.set_tree((best["total_tokens"], best["depth"], best["top_k"]))
    return {
        "chosen": {k: best[k] for k in ("total_tokens", "depth", "top_k")},
        "candidates": rows,
        "rounds": rounds,
        "target_forward_ms": {str(k): round(v, 3) for k, v in verify_ms.items()},
    }


# ---------------------------------------------------------------- reports


def markdown(report: dict) -> str:
    head = (
        "| set | questions | turns | tau | spec tok/s | plain tok/s | speedup | c | mismatches |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )

    def row(name, s):
        sp = f"{s['speedup']:.2f}x" if s["speedup"] else "-"
        c = f"{s['c']:.2f}" if s["c"] is not None else "-"
        mm = s["mismatches"] if s["mismatches"] is not None else "n/a"
        return (
            f"| {name} | {s['questions']} | {s['turns']} | {s['tau']:.2f} | {s['tokens_per_s_spec']:.1f} | "
            f"{s['tokens_per_s_plain']:.1f} | {sp} | {c} | {mm} |\n"
        )

    t = report["tree"]
    lines = [
        f"# Benchmark: {report['target']} + {report['draft']}\n\n",
        f"tree: total_tokens={t['total_tokens']} depth={t['depth']} top_k={t['top_k']}"
        f"{' (auto-budget)' if report.get('auto_budget') else ''}; temperature {report['temperature']}; "
        f"max_new_tokens {report['max_new_tokens']}; device {report['device']}\n\n",
        head,
        row("**all**", report),
    ]
    for name, s in report["files"].items():
        lines.append(row(name, s))
    for name, s in report["categories"].items():
        lines.append(row(f"{name} (category)", s))
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
    if report.get("auto_budget"):
        lines.append(
            "\n| total_tokens | depth | top_k | tau | cycle ms | tok/s | target(N)/target(1) |\n"
            "|---|---|---|---|---|---|---|\n"
        )
        for r in report["auto_budget"]["candidates"]:
            lines.append(
                f"| {r['total_tokens']} | {r['depth']} | {r['top_k']} | {r['tau']:.2f} | {r['cycle_ms']:.2f}"
                f" | {r['tokens_per_s']:.1f} | {r['verify_over_one_token']:.2f} |\n"
            )
    return "".join(lines)


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
    t = report["tree"]
    fig.suptitle(
        f"tau {report['tau']:.2f}, speedup {report['speedup']:.2f}x, c {report['c']:.2f} "
        f"(tree {t['total_tokens']}/{t['depth']}/{t['top_k']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------- main


def calibration_questions(files: list[Path], args) -> list[dict]:
    """--calibration-prompts questions for --auto-budget, taken round-robin from the ends of the files, so
    that with --limit they are not the measured ones (unless a file has no others)."""
    tails = [read_questions(f, None)[::-1] for f in files]
    picked = [t[i] for i in range(max(map(len, tails))) for t in tails if i < len(t)]
    return picked[: args.calibration_prompts]


def run_benchmark(args, log=print) -> dict:
    files = [Path(q) for q in args.questions]
    sets = {f.stem: read_questions(f, args.limit) for f in files}
    tree = (args.total_tokens, args.depth, args.tree_top_k)
    runner = Runner(
        args.target,
        args.draft,
        tree,
        args.temperature,
        args.max_new_tokens,
        args.max_prompt_tokens,
        args.chat_template,
        args.seed,
    )
    max_accept = runner.tree.max_depth
    auto = None
    if args.auto_budget:
        calib = [
            runner.prompt([{"role": "user", "content": q["turns"][0]}]) for q in calibration_questions(files, args)
        ]
        auto = auto_budget(runner, calib, AUTO_CANDIDATES, min(128, args.max_new_tokens), log)
        max_accept = runner.tree.max_depth
        c = auto["chosen"]
        log(f"auto-budget chose total_tokens={c['total_tokens']} depth={c['depth']} top_k={c['top_k']}")
    greedy = runner.sampling.greedy
    records: list[dict] = []
    total_turns = sum(len(q["turns"]) for qs in sets.values() for q in qs)
    bar = tqdm(total=total_turns, unit="turn", file=sys.stderr, disable=args.quiet)
    k = 0
    for name, qs in sets.items():
        for q in qs:
            history: list[dict] = []
            for turn, text in enumerate(q["turns"]):
                history.append({"role": "user", "content": text})
                ids = runner.prompt(history)
                runner.warm(ids)
                if k % 2 == 0:
                    spec, plain = runner.speculative(ids), None
                    plain = runner.plain(ids)
                else:
                    plain = runner.plain(ids)
                    spec = runner.speculative(ids)
                k += 1
                mismatch = greedy and spec["tokens"] != plain["tokens"]
                records.append(
                    {
                        "file": name,
                        "question_id": q["question_id"],
                        "category": q["category"],
                        "turn": turn,
                        "prompt_tokens": len(ids),
                        "spec": spec,
                        "plain": plain,
                        "mismatch": mismatch,
                    }
                )
                history.append({"role": "assistant", "content": runner.decode(plain["tokens"])})
                bar.update(1)
                tau = sum(len(r["spec"]["tokens"]) for r in records) / max(1, sum(r["spec"]["cycles"] for r in records))
                bar.set_postfix(tau=f"{tau:.2f}")
    bar.close()
    report = summarise(records, max_accept)
    if not greedy:
        report["mismatches"] = None
        report["mismatched_questions"] = None
    t = runner.tree
    report.update(
        {
            "target": str(args.target),
            "draft": str(args.draft),
            "temperature": args.temperature,
            "max_new_tokens": args.max_new_tokens,
            "device": f"{jax.devices()[0].platform} ({jax.device_count()})",
            "tree": {"total_tokens": t.total_tokens, "depth": t.depth, "top_k": t.top_k},
            "question_files": [str(f) for f in files],
            "files": {n: summarise([r for r in records if r["file"] == n], max_accept) for n in sets},
            "categories": {
                c: summarise([r for r in records if r["category"] == c], max_accept)
                for c in dict.fromkeys(r["category"] for r in records)
            },
            "auto_budget": auto,
        }
    )
    if not greedy:
        for group in list(report["files"].values()) + list(report["categories"].values()):
            group["mismatches"] = None
    if args.save_outputs:
        report["outputs"] = [
            {
                "file": r["file"],
                "question_id": r["question_id"],
                "turn": r["turn"],
                "answer": runner.decode(r["plain"]["tokens"]),
                "mismatch": r["mismatch"],
            }
            for r in records
        ]
    return report


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--questions", nargs="+", required=True, help="question files (JSONL: question_id, category, turns)"
    )
    ap.add_argument("--limit", type=int, default=None, help="first N questions of each file")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=256, help="per turn")
    ap.add_argument("--max-prompt-tokens", type=int, default=384, help="longer prompts keep their last tokens")
    ap.add_argument("--target", default=str(demo.TARGET))
    ap.add_argument("--draft", default=str(demo.DRAFT))
    ap.add_argument("--chat-template", default=None, help="jinja file, if the tokenizer has no chat template")
    ap.add_argument("--total-tokens", type=int, default=demo.TREE.total_tokens)
    ap.add_argument("--depth", type=int, default=demo.TREE.depth)
    ap.add_argument("--tree-top-k", type=int, default=demo.TREE.top_k)
    ap.add_argument("--auto-budget", action="store_true", help="pick the tree envelope by timing it here")
    ap.add_argument("--calibration-prompts", type=int, default=8, help="--auto-budget: prompts timed per tree")
    ap.add_argument(
        "--json",
        default=None,
        help="output JSON (default runs/benchmark/<questions>.json); .md and .png are written next to it",
    )
    ap.add_argument("--save-outputs", action="store_true", help="include the answers in the JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.auto_budget and any(a in (argv or sys.argv) for a in ("--total-tokens", "--depth", "--tree-top-k")):
        ap.error("--auto-budget chooses the tree: drop --total-tokens/--depth/--tree-top-k")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        report = run_benchmark(args, log)
    except EagleError as exc:
        raise SystemExit(f"error: {exc}") from None
    out = (
        Path(args.json)
        if args.json
        else Path("runs/benchmark") / ("_".join(Path(q).stem for q in args.questions) + ".json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    plot(report, out.with_suffix(".png"))
    print(md)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()

"""EAGLE-1 against EAGLE-3 heads trained from scratch at equal CPU time, then measured on held-out questions.

    python -m instruments.head_race --target T --out runs/race --cpu-hours 2 \
        --common "--data D --features FEATS --batch-size 8 --max-length 640 --lr 1e-3 --warmup 20" \
        --eagle1 "--steps 20000" --eagle3 "--steps 8000 --ttt-steps 4 --draft-vocab-size 4096" \
        --questions data/eval/mt_bench.jsonl --limit 20 --max-new-tokens 128 --chain 5/4/1 \
        --json demo/results/smollm2/race.json

`python -m train.eagle1` and `train.eagle3` run side by side (`--common` flags plus their own), each pinned to a
core of its own by `taskset` when there are two, into OUT/eagle1 and OUT/eagle3. Each run's CPU time (its
process's user and system time, all threads) is summed across restarts in OUT/race.json; when it reaches
--cpu-hours the run gets SIGTERM (not SIGINT, which a background job's children ignore) and stops after its
step with a checkpoint and its head exported. Rerunning the same command continues: unfinished runs resume, a
raised --cpu-hours trains further, finished measurements are kept. Ctrl-C (or SIGTERM) stops both runs after
their steps, with checkpoints, and then this command.

Then each head is measured with `python -m infer.benchmark` on --questions (both cores, one after the other):
with the same chain (--chain TOTAL/DEPTH/TOP_K) and with `--auto-budget` (the envelope it measures fastest
here, plain decoding included; --budget passes it flags, e.g. fewer candidates), reporting also the fastest
envelope that drafts with the head in its calibration. Written: --json (the runs' CPU hours, steps, tokens
seen, last training accuracies, both measurements of each head), a .md table and a .png (first-token accuracy on
the training batches and the engine tau on --tau-prompts, if the runs measure it, against CPU hours; held-out tau).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import files

KINDS = ("eagle1", "eagle3")
CLOCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, all its threads (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def last_step(run: Path) -> int:
    rows = read_jsonl(run / "metrics.jsonl")
    return rows[-1]["step"] if rows else 0


def train(a, out: Path, ledger: dict) -> None:
    """Run (or resume) both trainings until each has used the CPU budget or finished its steps."""
    budget = a.cpu_hours * 3600
    cores = sorted(os.sched_getaffinity(0))
    running = {}
    for i, kind in enumerate(KINDS):
        entry = ledger.setdefault(kind, {"cpu_s": 0.0, "trace": [], "finished": False})
        if entry["finished"] or entry["cpu_s"] >= budget:
            continue
        args = [*shlex.split(a.common), *shlex.split(getattr(a, kind)), "--target", a.target, "--out", str(out / kind)]
        log = (out / f"{kind}.log").open("a")
        pin = ["taskset", "-c", str(cores[i % len(cores)])] if len(cores) > 1 and shutil.which("taskset") else []
        cmd = [*pin, sys.executable, "-m", f"train.{kind}", *args]  # a session of its own: signals come from here
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
        running[kind] = {"proc": proc, "base": entry["cpu_s"], "stopping": False, "log": log}
        print(f"{kind}: training from {entry['cpu_s'] / 3600:.2f} CPU hours (log {out / kind}.log)", flush=True)
    stop: list[int] = []  # Ctrl-C or SIGTERM here: each run stops after its step, then this command
    handlers = {
        sig: signal.signal(sig, lambda signum, _: stop.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        poll(a, out, ledger, running, budget, stop)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stop:
        raise KeyboardInterrupt


def poll(a, out: Path, ledger: dict, running: dict, budget: float, stop: list[int]) -> None:
    """Until every run has exited: read their CPU time, send SIGTERM to those past the budget (or to all, once a
    signal came here or a run failed), keep the ledger."""
    failed = []
    while running:
        time.sleep(0.2 if stop else a.poll)
        for kind in list(running):
            r, entry = running[kind], ledger[kind]
            pid, status, usage = os.wait4(r["proc"].pid, os.WNOHANG)
            used = usage.ru_utime + usage.ru_stime if pid else cpu_seconds(r["proc"].pid)
            entry["cpu_s"] = r["base"] + used
            step = last_step(out / kind)
            if not entry["trace"] or entry["trace"][-1][1] != step:
                entry["trace"].append([round(entry["cpu_s"], 1), step])
            if pid:
                r["proc"].returncode = code = os.waitstatus_to_exitcode(status)
                r["log"].close()
                del running[kind]
                if code not in (0, command.EXIT_INTERRUPTED):
                    failed.append(f"train.{kind} failed (exit code {code}); see {out / kind}.log")
                    stop.append(0)  # the other run stops too, with a checkpoint
                entry["finished"] = code == 0
                print(f"{kind}: stopped at step {step}, {entry['cpu_s'] / 3600:.2f} CPU hours", flush=True)
            elif (entry["cpu_s"] >= budget or stop) and not r["stopping"]:
                r["proc"].send_signal(signal.SIGTERM)
                r["stopping"] = True
        files.write_json_atomic(out / "race.json", ledger)
    if failed:
        raise EagleError(failed[0])


def measure(a, out: Path, kind: str, name: str, extra: list[str]) -> dict:
    """infer.benchmark of a head's export (kept, per step the head reached)."""
    path = out / kind / f"bench_{name}_step{last_step(out / kind)}.json"
    if not path.is_file():
        args = ["--target", a.target, "--draft", str(out / kind / "export"), "--questions", *a.questions]
        args += ["--limit", str(a.limit), "--max-new-tokens", str(a.max_new_tokens), "--json", str(path), "--quiet"]
        print(f"{kind}: benchmark ({name})", flush=True)
        done = subprocess.run([sys.executable, "-m", "infer.benchmark", *args, *extra], capture_output=True, text=True)
        if done.returncode != 0:
            raise EagleError(f"infer.benchmark failed for {kind}: {done.stderr.strip()[-400:]}")
    b = files.read_json(path)
    keys = ("tau", "speedup", "c", "tokens_per_s_spec", "tokens_per_s_plain", "mismatches", "n_alpha")
    result = {"envelope": envelope_name(b["tree"]), **{k: b[k] for k in keys}}
    if b.get("auto_budget"):  # what its calibration timed, and the fastest envelope that drafts with the head
        rows = [{**m, "tree": envelope_name(m["tree"])} for m in b["auto_budget"]["measured"][str(b["batch"])]]
        plain = next(m["tokens_per_s"] for m in rows if m["tree"] == "plain")
        best = max((m for m in rows if m["tree"][0].isdigit()), key=lambda m: m["tokens_per_s"], default=None)
        result |= {"calibration": rows, "best_head": best and {**best, "vs_plain": best["tokens_per_s"] / plain}}
    return result


def envelope_name(tree: dict | None) -> str:
    """TOTAL/DEPTH/TOP_K (+ctxK with context candidates), ctxK for context candidates alone, or plain."""
    if tree is None:
        return "plain"
    if "total_tokens" not in tree:
        return f"ctx{tree['context']}"
    name = f"{tree['total_tokens']}/{tree['depth']}/{tree['top_k']}"
    return name + (f"+ctx{tree['context']}" if tree.get("context") else "")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for kind, r in report["runs"].items():
        axes[0].plot([h for h, _ in r["accuracy"]], [acc for _, acc in r["accuracy"]], label=kind)
        if r["tau"]:
            axes[1].plot([h for h, _ in r["tau"]], [t for _, t in r["tau"]], "o-", label=kind)
    axes[0].set(title="first-token accuracy, training batches", xlabel="CPU hours", ylim=(0, 1))
    axes[1].set(title="engine tau on the tau prompts", xlabel="CPU hours")
    kinds = list(report["runs"])
    for j, name in enumerate(("chain", "budget")):
        axes[2].bar(
            [i + 0.4 * j for i in range(len(kinds))], [report["runs"][k][name]["tau"] for k in kinds], 0.4, label=name
        )
    axes[2].set_xticks([i + 0.2 for i in range(len(kinds))], kinds)
    axes[2].set(title="held-out tau")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def hours_at(trace: list[list[float]], step: int) -> float:
    """CPU hours when a run's log first showed `step` (from the ledger's trace)."""
    return next((cpu for cpu, s in trace if s >= step), trace[-1][0] if trace else 0.0) / 3600


def chain_flags(chain: str) -> list[str]:
    """infer.benchmark's flags for a TOTAL/DEPTH/TOP_K envelope."""
    parts = chain.split("/")
    if len(parts) != 3 or not all(x.isdigit() for x in parts):
        raise EagleError(f"--chain: expected TOTAL/DEPTH/TOP_K, e.g. 5/4/1, got {chain!r}")
    return ["--total-tokens", parts[0], "--depth", parts[1], "--tree-top-k", parts[2]]


def report_of(a, out: Path, ledger: dict) -> dict:
    runs = {}
    for kind in KINDS:
        rows, entry = read_jsonl(out / kind / "metrics.jsonl"), ledger[kind]
        taus = read_jsonl(out / kind / "tau.jsonl")
        runs[kind] = {
            "cpu_hours": entry["cpu_s"] / 3600,
            "steps": rows[-1]["step"] if rows else 0,
            "tokens_seen": taus[-1]["tokens_seen"] if taus else None,
            "last_accuracy": rows[-1]["acc"] if rows else None,
            "accuracy": [[hours_at(entry["trace"], r["step"]), r["acc"][0]] for r in rows],
            "tau": [[hours_at(entry["trace"], t["step"]), t["tau"]] for t in taus],
            "chain": measure(a, out, kind, "chain", chain_flags(a.chain)),
            "budget": measure(a, out, kind, "budget", ["--auto-budget", *shlex.split(a.budget)]),
        }
    return runs


def table(report: dict) -> str:
    lines = [
        f"`{report['command']}`",
        "",
        "| head | CPU hours | steps | last train acc | chain tau | chain c | chain speedup | budget's envelope | tau "
        "| c | speedup | fastest head envelope (calibration) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, r in report["runs"].items():
        ch, bu = r["chain"], r["budget"]
        acc = "/".join(f"{x:.2f}" for x in r["last_accuracy"] or [])
        best = bu.get("best_head")
        head = best and f"{best['tree']}: tau {best['tau']:.2f}, {best['vs_plain']:.2f}x plain"
        lines.append(
            f"| {kind} | {r['cpu_hours']:.2f} | {r['steps']} | {acc} | {ch['tau']:.2f} | {ch['c']:.2f} | "
            f"{ch['speedup']:.2f}x | {bu['envelope']} | {bu['tau']:.2f} | {bu['c']:.2f} | {bu['speedup']:.2f}x | "
            f"{head or '-'} |"
        )
    for kind, r in report["runs"].items():
        if r["budget"].get("calibration"):
            rows = r["budget"]["calibration"]
            lines += ["", f"{kind}, --auto-budget calibration:", "", "| envelope | tau | tokens/s |", "|---|---|---|"]
            lines += [f"| {m['tree']} | {m['tau']:.2f} | {m['tokens_per_s']:.1f} |" for m in rows]
    return "\n".join(lines) + "\n"


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = command.ArgumentParser(prog="python -m instruments.head_race", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True, help="folder of the two runs and the ledger (race.json)")
    p.add_argument("--cpu-hours", type=float, required=True, help="CPU time of each run")
    p.add_argument("--common", default="", help="flags both training commands get")
    p.add_argument("--eagle1", default="", help="flags only train.eagle1 gets")
    p.add_argument("--eagle3", default="", help="flags only train.eagle3 gets")
    p.add_argument("--questions", nargs="+", required=True)
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", default="5/4/1", help="TOTAL/DEPTH/TOP_K both heads are measured with")
    p.add_argument(
        "--budget",
        default="",
        help='flags the --auto-budget benchmark gets, e.g. "--budget-candidates 3/2/1,ctx7 --calibration-prompts 2"',
    )
    p.add_argument("--poll", type=float, default=10.0, help="seconds between CPU-time readings")
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    if not a.cpu_hours > 0:
        raise EagleError(f"--cpu-hours must be > 0, got {a.cpu_hours}")
    chain_flags(a.chain)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger = files.read_json(out / "race.json") if (out / "race.json").is_file() else {}
    train(a, out, ledger)
    shown = " ".join(argv).replace(str(Path.home()), "~")
    report = {"command": f"python -m instruments.head_race {shown}", "runs": report_of(a, out, ledger)}
    path = Path(a.json)
    files.write_json_atomic(path, report)
    path.with_suffix(".md").write_text(table(report))
    plot(report, path.with_suffix(".png"))
    print(table(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

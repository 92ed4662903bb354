"""The cost table's and the TPU estimate's arithmetic by hand; the estimate on the golden target (XLA:CPU)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading

import pytest

from eagle_jax.decoding import budget
from eagle_jax.decoding.tree import PLAIN, DynamicTree, parse_envelopes
from eagle_jax.errors import EagleError
from instruments import cost, cost_table, head_race, tpu_estimate

CHIP = cost.Chip("test", peak_flops=100.0, hbm_bandwidth=10.0)


def test_roofline_by_hand():
    memory_bound = cost.Cost(flops=100.0, bytes=50.0, resident=20.0)  # 1 s of flops, 5 s of bytes (2 s floor)
    assert memory_bound.roofline_s(CHIP) == 5.0
    assert memory_bound.roofline_s(CHIP, floor=True) == 2.0
    assert memory_bound.bound(CHIP) == "memory"
    compute_bound = cost.Cost(flops=1000.0, bytes=50.0)
    assert compute_bound.roofline_s(CHIP) == 10.0 and compute_bound.bound(CHIP) == "compute"
    assert cost.overhead(1.5, 1.0) == 0.5
    assert cost.speedup(3.0, 0.5) == 2.0


def test_estimate_row_by_hand():
    step = cost.Cost(flops=100.0, bytes=20.0, resident=10.0)  # 2 s (floor 1 s)
    cycle = cost.Cost(flops=600.0, bytes=30.0, resident=10.0)  # 6 s either way: compute-bound
    row = tpu_estimate.estimate_row(CHIP, "60/7/10", cycle, step, taus=(3.0, 6.0))
    assert row["cycle_ms"] == 6000.0 and row["step_ms"] == 2000.0 and row["c"] == 2.0
    assert row["speedup"] == {"3": 1.0, "6": 2.0}
    assert row["floor_c"] == 5.0 and row["floor_speedup"]["6"] == 1.0
    assert row["cycle_bound"] == "compute"


def test_budget_choice_by_hand():
    """The fastest envelope wins only by budget.MARGIN over plain decoding; a closer one leaves plain decoding."""
    chain, tree = DynamicTree(3, 2, 1), DynamicTree(16, 4, 4)

    def measured(plain: float, chain_rate: float, tree_rate: float) -> list[budget.Measured]:
        return [
            budget.Measured(PLAIN, 1.0, plain),
            budget.Measured(chain, 2.0, chain_rate),
            budget.Measured(tree, 3.0, tree_rate),
        ]

    assert budget.MARGIN == 0.05
    assert budget.choose(measured(100, 120, 110)) == chain
    assert budget.choose(measured(100, 104, 110)) == tree
    assert budget.choose(measured(100, 105, 90)) == chain  # exactly the margin
    assert budget.choose(measured(100, 104.9, 90)) == PLAIN  # faster, but within the margin
    assert budget.choose(measured(100, 80, 90)) == PLAIN
    assert budget.choose(measured(100, 104, 90), margin=0.0) == chain
    assert budget.choose([budget.Measured(PLAIN, 1.0, 100)]) == PLAIN


def test_parsers():
    assert parse_envelopes("60/7/10, 5/4/1") == [DynamicTree(60, 7, 10), DynamicTree(5, 4, 1)]
    assert tpu_estimate.parse_setup("llama3.1-8b-eagle3@v6e-1") == ("llama3.1-8b-eagle3", "v6e-1")
    for bad in ("60/7", "a/b/c"):
        with pytest.raises(EagleError, match="bad tree envelope"):
            parse_envelopes(bad)
    with pytest.raises(EagleError, match="bad setup"):
        tpu_estimate.parse_setup("llama3.1-8b-eagle3@v9-1")


def _run(tokens, seconds, decode_s, accept, **loop):
    return {"tokens": tokens, "accept_lengths": accept, "seconds": seconds, "decode_s": decode_s, **loop}


def test_cost_table_figures_by_hand():
    # two prompts, two repeats; spec: 6 + 4 tokens in 2 + 2 cycles; plain: the same tokens in 5 + 3 cycles
    spec = [
        [_run([[1] * 6], 1.0, 0.8, [[2, 1]], cycles=2), _run([[2] * 4], 1.0, 0.8, [[1, 1]], cycles=2)],
        [_run([[1] * 6], 3.0, 2.0, [[2, 1]], cycles=2), _run([[2] * 4], 3.0, 2.0, [[1, 1]], cycles=2)],
    ]
    plain = [
        [_run([[1] * 6], 2.0, 1.6, [[0] * 6], cycles=5), _run([[2] * 4], 2.0, 1.6, [[0] * 4], cycles=3)],
        [_run([[1] * 6], 2.0, 1.6, [[0] * 6], cycles=5), _run([[2] * 4], 2.0, 1.6, [[0] * 4], cycles=3)],
    ]
    f = cost_table.figures(spec, plain)
    assert f["spec_tokens_per_s"] == 10 / 4.0  # median of (2.0, 6.0) s
    assert f["plain_tokens_per_s"] == 10 / 4.0
    assert f["speedup"] == 1.0 and f["tau"] == 10 / 4 and f["identical"]
    assert f["c"] == pytest.approx((2.8 / 4) / (3.2 / 8) - 1)  # median decode 2.8 s / 4 cycles vs 3.2 s / 8 steps
    assert f["cycle_ms"] == pytest.approx(700) and f["plain_step_ms"] == pytest.approx(400)
    plain[0][1]["tokens"] = [[3] * 4]
    assert not cost_table.figures(spec, plain)["identical"]
    assert cost_table.figures(spec, plain, speculative=False)["c"] is None
    assert cost_table.figures(spec, plain, speculative=False)["cycle_ms"] is None


def test_cost_table_markdown():
    row = {"batch": 1, "envelope": "5/4/1", "budget": False, "spec_tokens_per_s": 20.0, "plain_tokens_per_s": 10.0}
    row |= {"speedup": 2.0, "tau": 3.0, "cycle_ms": 1.5, "plain_step_ms": 1.0, "c": 0.5, "identical": True}
    official = {"spec_tokens_per_s": 5.0, "plain_tokens_per_s": 4.0, "c": 1.25, "same_tokens_and_accepts": True}
    text = cost_table.table({"rows": [row, {**row, "batch": 8, "budget": True, "c": None, "cycle_ms": None}]})
    assert "| 1 | 5/4/1 | 20.0 | 10.0 | 2.00x | 3.00 | 1.50 | 1.00 | 0.50 | yes |" in text
    assert "| 8 | 5/4/1 (budget) | 20.0 | 10.0 | 2.00x | 3.00 | - | 1.00 | - | yes |" in text
    assert "| 8 | 5/4/1 (budget) |" in text and "official" not in text
    text = cost_table.table({"rows": [{**row, "official": official}, {**row, "batch": 8}]})
    assert "| 5.0 | 4.0 | 1.25 | 4.00x | yes |" in text and text.endswith("| - | - | - | - | - |")


def test_same_as_official_by_hand():
    """Ours is a prefix of the official run (which overshoots the token limit), its last cycle possibly cut."""
    theirs = [{"output_ids": [5, 6, 7, 8, 9, 10], "accept_lengths": [2, 0, 2]}]
    assert cost_table.same_as_official([{"tokens": [5, 6, 7, 8, 9, 10], "accept_lengths": [2, 0, 2]}], theirs)
    assert cost_table.same_as_official([{"tokens": [5, 6, 7, 8, 9], "accept_lengths": [2, 0, 1]}], theirs)
    for tokens, accepts in (
        ([5, 6, 7, 8, 9, 11], [2, 0, 2]),  # another token
        ([5, 6, 7, 8, 9, 10], [1, 1, 2]),  # the same tokens, other cycles
        ([5, 6, 7, 8, 9, 10], [2, 0, 3]),  # the last cycle accepts more than theirs
        ([5, 6, 7], [2, 0, 2, 0]),  # more cycles than theirs
    ):
        assert not cost_table.same_as_official([{"tokens": tokens, "accept_lengths": accepts}], theirs)


def test_tpu_estimate_on_the_golden_target_with_xla_cpu(tmp_path, golden_dir, capsys):
    out = tmp_path / "estimate.json"
    argv = ["--setup", f"{golden_dir / 'target'}@v6e-1", "--trees", "5/4/1,16/4/4", "--context", "64", "--cpu"]
    assert tpu_estimate.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "ESTIMATE" in printed and "XLA:CPU" in printed
    report = json.loads(out.read_text())
    (setup,) = report["setups"]
    narrow, wide = setup["rows"]
    assert narrow["step_gflop"] == wide["step_gflop"] > 0
    assert wide["cycle_gflop"] > narrow["cycle_gflop"] > narrow["step_gflop"]  # more nodes, more work
    assert narrow["cycle_floor_gb"] > narrow["step_floor_gb"] > 0  # the head and its cache on top


def test_train_estimate_on_the_golden_target_with_xla_cpu(tmp_path, golden_dir):
    """Offline (stored features) holds less and computes less than online; its flops are the head's TTT step
    (`ttt_flops`, plus what XLA multiplies under the causal mask, plus the draft-vocabulary readout) within 10%,
    which needs every TTT step counted."""
    import numpy as np

    from cli import plan
    from eagle_jax.training import objective
    from instruments import train_estimate

    out = tmp_path / "train.json"
    argv = ["--setup", f"{golden_dir / 'target'}@v6e-8", "--batches", "8", "--length", "64", "--ttt-steps", "3"]
    assert train_estimate.main([*argv, "--cpu", "--json", str(out)]) == 0
    online, offline = json.loads(out.read_text())["rows"]
    assert (online["mode"], offline["mode"]) == ("online", "offline") and online["fits"] and offline["fits"]
    assert offline["peak_gib"] < online["peak_gib"] and offline["gflop"] < online["gflop"]
    assert offline["tokens_per_s_per_chip"] > online["tokens_per_s_per_chip"] > 0
    tcfg, dcfg, _, _ = plan.model_configs(str(golden_dir / "target"))
    b, t, steps = 8, 64, 3
    masked = 3 * 4 * dcfg.num_heads * dcfg.head_dim * b * steps * (t * t - t * (t + 1) / 2)
    readout = 2 * b * t * tcfg.hidden_size * dcfg.draft_vocab_size
    head = (objective.ttt_flops(dcfg, steps, np.full(b, t)) + masked + readout) / 8  # per device
    assert offline["gflop"] * 1e9 == pytest.approx(head, rel=0.1)
    # a rerun with the same --json keeps its rows and adds the missing ones
    assert train_estimate.main([*argv[:3], "8,16", *argv[4:], "--modes", "offline", "--cpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[:2] == [online, offline] and [(r["mode"], r["batch"]) for r in rows[2:]] == [("offline", 16)]


def test_head_race_accounting_by_hand():
    """A process's CPU time as /proc counts it is what Python counts; the CPU hours when a step was first logged."""
    import os
    import time

    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass
    assert head_race.cpu_seconds(os.getpid()) == pytest.approx(time.process_time(), abs=0.05)
    trace = [[10.0, 0], [3600.0, 5], [7200.0, 12]]
    assert head_race.hours_at(trace, 5) == 1.0 and head_race.hours_at(trace, 6) == 2.0
    assert head_race.hours_at(trace, 99) == 2.0  # not logged yet: the last reading
    assert head_race.chain_flags("5/4/1") == ["--total-tokens", "5", "--depth", "4", "--tree-top-k", "1"]
    with pytest.raises(EagleError, match="--chain"):
        head_race.chain_flags("5/4")


def test_head_race_reads_the_budget_calibration(tmp_path):
    """The --auto-budget benchmark's calibration: envelopes named as on the command line, and the fastest one that
    drafts with the head (not plain decoding, not context candidates alone) against plain decoding."""
    (tmp_path / "eagle3").mkdir()
    (tmp_path / "eagle3" / "metrics.jsonl").write_text('{"step": 7}\n')
    chain = {"total_tokens": 5, "depth": 4, "top_k": 1}
    measured = [
        {"tree": None, "tau": 1.0, "tokens_per_s": 50.0},
        {"tree": chain, "tau": 1.4, "tokens_per_s": 40.0},
        {"tree": {**chain, "context": 7, "min_match": 2}, "tau": 1.6, "tokens_per_s": 45.0},
        {"tree": {"context": 7, "min_match": 2}, "tau": 1.3, "tokens_per_s": 60.0},
    ]
    keys = ("tau", "speedup", "c", "tokens_per_s_spec", "tokens_per_s_plain", "mismatches", "n_alpha")
    bench = {
        "tree": measured[3]["tree"],
        "batch": 1,
        "auto_budget": {"measured": {"1": measured}},
        **dict.fromkeys(keys, 1.0),
    }
    (tmp_path / "eagle3" / "bench_budget_step7.json").write_text(json.dumps(bench))
    r = head_race.measure(argparse.Namespace(), tmp_path, "eagle3", "budget", [])
    assert r["envelope"] == "ctx7"
    assert [m["tree"] for m in r["calibration"]] == ["plain", "5/4/1", "5/4/1+ctx7", "ctx7"]
    assert r["best_head"]["tree"] == "5/4/1+ctx7" and r["best_head"]["vs_plain"] == pytest.approx(0.9)
    report = {
        "command": "c",
        "runs": {"eagle3": {"cpu_hours": 1.0, "steps": 7, "last_accuracy": [0.4], "chain": r, "budget": r}},
    }
    assert "5/4/1+ctx7: tau 1.60, 0.90x plain" in head_race.table(report)


# a training loop's stop as the trainers have it: after the step under way, exit code 130
STEPPING_RUN = (
    "import sys, time\n"
    "from eagle_jax.training import loop\n"
    "with loop.stop_between_steps() as stopped:\n"
    "    print('ready', flush=True)\n"
    "    while not stopped():\n"
    "        time.sleep(0.05)\n"
    "sys.exit(130)\n"
)


def test_head_race_stops_a_run_started_from_a_background_job(tmp_path):
    """A run past its budget stops after its step even when it inherited SIGINT ignored (a background job's
    children do): the race must not rely on SIGINT. A run that does not stop is killed after 60 s and fails."""
    from test_train import ROOT

    # the shell ignores SIGINT and execs Python, which inherits that (no preexec_fn: forking a process with
    # threads and running Python in the child is unsafe)
    ignoring = ["sh", "-c", 'trap "" INT; exec "$0" -c "$1"', sys.executable, STEPPING_RUN]
    with subprocess.Popen(ignoring, cwd=ROOT, stdout=subprocess.PIPE, text=True) as proc:
        watchdog = threading.Timer(60, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout.readline() == "ready\n"  # the child's handlers are in place
            ledger = {"eagle3": {"cpu_s": 0.0, "trace": [], "finished": False}}
            with (tmp_path / "log").open("a") as log:
                running = {"eagle3": {"proc": proc, "base": 0.0, "stopping": False, "log": log}}
                head_race.poll(argparse.Namespace(poll=0.1), tmp_path, ledger, running, 0.0, [])
        finally:
            watchdog.cancel()
    assert proc.returncode == 130 and not ledger["eagle3"]["finished"]

"""infer.benchmark on tiny inputs, and the shipped demo pair (speculative greedy == plain greedy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import pytest
from tiny import plain_generate

from eagle_jax.decoding.tree import PLAIN

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
DEMO = ROOT / "demo"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
CONTRACT = ("tau", "speedup", "c", "tokens_per_s_spec", "tokens_per_s_plain", "mismatches")


@pytest.fixture(scope="module")
def golden_with_template(tmp_path_factory) -> Path:
    """The golden target with a chat template added (its tokenizer has none)."""
    d = tmp_path_factory.mktemp("target")
    for f in (GOLDEN / "target").iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_benchmark_writes_contract(golden_with_template, tmp_path):
    from infer import benchmark

    q = tmp_path / "q.jsonl"
    q.write_text(
        json.dumps(
            {
                "question_id": 1,
                "category": "writing",
                "turns": ["Write a short poem about the sea and the sky.", "Now make it rhyme."],
            }
        )
        + "\n"
        + json.dumps({"question_id": 2, "category": "math", "turns": ["What is two plus two times three?"]})
        + "\n"
        + json.dumps({"question_id": 3, "category": "math", "turns": ["Not read: beyond --limit."]})
        + "\n"
    )
    out = tmp_path / "r.json"
    benchmark.main(
        [
            "--questions",
            str(q),
            "--limit",
            "2",
            "--max-new-tokens",
            "6",
            "--max-prompt-tokens",
            "30",
            "--target",
            str(golden_with_template),
            "--draft",
            str(GOLDEN / "eagle3"),
            "--total-tokens",
            "8",
            "--depth",
            "2",
            "--tree-top-k",
            "3",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    r = json.loads(out.read_text())
    for k in CONTRACT:
        assert k in r, k
    assert r["mismatches"] == 0
    assert r["questions"] == 2 and r["turns"] == 3 and r["batch"] == 1
    assert set(r["categories"]) == {"writing", "math"}
    assert r["categories"]["writing"]["turns"] == 2
    for k in CONTRACT:
        assert k in r["categories"]["math"] and k in r["files"]["q"]
    assert r["tau"] >= 1.0 and r["tokens_per_s_spec"] > 0 and r["tokens_per_s_plain"] > 0
    assert r["prefill_ms_spec"] > 0 and r["prefill_ms_plain"] > 0
    assert len(r["n_alpha"]) == 3  # depth 2 -> up to 3 accepted draft tokens
    assert out.with_suffix(".md").read_text().startswith("# Benchmark")
    assert out.with_suffix(".png").stat().st_size > 0


def test_auto_budget_picks_the_fastest_and_saves_a_budget(golden_with_template, tmp_path, monkeypatch):
    """--auto-budget measures plain decoding and the candidates and uses the choice; --save-budget writes them,
    and a head folder holding that budget.json is used without measuring again."""
    from eagle_jax.decoding import budget
    from eagle_jax.decoding.tree import DynamicTree
    from infer import benchmark

    q = tmp_path / "q.jsonl"
    q.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "c", "turns": [f"Question {i} about the sea?"]}) + "\n"
            for i in range(4)
        )
    )
    assert [c["question_id"] for c in benchmark.calibration_questions([q], 2)] == [3, 2]  # not the measured ones
    head = tmp_path / "head"
    shutil.copytree(GOLDEN / "eagle3", head)
    common = [
        "--questions",
        str(q),
        "--limit",
        "2",
        "--max-new-tokens",
        "8",
        "--max-prompt-tokens",
        "30",
        "--target",
        str(golden_with_template),
        "--draft",
        str(head),
        "--quiet",
    ]
    out = tmp_path / "auto.json"
    assert (
        benchmark.main(
            [
                *common,
                "--auto-budget",
                "--calibration-prompts",
                "2",
                "--save-budget",
                str(head / "budget.json"),
                "--budget-batches",
                "1,2",
                "--budget-candidates",
                "8/2/3,4/3/1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    r = json.loads(out.read_text())
    saved = budget.Budget.from_json(json.loads((head / "budget.json").read_text()))
    assert sorted(saved.measured) == [1, 2]
    assert all(
        [m.tree for m in ms] == [PLAIN, DynamicTree(8, 2, 3), DynamicTree(4, 3, 1)] for ms in saved.measured.values()
    )
    fastest = budget.choose(saved.measured[1])  # the rule itself: test_estimates.py
    assert saved.choices[1] == fastest and r["tree"] == (
        None
        if not fastest.drafts
        else {"total_tokens": fastest.total_tokens, "depth": fastest.depth, "top_k": fastest.top_k}
    )
    assert all(m.tau >= 1 for ms in saved.measured.values() for m in ms) and r["mismatches"] == 0

    def refuse(*args, **kwargs):
        raise AssertionError("measured again although the head's budget.json fits this machine")

    monkeypatch.setattr(budget, "calibrate", refuse)
    again = tmp_path / "again.json"
    assert benchmark.main([*common, "--batch", "2", "--json", str(again)]) == 0
    assert json.loads(again.read_text())["tree"] == (
        None
        if not saved.choices[2].drafts
        else {
            "total_tokens": saved.choices[2].total_tokens,
            "depth": saved.choices[2].depth,
            "top_k": saved.choices[2].top_k,
        }
    )


def test_warm_up_compiles_every_span(golden_with_template):
    """After `Runner.warm`, timed runs of any prompts in the bucket compile nothing, across spans."""
    from cli.timing import Runner
    from eagle_jax.decoding import programs, schedule
    from eagle_jax.decoding.tree import DynamicTree

    runner = Runner(golden_with_template, GOLDEN / "eagle3", 0.0, 200, 30)
    runner.set_tree(DynamicTree(8, 3, 2))
    ids = runner.prompt([{"role": "user", "content": "Tell me about the sea."}])
    assert len(schedule.all_spans(runner.prepare([ids], 200).capacity)) >= 2
    runner.warm([ids])
    before = set(programs._COMPILED)
    for prompt in (ids, ids[:-2]):
        assert runner.plain([prompt])["tokens"] == runner.speculative([prompt])["tokens"]
    assert set(programs._COMPILED) == before


def test_questions_with_schemas_regexes_and_choices_are_answered_under_them(tmp_path):
    """A question's `schema`, `regex` or `choice` constrains both decoders' answers to it (on the demo pair, whose
    tokenizer llguidance reads): the answers follow it and speculation changes none."""
    from infer import benchmark

    q = tmp_path / "q.jsonl"
    lines = [
        {"question_id": 1, "turns": ["Is tea hot?"], "choice": ["yes, it is", "no"]},
        {"question_id": 2, "turns": ["A number?"], "regex": "[0-9]{3}"},
        {"question_id": 3, "turns": ["Name a drink."], "schema": {"type": "object", "properties": {
            "drink": {"enum": ["tea", "coffee"]}}, "required": ["drink"], "additionalProperties": False}},
        {"question_id": 4, "turns": ["Say something."]},
    ]  # fmt: skip
    q.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "r.json"
    args = ["--questions", q, "--max-new-tokens", 16, "--target", DEMO / "target", "--draft", DEMO / "eagle3"]
    args += ["--total-tokens", 8, "--depth", 3, "--tree-top-k", 2, "--context", 3, "--batch", 2, "--json", out]
    benchmark.main([*map(str, args), "--quiet", "--save-outputs"])
    r = json.loads(out.read_text())
    assert r["mismatches"] == 0 and r["turns"] == 4
    answers = {o["question_id"]: o for o in r["outputs"]}
    assert [answers[i]["constraint"] for i in (1, 2, 3, 4)] == ["choice", "regex", "json_schema", None]
    assert answers[1]["answer"] in ("yes, it is", "no")
    assert len(answers[2]["answer"]) == 3 and answers[2]["answer"].isdigit()
    assert json.loads(answers[3]["answer"]) in ({"drink": "tea"}, {"drink": "coffee"})


def test_read_questions_errors(tmp_path):
    from cli.timing import read_questions
    from eagle_jax.errors import EagleError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": "not a list"}\n')
    with pytest.raises(EagleError, match="turns"):
        read_questions(bad, None)
    with pytest.raises(EagleError, match="not found"):
        read_questions(tmp_path / "missing.jsonl", None)
    for line, message in (
        ({"turns": ["x"], "schema": [1]}, r"bad\.jsonl:1: bad schema: a JSON schema must be an object"),
        ({"turns": ["x"], "regex": "("}, r"bad\.jsonl:1: bad regex: invalid regex"),
        ({"turns": ["x"], "choice": "ab"}, r"bad\.jsonl:1: bad choice: choice must be a non-empty list"),
        ({"turns": ["x"], "regex": "a", "choice": ["a"]}, r"bad\.jsonl:1: one constraint per question"),
    ):
        bad.write_text(json.dumps(line) + "\n")
        with pytest.raises(EagleError, match=message):
            read_questions(bad, None)


def test_demo_pair_lossless():
    from transformers import AutoTokenizer

    from eagle_jax.decoding import generation, speculative
    from eagle_jax.decoding.tree import DynamicTree
    from eagle_jax.io.loading import load_draft, load_target

    tcfg, tparams = load_target(DEMO / "target")
    dcfg, dparams = load_draft(DEMO / "eagle3", tcfg)
    tok = AutoTokenizer.from_pretrained(str(DEMO / "target"))
    assert tok.chat_template and tok.eos_token_id in tcfg.eos_token_ids
    text = tok.apply_chat_template(
        [{"role": "user", "content": "How do I make a cup of tea?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    plain = plain_generate(tparams, tcfg, [ids], 64)
    for tree in (
        DynamicTree(total_tokens=5, depth=3, top_k=1),
        DynamicTree(total_tokens=16, depth=4, top_k=4),
    ):  # the demo's chain, a tree
        spec = generation.generate(tparams, dparams, [ids], 64, speculative.DecodeConfig(tcfg, dcfg, tree))
        assert spec.tokens[0] == plain.tokens[0]
        assert spec.tau > 2.0  # the trained head gets most drafts accepted


# ---------------------------------------------------------------- bad input: one line, exit code 2, no file changed

BAD_INPUT = {
    "--limit 0": (["--limit", "0"], "--limit must be >= 1"),
    "--budget-batches x": (["--budget-batches", "1,x"], "--budget-batches '1,x': expected batch sizes >= 1"),
    "--budget-batches 0": (["--budget-batches", "0"], "expected batch sizes >= 1"),
    "--budget-candidates bad": (["--budget-candidates", "5/4"], "--budget-candidates: bad tree envelope '5/4'"),
    "--max-prompt-tokens 0": (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
    "--max-prompt-tokens -5": (["--max-prompt-tokens", "-5"], "--max-prompt-tokens must be >= 1"),
    "--json not .json (the .md would overwrite it)": (["--json", "{tmp}/report.md"], "name a .json file"),
    "--json a folder": (["--json", "{tmp}/folder.json"], "is a folder"),
    "--json the questions": (["--json", "{tmp}/q.json"], "is also an input"),
    "--json a user's file": (["--json", "{tmp}/mine.json"], "was not written by this command"),
    "derived .md is a user's file": (["--json", "{tmp}/notes.json"], "notes.md: exists and was not written"),
    "--json under a file": (["--json", "{tmp}/mine.json/r.json"], "cannot create its folder"),
    "--save-budget the report": (
        ["--json", "{tmp}/r.json", "--auto-budget", "--save-budget", "{tmp}/r.json"],
        "is also a report path",
    ),
}


@pytest.fixture
def bad_input_dir(tmp_path) -> Path:
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"question_id": 1, "turns": ["Hello?"]}) + "\n")
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "mine.json").write_text('{"mine": true}\n')
    (tmp_path / "notes.md").write_text("my notes\n")
    return tmp_path


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line(case, bad_input_dir, capsys):
    from badinput import assert_refused, snapshot

    from infer import benchmark

    args, expected = BAD_INPUT[case]
    args = [a.format(tmp=bad_input_dir) for a in args]
    if "--json" not in args:
        args += ["--json", str(bad_input_dir / "r.json")]
    before = snapshot(bad_input_dir)
    code = benchmark.main(["--questions", str(bad_input_dir / "q.json"), *args, "--quiet"])
    assert_refused(code, capsys.readouterr().err, expected)
    assert snapshot(bad_input_dir) == before


def test_reports_of_an_earlier_run_are_recognised(tmp_path):
    from infer import benchmark

    out = tmp_path / "r.json"
    report = {"tau": 1.0, "speedup": 1.0, "n_alpha": []}
    out.write_text(json.dumps(report))
    out.with_suffix(".md").write_text(benchmark.MD_HEAD)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.savefig(out.with_suffix(".png"), metadata={"Title": benchmark.PNG_TITLE})
    plt.close(fig)
    for path, ours in zip((out, out.with_suffix(".md"), out.with_suffix(".png")), benchmark.REPORTS):
        assert ours(path), path


def test_an_unwritable_report_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """The permission check itself (os.access is stubbed: root may write anywhere, so no real read-only folder)."""
    from infer import benchmark

    (tmp_path / "q.jsonl").write_text('{"turns": ["hi"]}\n')
    monkeypatch.setattr("eagle_jax.io.files.os.access", lambda path, mode: False)
    code = benchmark.main(["--questions", str(tmp_path / "q.jsonl"), "--json", str(tmp_path / "r.json"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "not writable" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.jsonl"]


def test_profile_names_where_the_cycle_spends_its_time(tmp_path, capsys):
    """instruments.profile on the demo pair: the traced ops land in the named phases (not in 'other'), the census
    counts ops, forward widths are timed, and the flops floor lies under the measured cycle."""
    from instruments import profile

    out = tmp_path / "profile.json"
    args = ["--total-tokens", "8", "--depth", "3", "--tree-top-k", "2", "--prompt-len", "16", "--new-tokens", "12"]
    assert profile.main([*args, "--widths", "1,4", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    phases = r["phases_ms"]
    assert sum(phases.values()) == pytest.approx(r["cycle_ms"], rel=1e-6)
    assert all(phases[name] > 0 for name in ("draft_levels", "verify", "draft_catch_up"))
    assert phases["other"] < 0.2 * r["cycle_ms"], phases
    assert sum(r["cycle_ops"].values()) > 0 and r["plain_step_ops"]["dot"] > 0
    assert set(r["forward_ms_by_width"]) == {"1", "4"} and min(r["forward_ms_by_width"].values()) > 0
    assert "target forward over T tokens per row (x one token)" in capsys.readouterr().out
    # the floor: this cycle's flops at the machine's best matmul rate, below what the cycle took and what c is
    assert r["cycle_mflop"] > r["plain_step_mflop"] > 0 and r["matmul_gflops"] > 0
    assert r["cycle_floor_ms"] == pytest.approx(r["cycle_mflop"] / r["matmul_gflops"], rel=1e-6)
    assert 0 < r["cycle_floor_ms"] < r["cycle_ms"] and r["c_floor"] < r["c"]
    assert r["c_floor"] == pytest.approx(r["cycle_floor_ms"] / r["plain_step_ms"] - 1, rel=1e-6)


# The compiled cycle's op census on the golden pair at 5/4/1 (8 target layers), as XLA:CPU compiles it today: one
# op more per target layer, a copy more per cycle, or a copy of a whole KV cache fails here. The cycle's time on a
# latency-bound target follows its op count (each op is a dispatched kernel), so this catches a slower cycle where
# timings on a shared machine cannot. (Writing each cycle's tokens into the rows' history, which context drafts
# read, took it from 519 ops and 19 copies.)
CYCLE_OPS, CYCLE_COPIES = 528, 23


def _compiled_cycle(golden_dir, golden_target, tree):
    """The golden pair's compiled cycle loop for `tree`, and the shape of its KV cache as the HLO writes it."""
    from eagle_jax.decoding import speculative
    from eagle_jax.decoding.sampling import SamplingConfig
    from eagle_jax.io import loading

    tcfg, tparams = golden_target
    dcfg, dparams = loading.load_draft(golden_dir / "eagle3", tcfg) if tree.needs_head else (None, None)
    cfg = speculative.DecodeConfig(tcfg, dcfg, tree, SamplingConfig())
    p = speculative.prepare([[5, 6, 7, 8, 9, 10]], 16, cfg)
    key = jax.random.key(0)
    state = speculative.prefill(tparams, dparams, p.tokens, p.lengths, p.limits, key, cfg=cfg, capacity=p.capacity)
    lowered = speculative.run_span.lower(tparams, dparams, state, cfg=cfg, span=p.capacity)
    compiled = lowered.compile()
    return compiled, "f32[" + ",".join(map(str, state.target_cache.k.shape)) + "]"


def _whole_cache_copies(compiled, cache: str) -> list[str]:
    return [line for line in compiled.as_text().splitlines() if f"= {cache}" in line and " copy(" in line]


def test_the_cycle_keeps_its_op_census(golden_dir, golden_target):
    from eagle_jax.decoding.tree import DynamicTree
    from instruments import profiling

    compiled, cache = _compiled_cycle(golden_dir, golden_target, DynamicTree(5, 4, 1))
    census = profiling.op_census(compiled)
    total = sum(census.values())
    assert total < CYCLE_OPS + golden_target[0].num_layers, f"the cycle has {total} ops (was {CYCLE_OPS}): {census}"
    assert census.get("copy", 0) <= CYCLE_COPIES, f"the cycle has {census.get('copy')} copies (was {CYCLE_COPIES})"
    whole = _whole_cache_copies(compiled, cache)
    assert not whole, f"the cycle copies a whole KV cache: {whole[:2]}"


def test_a_context_cycle_copies_no_cache(golden_dir, golden_target):
    """The cond between the whole tree and its head's part only reads the caches (written in a branch, XLA
    copied them whole, twice a cycle: 40% of a SmolLM2 plain step at a 1024-slot cache)."""
    from eagle_jax.decoding.tree import DynamicTree, NoDraft

    for tree in (NoDraft(context=7), DynamicTree(5, 4, 1, context=7)):
        compiled, cache = _compiled_cycle(golden_dir, golden_target, tree)
        assert " conditional(" in compiled.as_text()
        whole = _whole_cache_copies(compiled, cache)
        assert not whole, f"{tree}: the cycle copies a whole KV cache: {whole[:2]}"

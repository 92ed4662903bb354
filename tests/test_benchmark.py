"""infer.benchmark on tiny inputs, and the shipped demo pair (speculative greedy == plain greedy)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

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
    assert r["questions"] == 2 and r["turns"] == 3
    assert set(r["categories"]) == {"writing", "math"}
    assert r["categories"]["writing"]["turns"] == 2
    for k in CONTRACT:
        assert k in r["categories"]["math"] and k in r["files"]["q"]
    assert r["tau"] >= 1.0 and r["tokens_per_s_spec"] > 0 and r["tokens_per_s_plain"] > 0
    assert r["prefill_ms_spec"] > 0 and r["prefill_ms_plain"] > 0
    assert len(r["n_alpha"]) == 3  # depth 2 -> up to 3 accepted draft tokens
    assert out.with_suffix(".md").read_text().startswith("# Benchmark")
    assert out.with_suffix(".png").stat().st_size > 0


def test_auto_budget_picks_the_fastest_tree(golden_with_template, tmp_path, monkeypatch):
    from infer import benchmark

    q = tmp_path / "q.jsonl"
    q.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "c", "turns": [f"Question {i} about the sea?"]}) + "\n"
            for i in range(4)
        )
    )
    args = benchmark.parse_args(["--questions", str(q), "--limit", "2", "--calibration-prompts", "2"])
    assert [c["question_id"] for c in benchmark.calibration_questions([q], args)] == [3, 2]  # not the measured ones
    monkeypatch.setattr(benchmark, "AUTO_CANDIDATES", ((8, 2, 3), (12, 3, 2)))
    out = tmp_path / "auto.json"
    benchmark.main(
        [
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
            str(GOLDEN / "eagle3"),
            "--auto-budget",
            "--calibration-prompts",
            "2",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    r = json.loads(out.read_text())
    rows = r["auto_budget"]["candidates"]
    fastest = max(rows, key=lambda row: row["tokens_per_s"])
    chosen = {k: fastest[k] for k in ("total_tokens", "depth", "top_k")}
    assert r["auto_budget"]["chosen"] == chosen == r["tree"]
    assert all(row["tau"] >= 1 and row["verify_ms"] > 0 for row in rows)
    assert set(r["auto_budget"]["target_forward_ms"]) == {"1", "8", "12"}
    assert r["mismatches"] == 0


def test_warm_up_compiles_every_span(golden_with_template):
    """After `Runner.warm`, timed runs of any prompt in the bucket compile nothing, across spans."""
    from eagle_jax.decoding import plain as gen
    from eagle_jax.decoding import schedule, speculative
    from infer.benchmark import Runner

    runner = Runner(golden_with_template, GOLDEN / "eagle3", (8, 3, 2), 0.0, 200, 30)
    ids = runner.prompt([{"role": "user", "content": "Tell me about the sea."}])
    assert len(schedule.all_spans(runner.capacity_for(len(ids)))) >= 2
    runner.warm(ids)
    programs = (gen.prefill, gen.decode_span, speculative.prefill, speculative.run_span)
    before = [f._cache_size() for f in programs]
    for prompt in (ids, ids[:-2]):
        assert runner.plain(prompt)["tokens"] == runner.speculative(prompt)["tokens"]
    assert [f._cache_size() for f in programs] == before


def test_read_questions_errors(tmp_path):
    from eagle_jax.errors import EagleError
    from infer.benchmark import read_questions

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1, "turns": "not a list"}\n')
    with pytest.raises(EagleError, match="turns"):
        read_questions(bad, None)
    with pytest.raises(EagleError, match="not found"):
        read_questions(tmp_path / "missing.jsonl", None)


def test_demo_pair_lossless():
    from transformers import AutoTokenizer

    from cli.demo import TREE as DEMO_TREE
    from eagle_jax.decoding import speculative
    from eagle_jax.decoding.plain import generate
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
    plain = generate(tparams, tcfg, [ids], 64)
    for tree in (DEMO_TREE, DynamicTree(total_tokens=16, depth=4, top_k=4)):  # the demo's chain, a tree
        spec = speculative.generate(tparams, tcfg, dparams, dcfg, [ids], 64, tree)
        assert spec.tokens[0] == plain.tokens[0]
        assert spec.tau > 2.0  # the trained head gets most drafts accepted

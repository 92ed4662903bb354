"""`python -m infer.demo` on the tiny demo pair (no SmolLM2 in the tests' cache): every case is answered by both
modes with identical token ids, a structured case under its JSON schema."""

from __future__ import annotations

import json

from infer import demo


def test_the_demo_answers_every_case_identically_and_structured_output_follows_its_schema(capsys, monkeypatch):
    yes_no = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"]}
    cases = (demo.CASES[0], demo.Case("structured", ("Is tea hot?",), {**yes_no, "additionalProperties": False}))
    monkeypatch.setattr(demo, "CASES", cases)
    assert demo.main(["--max-new-tokens", "12"]) == 0  # 1 when an answer differs
    out = capsys.readouterr().out
    assert out.count("outputs identical") == 2 and "OUTPUTS DIFFER" not in out
    answer = out.split("> Is tea hot?\n")[1].splitlines()[0]
    assert json.loads(answer) in ({"ok": "yes"}, {"ok": "no"}) and "[valid JSON under its schema]" in out

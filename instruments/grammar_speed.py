"""Structured output's speed: constrained speculative vs constrained plain decoding, and the masks' cost.

Over the extraction prompts with JSON schemas (data/grammar/extraction.jsonl, in the chat template), batch 1,
greedy, on the engine, after an untimed answer to the first prompt (compilation): for each envelope, constrained
speculative decoding against constrained plain decoding (tokens/s ratio, mismatching answers), constrained plain
against unconstrained plain decoding per token (the masks' cost), tau split by where the accepted drafts came from
(forced chains, context candidates, the head's tree), and the host's share of a cycle (masks and forced chains).
Prints a markdown table and writes JSON.

    python -m instruments.grammar_speed --target ~/.cache/eagle-jax/smollm2 --draft demo/smollm2-eagle3 \
        --out results/grammar
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import jsonschema

from cli.timing import read_questions
from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.grammar import Grammars, Matcher
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree, NoDraft, TreeConfig, envelope_name
from eagle_jax.io import loading

ENVELOPES = (NoDraft(context=7), DynamicTree(8, 3, 2, context=7))


class Probe:
    """Counts the host's grammar work and records each cycle's tree and forced chain (wrapping `Matcher`)."""

    def __init__(self):
        self.host_s, self.trees, self.forced = 0.0, [], []
        self._masks, self._forced = Matcher.tree_masks, Matcher.forced

    def __enter__(self):
        probe = self

        def tree_masks(m, tokens, parents):
            t0 = time.perf_counter()
            out = probe._masks(m, tokens, parents)
            probe.host_s += time.perf_counter() - t0
            probe.trees.append((tokens, parents))
            return out

        def forced(m, k):
            t0 = time.perf_counter()
            out = probe._forced(m, k)
            probe.host_s += time.perf_counter() - t0
            probe.forced.append(len(out) > 0)
            return out

        Matcher.tree_masks, Matcher.forced = tree_masks, forced
        return self

    def __exit__(self, *exc):
        Matcher.tree_masks, Matcher.forced = self._masks, self._forced


def answer(engine: Engine, prompt: list[int], max_tokens: int, matcher: Matcher | None) -> tuple[list[list[int]], str]:
    """The tokens of each cycle and the finish of one answer."""
    engine.admit(0, prompt, max_tokens, grammar=matcher)
    cycles, finish = [], None
    while engine.live:
        for step in engine.cycle():
            cycles.append(step.tokens)
            finish = step.finish
    return cycles, finish


def sources(cycles: list[list[int]], probe: Probe, tree: TreeConfig) -> dict[str, int]:
    """Accepted drafts by origin: a head node (index < head_nodes), else a candidate slot holding a forced chain
    (when the grammar forced one that cycle) or a context candidate."""
    counts = {"forced": 0, "context": 0, "head": 0}
    for i, ((tokens, parents), forced) in enumerate(zip(probe.trees, probe.forced, strict=True)):
        node = 0
        for token in cycles[i][1:]:  # the cycle's accepted drafts (after its root)
            kids = [j for j in range(1, len(tokens)) if parents[j] == node and tokens[j] == token]
            if not kids:
                break
            node = kids[0]
            counts["head" if node < tree.head_nodes else "forced" if forced else "context"] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default="data/grammar/extraction.jsonl")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    target_dir = Path(args.target).expanduser()
    tcfg, tparams = loading.load_target(target_dir, jnp.float32)
    dcfg, dparams = loading.load_draft(Path(args.draft), tcfg, dtype=jnp.float32)
    tok = loading.load_tokenizer(target_dir)
    t0 = time.perf_counter()
    grammars = Grammars(tok, tcfg.vocab_size, tcfg.eos_token_ids)
    prepare_s = time.perf_counter() - t0
    items = read_questions(Path(args.prompts), None)
    prompts = [loading.encode_chat(tok, [{"role": "user", "content": it["turns"][0]}]) for it in items]
    constraints = [it["constraint"] for it in items]
    t0 = time.perf_counter()
    for c in constraints:
        grammars.check(c)
    compile_ms = (time.perf_counter() - t0) / len(constraints) * 1e3
    engines = {PLAIN: Engine(tparams, None, DecodeConfig(tcfg), 1, 512)}
    engines |= {e: Engine(tparams, dparams if e.needs_head else None, DecodeConfig(tcfg, dcfg, e), 1, 512)
                for e in ENVELOPES}  # fmt: skip

    def run(tree: TreeConfig, constrained: bool, limit: int | None = None) -> dict:
        """One pass over the (first `limit`) prompts: tokens, seconds, cycles, drafts by origin, host seconds."""
        out = {"tokens": [], "seconds": 0.0, "cycles": 0, "host_s": 0.0, "valid": 0}
        out |= {"forced": 0, "context": 0, "head": 0}
        print(f"{envelope_name(tree)} {'constrained' if constrained else 'free'}", file=sys.stderr, flush=True)
        for prompt, c in list(zip(prompts, constraints, strict=True))[:limit]:
            with Probe() as probe:
                t0 = time.perf_counter()
                matcher = grammars.matcher(c) if constrained else None
                cycles, finish = answer(engines[tree], prompt, args.max_tokens, matcher)
                out["seconds"] += time.perf_counter() - t0
            tokens = [t for cycle in cycles for t in cycle]
            out["tokens"].append(tokens)
            out["cycles"] += len(cycles)
            out["host_s"] += probe.host_s
            if constrained and tree.drafts:
                for k, v in sources(cycles, probe, tree).items():
                    out[k] += v
            if constrained and finish == "stop":
                try:
                    jsonschema.validate(json.loads(tok.decode(tokens[:-1])), json.loads(c.text))
                    out["valid"] += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        return out

    settings = [(PLAIN, False), (PLAIN, True), *((e, True) for e in ENVELOPES)]
    for tree, constrained in settings:  # compile the programs the timed pass runs
        run(tree, constrained, 1)
    results = {(envelope_name(t), c): run(t, c) for t, c in settings}
    rate = lambda r: sum(map(len, r["tokens"])) / r["seconds"]  # noqa: E731
    free, plain = results[("plain", False)], results[("plain", True)]
    rows = []
    for tree in ENVELOPES:
        r = results[(envelope_name(tree), True)]
        n = sum(map(len, r["tokens"]))
        rows.append(
            {
                "envelope": envelope_name(tree),
                "speedup_vs_constrained_plain": rate(r) / rate(plain),
                "mismatching_answers": sum(a != b for a, b in zip(r["tokens"], plain["tokens"], strict=True)),
                "tau": n / r["cycles"],
                "tau_forced": r["forced"] / r["cycles"],
                "tau_context": r["context"] / r["cycles"],
                "tau_head": r["head"] / r["cycles"],
                "host_ms_per_cycle": r["host_s"] / r["cycles"] * 1e3,
                "cycle_ms": r["seconds"] / r["cycles"] * 1e3,
                "valid_answers": r["valid"],
            }
        )
    doc = {
        "prompts": len(prompts),
        "tokens_constrained_plain": sum(map(len, plain["tokens"])),
        "constrained_plain_vs_free_plain_per_token": rate(plain) / rate(free),
        "valid_answers_constrained_plain": plain["valid"],
        "tokenizer_prepare_s": prepare_s,
        "schema_compile_ms": compile_ms,
        "envelopes": rows,
    }
    print(
        f"{len(prompts)} prompts, {doc['tokens_constrained_plain']} tokens (constrained plain, "
        f"{plain['valid']}/{len(prompts)} valid); constrained plain / free plain per token: "
        f"{doc['constrained_plain_vs_free_plain_per_token']:.2f}x; tokenizer prepared in {prepare_s:.2f} s, "
        f"a schema compiles in {compile_ms:.1f} ms\n"
    )
    print("| envelope | speedup vs constrained plain | mismatches | tau | forced | context | head | host ms / cycle "
          "| cycle ms | valid |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['envelope']} | {r['speedup_vs_constrained_plain']:.2f}x | {r['mismatching_answers']} "
            f"| {r['tau']:.2f} | {r['tau_forced']:.2f} | {r['tau_context']:.2f} | {r['tau_head']:.2f} "
            f"| {r['host_ms_per_cycle']:.2f} | {r['cycle_ms']:.1f} | {r['valid_answers']}/{len(prompts)} |"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "grammar_speed.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

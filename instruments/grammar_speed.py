"""Structured output's speed: constrained speculative vs constrained plain decoding, and the masks' cost.

Over the extraction prompts with JSON schemas (data/grammar/extraction.jsonl, in the chat template), in batches
of `--batch` rows (default 1), greedy, on the engine, after an untimed pass (compilation): for each
envelope, constrained speculative decoding against constrained plain decoding (tokens/s ratio, mismatching
answers), constrained plain against unconstrained plain decoding per token (the masks' cost), tau split by where
the accepted drafts came from (forced chains, context candidates, the head's tree), and the host's share of a
cycle (masks and forced chains).
Prints a markdown table and writes JSON.

    python -m instruments.grammar_speed --target ~/.cache/eagle-jax/smollm2 --draft demo/smollm2-eagle3 \
        --out results/grammar [--batch 4]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import jsonschema

from cli.timing import read_questions
from eagle_jax.decoding import grammar
from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.grammar import Grammars, Matcher
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, TreeConfig, envelope_name, parse_envelopes
from eagle_jax.io import loading

ENVELOPES = "ctx7,8/3/2+ctx7"


class Probe:
    """Counts the host's grammar work (masks, forced chains) and records, per row and cycle, the tree and whether
    the grammar drafted a forced chain into its candidate slots, at the root or after the head's path."""

    def __init__(self):
        self.host_s = 0.0
        self.trees: dict[int, list] = collections.defaultdict(list)  # id(matcher) -> each cycle's (tokens, parents)
        self.forced: dict[int, list] = collections.defaultdict(list)  # id(matcher) -> whether it forced a chain
        self._pending: set[int] = set()  # matchers that forced a chain in the cycle under way
        self._saved = Matcher.tree_masks, Matcher.forced, Matcher.path_chain, grammar.forced_chains

    def __enter__(self):
        probe = self
        masks, forced, path_chain, forced_chains = self._saved

        def timed(fn):
            def run(*args):
                t0 = time.perf_counter()
                out = fn(*args)
                probe.host_s += time.perf_counter() - t0
                return out

            return run

        def tree_masks(m, tokens, parents):  # once per row and cycle, on its final tree
            probe.trees[id(m)].append((tokens, parents))
            probe.forced[id(m)].append(id(m) in probe._pending)
            probe._pending.discard(id(m))
            return timed(masks)(m, tokens, parents)

        def noted(m, k):
            out = forced(m, k)
            if out:
                probe._pending.add(id(m))
            return out

        Matcher.tree_masks, Matcher.forced, Matcher.path_chain = tree_masks, noted, timed(path_chain)
        grammar.forced_chains = timed(forced_chains)
        return self

    def __exit__(self, *exc):
        Matcher.tree_masks, Matcher.forced, Matcher.path_chain, grammar.forced_chains = self._saved


def answers(
    engine: Engine, prompts: list[list[int]], max_tokens: int, matchers: list[Matcher | None]
) -> list[tuple[list[list[int]], str]]:
    """The tokens of each cycle and the finish of each row's answer, the rows decoded side by side."""
    engine.admit_many(dict(enumerate(prompts)), max_tokens, grammar_of={i: m for i, m in enumerate(matchers) if m})
    out: list[tuple[list[list[int]], str]] = [([], "length") for _ in prompts]
    while engine.live:
        for step in engine.cycle():
            out[step.slot][0].append(step.tokens)
            out[step.slot] = (out[step.slot][0], step.finish or out[step.slot][1])
    return out


def sources(cycles: list[list[int]], trees: list, forced_at: list, tree: TreeConfig) -> dict[str, int]:
    """Accepted drafts by origin: a head node (index < head_nodes), else a candidate slot holding a forced chain
    (when the grammar forced one that cycle) or a context candidate."""
    counts = {"forced": 0, "context": 0, "head": 0}
    for i, ((tokens, parents), forced) in enumerate(zip(trees, forced_at, strict=True)):
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
    ap.add_argument("--batch", type=int, default=1, help="rows decoded side by side (default 1)")
    ap.add_argument("--envelopes", default=ENVELOPES, help=f"speculative envelopes to time (default {ENVELOPES})")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    envelopes = parse_envelopes(args.envelopes)
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
    engines = {PLAIN: Engine(tparams, None, DecodeConfig(tcfg), args.batch, 512)}
    engines |= {e: Engine(tparams, dparams if e.needs_head else None, DecodeConfig(tcfg, dcfg, e), args.batch, 512)
                for e in envelopes}  # fmt: skip
    n = len(prompts)  # batches of args.batch prompts, the last one filled from the first prompts
    batches = [[(i + k) % n for k in range(args.batch)] for i in range(0, n, args.batch)]

    def run(tree: TreeConfig, constrained: bool, limit: int | None = None) -> dict:
        """One pass over the (first `limit`) batches: tokens, seconds, cycles (per row and per batch), drafts by
        origin, host seconds."""
        out = {"tokens": [], "seconds": 0.0, "cycles": 0, "batch_cycles": 0, "host_s": 0.0, "valid": 0}
        out |= {"forced": 0, "context": 0, "head": 0}
        print(f"{envelope_name(tree)} {'constrained' if constrained else 'free'}", file=sys.stderr, flush=True)
        for batch in batches[:limit]:
            with Probe() as probe:
                t0 = time.perf_counter()
                matchers = [grammars.matcher(constraints[i]) if constrained else None for i in batch]
                rows = answers(engines[tree], [prompts[i] for i in batch], args.max_tokens, matchers)
                out["seconds"] += time.perf_counter() - t0
            out["host_s"] += probe.host_s
            out["batch_cycles"] += max(len(cycles) for cycles, _ in rows)
            for i, m, (cycles, finish) in zip(batch, matchers, rows, strict=True):
                tokens = [t for cycle in cycles for t in cycle]
                out["tokens"].append(tokens)
                out["cycles"] += len(cycles)
                if constrained and tree.drafts:
                    for k, v in sources(cycles, probe.trees[id(m)], probe.forced[id(m)], tree).items():
                        out[k] += v
                if constrained and finish == "stop":
                    try:
                        jsonschema.validate(json.loads(tok.decode(tokens[:-1])), json.loads(constraints[i].text))
                        out["valid"] += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
        return out

    settings = [(PLAIN, False), (PLAIN, True), *((e, True) for e in envelopes)]
    first_s = {}  # the first batch of each setting, which compiles its programs (and prepares its schemas)
    for tree, constrained in settings:
        first_s[(envelope_name(tree), constrained)] = run(tree, constrained, 1)["seconds"]
        run(tree, constrained)  # every batch once, untimed: rows that end at other times run other row counts
    results = {(envelope_name(t), c): run(t, c) for t, c in settings}
    rate = lambda r: sum(map(len, r["tokens"])) / r["seconds"]  # noqa: E731
    step = lambda r: r["seconds"] / r["batch_cycles"]  # noqa: E731
    free, plain = results[("plain", False)], results[("plain", True)]
    rows = []
    for tree in envelopes:
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
                "host_ms_per_cycle": r["host_s"] / r["batch_cycles"] * 1e3,
                "cycle_ms": r["seconds"] / r["batch_cycles"] * 1e3,
                "valid_answers": r["valid"],
                "first_batch_s": first_s[(envelope_name(tree), True)],
            }
        )
    answered = len(plain["tokens"])  # prompts, and repeats filling the last batch
    doc = {
        "batch": args.batch,
        "prompts": len(prompts),
        "answers": answered,
        "tokens_constrained_plain": sum(map(len, plain["tokens"])),
        "constrained_plain_vs_free_plain_per_token": rate(plain) / rate(free),
        # per step of the batch (answers of other lengths leave other numbers of rows idle: per token differs)
        "constrained_plain_step_vs_free_plain_step": step(plain) / step(free),
        "valid_answers_constrained_plain": plain["valid"],
        "tokenizer_prepare_s": prepare_s,
        "schema_compile_ms": compile_ms,
        "first_batch_s": {f"{name} {'constrained' if c else 'free'}": v for (name, c), v in first_s.items()},
        "envelopes": rows,
    }
    print(
        f"batch {args.batch}: {answered} answers to {len(prompts)} prompts, {doc['tokens_constrained_plain']} tokens "
        f"(constrained plain, {plain['valid']}/{answered} valid); constrained plain / free plain per token: "
        f"{doc['constrained_plain_vs_free_plain_per_token']:.2f}x (a step takes "
        f"{doc['constrained_plain_step_vs_free_plain_step']:.2f}x a free one); "
        f"tokenizer prepared in {prepare_s:.2f} s, a schema compiles in {compile_ms:.1f} ms; "
        "the first batch (compiling its programs) took "
        + ", ".join(f"{k} {v:.1f} s" for k, v in doc["first_batch_s"].items())
        + "\n"
    )
    print("| envelope | speedup vs constrained plain | mismatches | tau | forced | context | head | host ms / cycle "
          "| cycle ms | valid |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['envelope']} | {r['speedup_vs_constrained_plain']:.2f}x | {r['mismatching_answers']} "
            f"| {r['tau']:.2f} | {r['tau_forced']:.2f} | {r['tau_context']:.2f} | {r['tau_head']:.2f} "
            f"| {r['host_ms_per_cycle']:.2f} | {r['cycle_ms']:.1f} | {r['valid_answers']}/{answered} |"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = "grammar_speed.json" if args.batch == 1 else f"grammar_speed_b{args.batch}.json"
        (Path(args.out) / name).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

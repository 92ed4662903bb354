"""Grammar engines compared for structured output: llguidance, xgrammar, outlines-core.

For each schema of an extraction set (data/grammar/extraction.jsonl) and a tokenizer (SmolLM2's 49152 tokens by
default), it measures the one-time tokenizer preparation, the time to compile the schema, and the time per
next-token mask (median and 99th percentile) along a valid answer (a canonical instance of the schema, compact
JSON, tokenized by the tokenizer), plus what a draft tree needs: rollback (or cheap state copies) and forced
tokens. Prints a markdown table and writes JSON.

    pip install -e '.[grammar-bench]'   # xgrammar and outlines-core (llguidance is a dependency)
    python -m instruments.grammar_bench --tokenizer ~/.cache/eagle-jax/smollm2 --out results/grammar
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from eagle_jax.io.loading import load_tokenizer


def instance(schema: dict):
    """A small valid instance of a schema (the first enum value, 1 for integers, 'x' for strings, one item)."""
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type")
    if kind == "object":
        return {k: instance(v) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [instance(schema["items"])]
    return {"integer": 1, "number": 1.5, "boolean": True, "null": None}.get(kind, "x")


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _summary(times: list[float]) -> dict:
    ms = sorted(t * 1e3 for t in times)
    return {"median_ms": statistics.median(ms), "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))]}


def bench_llguidance(tok, schemas: list[dict], answers: list[list[int]]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    prep, lt = _timed(lambda: llguidance.hf.from_tokenizer(tok))
    compiles, masks, forced = [], [], 0
    bitmask = lln.allocate_token_bitmask(1, lt.vocab_size)
    for schema, ids in zip(schemas, answers, strict=True):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        t, m = _timed(lambda g=grammar: llguidance.LLMatcher(lt, g))
        compiles.append(t)
        for i in ids:
            masks.append(_timed(lambda m=m: lln.fill_next_token_bitmask(m, bitmask, 0))[0])
            forced += len(m.compute_ff_tokens()) > 0
            assert m.consume_token(i), m.get_error()
        assert m.is_accepting()
    return {"prepare_s": prep, "compile": _summary(compiles), "mask": _summary(masks), "forced_positions": forced}


def bench_xgrammar(tok, schemas: list[dict], answers: list[list[int]]) -> dict:
    import xgrammar as xgr

    prep, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiles, masks = [], []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for schema, ids in zip(schemas, answers, strict=True):
        text = json.dumps(schema)
        t, compiled = _timed(lambda t=text: compiler.compile_json_schema(t, any_whitespace=False, separators=SEPS))
        compiles.append(t)
        m = xgr.GrammarMatcher(compiled)
        for i in ids:
            masks.append(_timed(lambda m=m: m.fill_next_token_bitmask(bitmask))[0])
            assert m.accept_token(i)
        assert m.is_terminated() or m.accept_token(info.stop_token_ids[0])
    return {"prepare_s": prep, "compile": _summary(compiles), "mask": _summary(masks)}


def bench_outlines(tok, schemas: list[dict], answers: list[list[int]]) -> dict:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    def vocabulary():
        decode = {c: b for b, c in bytes_to_unicode().items()}
        words: dict[bytes, list[int]] = {}
        for text, i in tok.get_vocab().items():
            if i != tok.eos_token_id and i not in tok.all_special_ids:
                words.setdefault(bytes(decode.get(c, ord("?")) for c in text), []).append(i)
        return Vocabulary(tok.eos_token_id, words)

    prep, vocab = _timed(vocabulary)
    compiles, masks = [], []
    mask = np.zeros((len(tok) + 31) // 32, np.int32)
    for schema, ids in zip(schemas, answers, strict=True):
        regex = build_regex_from_schema(json.dumps(schema), r"[\n ]?")
        t, index = _timed(lambda r=regex: Index(r, vocab))
        compiles.append(t)
        guide = Guide(index)
        for i in ids:
            masks.append(_timed(lambda g=guide: g.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize))[0])
            guide.advance(i)
    return {"prepare_s": prep, "compile": _summary(compiles), "mask": _summary(masks)}


SEPS = (",", ":")  # compact JSON, as the answers are written
FEEDS = {
    "llguidance": "rollback(n) and consume: walk a tree depth-first, one mask per node; forced tokens "
    "(compute_ff_tokens) draft a free chain; no torch",
    "xgrammar": "rollback(n) and fill_next_token_bitmask per node, like llguidance; needs torch at run time",
    "outlines-core": "token automaton (Index: state -> token -> state), could be tables on device; no rollback "
    "needed (states are ints); compile builds the whole index up front",
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (e.g. ~/.cache/eagle-jax/smollm2)")
    ap.add_argument("--prompts", default="data/grammar/extraction.jsonl")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--out", default=None, help="folder for grammar_bench.json")
    args = ap.parse_args(argv)
    tok = load_tokenizer(Path(args.tokenizer).expanduser())
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    schemas = [it["schema"] for it in items]
    answers = [tok.encode(json.dumps(instance(s), separators=(",", ":")), add_special_tokens=False) for s in schemas]
    runs = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines-core": bench_outlines}
    results = {}
    for name in args.engines.split(","):
        try:
            results[name] = runs[name](tok, schemas, answers)
        except ImportError as exc:
            raise SystemExit(f"{name} is not installed ({exc}); pip install -e '.[grammar-bench]'") from None
    print(f"vocabulary {len(tok)}, {len(schemas)} schemas, {sum(map(len, answers))} masks per engine\n")
    print("| engine | prepare tokenizer s | compile ms (median / p99) | mask ms (median / p99) | tree feed |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        c, m = r["compile"], r["mask"]
        print(
            f"| {name} | {r['prepare_s']:.2f} | {c['median_ms']:.2f} / {c['p99_ms']:.2f} "
            f"| {m['median_ms']:.3f} / {m['p99_ms']:.3f} | {FEEDS[name]} |"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        doc = {"vocabulary": len(tok), "schemas": len(schemas), "results": results}
        (Path(args.out) / "grammar_bench.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The demo: one chat answer streamed with speculative decoding, then the same prompt plainly, and the speedup.

    python -m infer.demo [--prompt TEXT] [--max-new-tokens N] [--target DIR --draft DIR]

Defaults to the demo pair shipped in demo/ (a small Llama target trained on ShareGPT and its EAGLE-3
head). Greedy decoding, so both answers are the same text; the speedup compares the wall time of
the two (compilation excluded: both are warmed up first on the same prompt bucket).
"""

from __future__ import annotations

import argparse
import sys
import time

from infer.benchmark import DEFAULT_TREE, DEMO_DRAFT, DEMO_TARGET, Runner

DEFAULT_PROMPT = "What are some tips for writing a good resume?"


def stream_answer(runner: Runner, ids: list[int], max_new_tokens: int) -> tuple[list[int], int, float]:
    """Print the speculative answer as cycles are accepted (infer.generate's TextStream) -> (tokens, cycles, seconds)."""
    from eagle_jax import engine
    from infer.generate import TextStream

    printer = TextStream(runner.tokenizer)
    cycles = 0
    t0 = time.perf_counter()
    for new, _tree, _state in engine.stream(runner.tparams, runner.tcfg, runner.dparams, runner.dcfg, [ids],
                                            max_new_tokens, runner.spec, runner.seed, runner.capacity):
        cycles += 1
        printer(new)
    seconds = time.perf_counter() - t0
    print(flush=True)
    return printer.ids, cycles, seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--target", default=str(DEMO_TARGET))
    ap.add_argument("--draft", default=str(DEMO_DRAFT))
    ap.add_argument("--total-tokens", type=int, default=DEFAULT_TREE[0])
    ap.add_argument("--depth", type=int, default=DEFAULT_TREE[1])
    ap.add_argument("--tree-top-k", type=int, default=DEFAULT_TREE[2])
    args = ap.parse_args(argv)

    from eagle_jax.errors import EagleError

    try:
        print(f"loading {args.target} and {args.draft} ...", file=sys.stderr, flush=True)
        runner = Runner(args.target, args.draft, (args.total_tokens, args.depth, args.tree_top_k), 0.0,
                        args.max_new_tokens, 256)
        ids = runner.prompt([{"role": "user", "content": args.prompt}])
        print("compiling ...", file=sys.stderr, flush=True)
        runner.warm(ids)
        # the streamed cycle is jitted separately from the while_loop: compile it too
        from eagle_jax import engine

        for _ in engine.stream(runner.tparams, runner.tcfg, runner.dparams, runner.dcfg, [ids], 2, runner.spec,
                               runner.seed, runner.capacity):
            pass
        print(f"\nUser: {args.prompt}\n\nAssistant (EAGLE-3 speculative, streamed):")
        tokens, cycles, streamed_s = stream_answer(runner, ids, args.max_new_tokens)
        spec = runner.speculative(ids)
        plain = runner.plain(ids)
        print("\nAssistant (plain decoding):")
        print(runner.decode(plain["tokens"]))
    except EagleError as exc:
        raise SystemExit(f"error: {exc}") from None
    tau = len(spec["tokens"]) / max(1, spec["cycles"])
    tps_spec = len(spec["tokens"]) / spec["seconds"]
    tps_plain = len(plain["tokens"]) / plain["seconds"]
    same = "identical" if spec["tokens"] == plain["tokens"] == tokens else "DIFFERENT"
    print(f"\n{len(spec['tokens'])} tokens; tau {tau:.2f} tokens/cycle; speculative {tps_spec:.1f} tokens/s "
          f"(streamed with printing: {len(tokens) / streamed_s:.1f}), plain {tps_plain:.1f} tokens/s; "
          f"speedup {tps_spec / tps_plain:.2f}x; outputs {same}")


if __name__ == "__main__":
    main()

"""Per-turn latency of a chat that keeps its caches, against decoding each turn's whole conversation again.

    python -m instruments.chat_latency [--target DIR --draft DIR | --no-spec] [--turns 5] [--max-new-tokens 64]
        [--max-len 2048] [--total-tokens N --depth D --tree-top-k K] [--json OUT]

The user turns are MT-bench's (both turns of the first questions, in order), with the target's chat
template. One `session.Session` warms up (its compile time is printed), then answers each turn: the
table shows the prompt, how much of it the caches already held, the turn's prefill and decode time,
its wall time and the programs compiled during it (0 after warm-up), next to decoding the same whole
conversation from scratch with `generation.generate` (timed after an untimed run,
so without compilation). Without --target, the demo pair.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jax import monitoring
from tqdm import tqdm

from cli import command, demo, envelope, models
from eagle_jax.decoding import generation, session, speculative
from eagle_jax.decoding.tree import PLAIN, DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def user_turns(n: int) -> list[str]:
    """The first n user turns of MT-bench, question by question."""
    turns = [t for line in envelope.QUESTIONS.read_text().splitlines() for t in json.loads(line)["turns"]]
    return turns[:n]


def _timed(run) -> float:
    run()
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def measure(models, tok, tree, turns: int, max_new: int, capacity: int) -> dict:
    tcfg, tparams, dcfg, dparams = models
    compiles: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name == COMPILE_EVENT else None
    )
    talk = session.Session(tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, tree), capacity=capacity)
    warm_up_s = talk.warm_up()
    history: list[dict[str, str]] = []
    rows = []
    for text in tqdm(user_turns(turns), desc="turns", unit="turn", file=sys.stderr):
        history.append({"role": "user", "content": text})
        rendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        prompt = tok(rendered, add_special_tokens=False)["input_ids"]
        before = len(compiles)
        t0 = time.perf_counter()
        for _ in talk.reply(prompt, max_new):
            pass
        wall = time.perf_counter() - t0
        compiled = len(compiles) - before
        t = talk.last
        history.append({"role": "assistant", "content": tok.decode(t.tokens, skip_special_tokens=True)})
        scratch = _timed(
            lambda p=prompt: generation.generate(
                tparams, dparams, [p], max_new, speculative.DecodeConfig(tcfg, dcfg, tree), capacity=capacity
            )
        )
        rows.append(
            {
                "prompt_tokens": t.prompt_tokens,
                "kept_tokens": t.reused_tokens,
                "new_tokens": len(t.tokens),
                "prefill_ms": 1000 * t.prefill_s,
                "decode_ms": 1000 * t.decode_s,
                "turn_ms": 1000 * wall,
                "compiles": compiled,
                "from_scratch_ms": 1000 * scratch,
            }
        )
    return {"warm_up_s": warm_up_s, "programs": talk.programs(), "tree": str(tree), "turns": rows}


def render(r: dict) -> str:
    lines = [
        f"warm-up {r['warm_up_s']:.1f} s: {len(r['programs'])} programs ({', '.join(r['programs'])}); tree {r['tree']}",
        "turn  prompt  kept  new  prefill ms  decode ms  turn ms  compiles  from scratch ms",
    ]
    for i, t in enumerate(r["turns"], 1):
        lines.append(
            f"{i:4d} {t['prompt_tokens']:7d} {t['kept_tokens']:5d} {t['new_tokens']:4d} {t['prefill_ms']:11.1f} "
            f"{t['decode_ms']:10.1f} {t['turn_ms']:8.1f} {t['compiles']:9d} {t['from_scratch_ms']:16.1f}"
        )
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.chat_latency", description=__doc__.split("\n\n")[0])
    models.add_flags(p, config=False, mesh=False, quantize=False, dtype_default="fp32")
    p.add_argument("--no-spec", action="store_true", help="plain decoding with the target alone")
    p.add_argument("--total-tokens", type=int, default=16)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--tree-top-k", type=int, default=4)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048, help="cache capacity of the conversation")
    p.add_argument("--json", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    for name in ("turns", "max_new_tokens", "max_len"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1")
    if a.json:
        files.check_output_file(
            a.json, "json", [p for p in (a.target, a.draft) if p], files.json_with("warm_up_s", "programs", "turns")
        )
    m = models.load(models.choose(a, plain=a.no_spec, pair=demo.tiny_pair))
    tree = DynamicTree(a.total_tokens, a.depth, a.tree_top_k) if m.dcfg is not None else PLAIN
    with command.flag("--target"):
        tok = loading.load_tokenizer(m.target_dir)
    report = measure((m.tcfg, m.tparams, m.dcfg, m.dparams), tok, tree, a.turns, a.max_new_tokens, a.max_len)
    print(render(report))
    if a.json:
        doc = {**report, "target": command.shown_path(m.target_dir), "draft": command.shown_path(m.draft_dir)}
        files.write_json_atomic(Path(a.json), doc)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""A chat session on the golden pair in its own process (`python tests/session_proc.py`), with the compilation
cache of every command (`cli.compile_cache`), then one generation (an engine of its own): prints both answers and
which of their programs were traced and compiled."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax import monitoring  # noqa: E402

from cli import compile_cache  # noqa: E402
from eagle_jax.decoding import generation, session, speculative  # noqa: E402
from eagle_jax.decoding.tree import DynamicTree  # noqa: E402
from eagle_jax.io import loading  # noqa: E402

PROGRAMS = ("extend", "cycle")  # the session's decoding programs (`Session.programs` has retire too: 4 in all)
events: dict[str, list[str]] = {"traced": [], "compiled": []}
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "traced", "/jax/core/compile/backend_compile_duration": "compiled"}


def _seen(event: str, secs: float, fun_name: str = "", **_) -> None:
    if event in EVENTS and any(p in fun_name for p in PROGRAMS):
        events[EVENTS[event]].append(fun_name)


if __name__ == "__main__":
    compile_cache.enable()
    monitoring.register_event_duration_secs_listener(_seen)
    golden = ROOT / "tests" / "golden"
    tcfg, tparams = loading.load_target(golden / "target")
    dcfg, dparams = loading.load_draft(golden / "eagle3", tcfg)
    talk = session.Session(tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, DynamicTree(5, 4, 1)), 256, (32,))
    talk.warm_up()
    answer = [t for chunk in talk.reply([5, 6, 7, 8, 9], 12) for t in chunk]
    generated = generation.generate(tparams, dparams, [[5, 6, 7, 8, 9]], 6, talk.cfg).tokens[0]
    print(json.dumps({"answer": answer, "generated": generated, "programs": len(talk.programs()), **events}))

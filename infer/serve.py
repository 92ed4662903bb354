"""Serve a target and its EAGLE head with an OpenAI-compatible API and continuous batching.

    python -m infer.serve [--target DIR --draft DIR|context | --config PRESET --models DIR] [--host 127.0.0.1]
        [--port 8000] [--max-batch 8] [--max-len 2048] [--max-queue 64] [--max-request-bytes N] [--no-spec]
        [--max-logprobs 20] [--dtype fp32] [--mesh data=D,tensor=T] [--shutdown-grace 25] [--prefix-cache-tokens N]

Endpoints: POST /v1/chat/completions and /v1/completions (stream or not), GET /v1/models, /health,
/metrics (Prometheus), and a chat page at / that shows the speculation. Without a model named it serves the demo
pair. At start-up the tree envelope for each number of live rows is read from the head's measured budget (or
measured here once and cached) and every program the engine can run is compiled; the log says which and how long
it took. A new request starts from the longest prefix of its prompt that an earlier request to this server (its
one target, head and dtype) left in the prefix cache, and prefills only the rest. On several hosts (a TPU pod
slice: every host runs the command, with one --mesh over all chips) process 0 serves HTTP and the others decode
in step with it (`Batcher.follow`). SIGTERM or Ctrl-C: new requests get 503, running ones have --shutdown-grace
seconds to finish; a stream still running then ends with an error event and [DONE], a whole answer with a 503;
the command exits 0.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Sequence

import jax

from cli import command, demo, envelope, models
from eagle_jax.decoding import budget as budgets
from eagle_jax.decoding import prefix
from eagle_jax.decoding.logprobs import MAX_TOP
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import envelope_name
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.parallel import distributed
from eagle_jax.serving import api, batcher

MEASURED_BATCHES = (1, 4, 8, 16)
SHUTDOWN_GRACE_S = 25.0  # below the 30 s a supervisor (Kubernetes, systemd) commonly waits before SIGKILL


def envelopes(models, paths, max_batch: int, tok, log) -> budgets.Budget:
    """The measured envelope for each batch size up to max_batch (from the head's budget.json or the cache, else
    measured now). On several processes, process 0's saved choices, sent to all (nothing is measured there)."""
    calibration = lambda: envelope.calibration_prompts(tok)  # noqa: E731 (only when measuring)
    sizes = sorted({b for b in MEASURED_BATCHES if b <= max_batch} | {1})
    if not distributed.is_multi_host():
        return budgets.Budget(
            budgets.device_kind(), {b: envelope.default_tree(models, paths, b, calibration, log=log) for b in sizes}
        )
    mine = None
    if jax.process_index() == 0:
        try:
            trees = {b: envelope.default_tree(models, paths, b, calibration, log=log, measure=False) for b in sizes}
            mine = budgets.Budget(budgets.device_kind(), trees).to_json()
        except EagleError as exc:  # every process stops with it
            mine = {"error": str(exc)}
    doc = json.loads(distributed.broadcast(None if mine is None else json.dumps(mine).encode()))
    if "error" in doc:
        raise EagleError(doc["error"])
    return budgets.Budget.from_json(doc)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m infer.serve", description=__doc__.split("\n\n")[0])
    models.add_flags(p, mesh_help="(default: the preset's, else one device; data must divide --max-batch)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="row slots decoded together")
    p.add_argument("--max-len", type=int, default=2048, help="cache capacity per row (prompt + answer)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429s")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of a request without one (or less)")
    p.add_argument(
        "--max-request-bytes",
        type=int,
        help="larger request bodies get 413 (default: room for the longest prompt --max-len takes)",
    )
    p.add_argument("--no-spec", action="store_true", help="plain decoding (the head only follows along)")
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_TOP,
        help="most alternatives per token a request's logprobs may ask (their buffers take max-batch x max-len x "
        "(1 + 2 N) x 4 bytes); 0 refuses logprobs",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=SHUTDOWN_GRACE_S,
        metavar="S",
        help="on SIGTERM or Ctrl-C, seconds running requests have to finish before they are ended",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        metavar="N",
        help="prompt positions whose keys and values later requests that start alike reuse (0: off, every prompt "
        "prefilled whole; default: as many as the rows hold, --max-batch x --max-len; off on a mesh)",
    )
    a = p.parse_args(argv)
    lows = {"max_batch": 1, "max_len": 1, "max_queue": 0, "max_tokens": 1, "max_request_bytes": 1, "max_logprobs": 0}
    for name, low in lows.items():
        if getattr(a, name) is not None and getattr(a, name) < low:
            raise EagleError(f"--{name.replace('_', '-')} must be >= {low}")
    if not 0 <= a.shutdown_grace <= 3600:
        raise EagleError(f"--shutdown-grace {a.shutdown_grace} must lie in 0..3600 seconds")
    if not 0 <= a.port <= 65535:
        raise EagleError(f"--port {a.port} must lie in 0..65535")
    pair = models.choose(a, pair=demo.tiny_pair)
    m = models.load(pair, batcher.check_hosts)
    tcfg, tparams, dcfg, dparams, target_dir, draft_dir = m.tcfg, m.tparams, m.dcfg, m.dparams, pair.target, pair.draft
    if a.max_logprobs > tcfg.vocab_size:
        raise EagleError(f"--max-logprobs {a.max_logprobs} exceeds the target's {tcfg.vocab_size} tokens")
    prefix_tokens = prefix_budget(a.prefix_cache_tokens, a.max_batch * a.max_len, m.mesh is not None)
    per_token = prefix.bytes_per_token(tcfg, dcfg, tparams["embed"].dtype)
    prefix.check_budget(prefix_tokens, per_token, prefix.free_bytes(jax.devices()[0]))
    with command.flag("--target"):
        tok = loading.load_tokenizer(target_dir, pair.preset.chat_template if pair.preset else None)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    measured = (
        None if a.no_spec else envelopes((tcfg, tparams, dcfg, dparams), (target_dir, draft_dir), a.max_batch, tok, log)
    )
    engine = batcher.Batcher(
        tparams,
        dparams,
        DecodeConfig(tcfg, dcfg),
        measured.for_batch if measured else None,
        a.max_batch,
        a.max_len,
        max_queue=a.max_queue,
        mesh=m.mesh,
        logprobs=a.max_logprobs,
        prefix_tokens=prefix_tokens,
        structured=True,
    )
    later = engine.engine.structured_programs()
    names = [n for n in engine.programs() if n not in later]
    started = time.perf_counter()
    engine.warm_up(wait=False)  # a request waits only for the programs its cycles run
    log(
        f"warm-up: compiling {len(names)} programs in the background ({', '.join(names)}), then {len(later)} for "
        "requests that follow grammars (structured output)"
    )

    def compiled() -> None:
        engine.engine.compiled.wait(names)
        log(f"warm-up: {len(names)} programs compiled in {time.perf_counter() - started:.1f} s")
        engine.engine.compiled.wait(later)
        log(f"warm-up: {len(later)} structured-output programs compiled in {time.perf_counter() - started:.1f} s")

    logger = threading.Thread(target=compiled, daemon=True)
    logger.start()
    size = prefix.blocks_for(prefix_tokens) * prefix.BLOCK * per_token / 2**20
    log(
        f"prefix cache: {prefix_tokens} tokens ({per_token} bytes each, {size:.0f} MiB), shared by the requests to "
        f"this server's one target, head and dtype ({tparams['embed'].dtype}); --prefix-cache-tokens 0 turns it off"
        if prefix_tokens
        else "prefix cache: off (every prompt is prefilled whole)"
    )
    for n, tree in sorted(engine.engine.envelope.items()):
        log(f"  up to {n} live row{'s' if n > 1 else ''}: {envelope_name(tree)}")
    if jax.process_index() > 0:  # a multi-host server answers on process 0; the others decode in step with it
        log(f"process {jax.process_index()} of {jax.process_count()}: following process 0's engine")
        engine.follow()  # returns once its compilations are done
        logger.join()  # which it logs
        st = engine.stats
        log(f"followed {st.cycles} cycles: {st.row_cycles} row cycles, {st.generated_tokens} tokens")
        return 0
    app = api.create_app(engine, tok, target_dir.name, a.max_tokens, a.max_request_bytes)
    log(f"serving {target_dir.name} on http://{a.host}:{a.port}/v1, its chat page on http://{a.host}:{a.port}/")
    api.serve(app, a.host, a.port, a.shutdown_grace)
    log("stopped")
    if engine.dead:
        raise EagleError("the engine failed and could not rebuild its rows (the log has why); the server stopped")
    return 0


def prefix_budget(asked: int | None, rows_hold: int, mesh: bool) -> int:
    """The prefix cache's budget: as asked, else as many positions as the rows hold (off on a mesh)."""
    if asked is not None and asked < 0:
        raise EagleError(f"{asked} must be >= 0 (0 turns the prefix cache off)", "prefix_tokens")
    if mesh and asked:
        raise EagleError("the prefix cache runs on one device: give 0 with --mesh", "prefix_tokens")
    return (0 if mesh else rows_hold) if asked is None else asked


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv, flags={"capacity": "--max-len", "prefix_tokens": "--prefix-cache-tokens"})


if __name__ == "__main__":
    command.finish(main())

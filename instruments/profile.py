"""Where a speculative cycle spends its time, next to a plain decode step, on the machine at hand.

    python -m instruments.profile [--target DIR --draft DIR] [--total-tokens 60 --depth 7 --tree-top-k 10 | --tree T]
        [--context K] [--batch 1] [--prompt-len 64] [--new-tokens 128] [--widths 1,2,4,8,16,32,64]
        [--dtype fp32] [--json OUT]

Both decoders run the same random prompts (B rows) after warm-up, as the jitted loops generation uses, over
one attention span. Prints the plain step time, the cycle time, c = cycle / plain step - 1, tau and the
speedup tau / (1 + c) decoding alone would give; the cycle split into its phases (context search, draft
levels, rerank, graft, tree mask, verify, sample, accept, compact, draft catch-up) from one profiled run, as
time per cycle (scaled to the untraced cycle) and share; an op census of both compiled loops; and what one
target forward over T tokens costs against one token (--widths), which bounds what verifying a tree of T nodes
can cost; and a floor under c: the cycle's flops at this machine's best matmul rate, in plain steps (XLA's
count, in which a loop body counts once, so of the draft levels only one: a floor, not an estimate). Without
--target, the demo pair.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from cli import command, demo, models
from eagle_jax.decoding import schedule, speculative
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree, TreeConfig, parse_static
from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.models import kv_cache, target
from instruments import cost, profiling

SAMPLING = SamplingConfig()


def _best(run, repeats: int) -> float:
    """The fastest of `repeats` timed runs (seconds), after one untimed run."""
    jax.block_until_ready(run())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - t)
    return min(times)


FORWARDS_PER_RUN = 10


@functools.partial(jax.jit, static_argnames=("tcfg", "width", "span"), donate_argnames=("cache",))
def _forwards(tparams, cache, *, tcfg, width: int, span: int) -> tuple[kv_cache.KVCache, jax.Array]:
    """FORWARDS_PER_RUN target forwards over `width` tokens each, one cache slot further each time; the logits
    feed the result, so none of the work is left out."""

    def one(_, carry):
        cache, total = carry
        tokens = jnp.broadcast_to(jnp.arange(3, 3 + width, dtype=jnp.int32), (cache.lengths.shape[0], width))
        positions = cache.lengths[:, None] + jnp.arange(width)[None, :]
        out = target.forward(tparams, tcfg, tokens, positions, cache, span=span)
        return kv_cache.advance(out.cache, jnp.ones_like(cache.lengths)), total + jnp.sum(out.logits[..., :8])

    return jax.lax.fori_loop(0, FORWARDS_PER_RUN, one, (cache, jnp.float32(0)))


def forward_ms(tparams, tcfg, width: int, batch: int, context: int, span: int, repeats: int = 5) -> float:
    """Milliseconds of one target forward over `width` tokens per row (logits included) after `context` cached
    tokens, attending over `span` slots."""

    def fresh():
        cache = target.init_cache(tcfg, batch, span + width + FORWARDS_PER_RUN, tparams["embed"].dtype)
        return jax.block_until_ready(kv_cache.set_lengths(cache, jnp.full((batch,), context)))

    caches = [fresh() for _ in range(repeats + 1)]
    seconds = _best(lambda: _forwards(tparams, caches.pop(), tcfg=tcfg, width=width, span=span), repeats)
    return 1000 * seconds / FORWARDS_PER_RUN


MATMUL_SIZE = 1024


def matmul_flops_per_s(dtype, repeats: int = 20) -> float:
    """This machine's best dense matmul rate: FLOP/s of the fastest of `repeats` jitted [1024, 1024] @ [1024, 1024]
    products (a few ms each, so many: on a shared machine one slow run in five is common)."""
    a = jnp.ones((MATMUL_SIZE, MATMUL_SIZE), dtype)
    product = jax.jit(jnp.matmul)
    return 2 * MATMUL_SIZE**3 / _best(lambda: product(a, a), repeats)


def profile(
    models,
    tree: TreeConfig,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    widths: Sequence[int] = (),
    repeats: int = 5,
) -> dict:
    tcfg, tparams, dcfg, dparams = models
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, tcfg.vocab_size, (batch, prompt_len)).tolist()
    sides = {  # (settings, head parameters)
        "spec": (speculative.DecodeConfig(tcfg, dcfg, tree, SAMPLING), dparams),
        "plain": (speculative.DecodeConfig(tcfg, None, PLAIN, SAMPLING), None),
    }
    p = speculative.prepare(prompts, new_tokens, sides["spec"][0])
    span = schedule.attention_span(prompt_len + new_tokens + tree.cache_overhead, p.capacity)
    key = jax.random.key(0)

    def state_of(side: str):
        cfg, head = sides[side]
        return speculative.prefill(tparams, head, p.tokens, p.lengths, p.limits, key, cfg=cfg, capacity=p.capacity)

    def run(side: str, state=None):
        cfg, head = sides[side]
        return speculative.run_span(tparams, head, state or state_of(side), cfg=cfg, span=span)

    def compiled(side: str):
        cfg, head = sides[side]
        return speculative.run_span.lower(tparams, head, state_of(side), cfg=cfg, span=span).compile()

    def timed(side: str) -> tuple[float, int, int]:
        """(seconds per cycle, cycles, tokens emitted) of a run to the end of the span."""
        done = jax.block_until_ready(run(side))
        states = [jax.block_until_ready(state_of(side)) for _ in range(repeats + 1)]
        cycles = int(done.cycle)
        return _best(lambda: run(side, states.pop()), repeats) / cycles, cycles, int(np.sum(done.counts))

    (cycle_s, cycles, emitted), (step_s, _, _) = timed("spec"), timed("plain")
    spec_compiled, plain_compiled = compiled("spec"), compiled("plain")
    traced = profiling.phase_times(spec_compiled, lambda: run("spec", jax.block_until_ready(state_of("spec"))))
    scale = cycle_s * cycles / max(sum(traced.values()), 1e-12)
    tau = emitted / (cycles * batch)
    c = cycle_s / step_s - 1
    cycle_flops = cost.cost_of(spec_compiled).flops  # the loop's body, counted once: one cycle
    peak = matmul_flops_per_s(tparams["embed"].dtype)
    return {
        "tree": str(tree),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "span": span,
        "device": f"{jax.devices()[0].platform} ({jax.device_count()})",
        "plain_step_ms": 1000 * step_s,
        "cycle_ms": 1000 * cycle_s,
        "c": c,
        "tau": tau,
        "decode_speedup": tau / (1 + c),
        "cycle_mflop": cycle_flops / 1e6,
        "plain_step_mflop": cost.cost_of(plain_compiled).flops / 1e6,
        "matmul_gflops": peak / 1e9,
        "cycle_floor_ms": 1000 * cycle_flops / peak,
        "c_floor": cycle_flops / peak / step_s - 1,
        "phases_ms": {name: 1000 * traced.get(name, 0.0) * scale / cycles for name in (*profiling.PHASES, "other")},
        "cycle_ops": profiling.op_census(spec_compiled),
        "plain_step_ops": profiling.op_census(plain_compiled),
        "forward_ms_by_width": {w: forward_ms(tparams, tcfg, w, batch, prompt_len, span, repeats) for w in widths},
    }


def render(r: dict) -> str:
    lines = [
        f"tree {r['tree']}, batch {r['batch']}, prompt {r['prompt_len']} + {r['new_tokens']} tokens, "
        f"span {r['span']}, {r['device']}",
        f"plain step {r['plain_step_ms']:.3f} ms | cycle {r['cycle_ms']:.3f} ms | c {r['c']:.2f} | "
        f"tau {r['tau']:.2f} | decode speedup tau/(1+c) {r['decode_speedup']:.2f}x",
        f"floor: the cycle's {r['cycle_mflop']:.1f} MFLOP at this machine's best matmul rate "
        f"({r['matmul_gflops']:.0f} GFLOP/s) take >= {r['cycle_floor_ms']:.3f} ms, "
        f"{r['c_floor'] + 1:.2f} plain steps: c >= {r['c_floor']:.2f} (plain step {r['plain_step_mflop']:.1f} MFLOP)",
        "",
        "phase            ms/cycle   share  (x plain step)",
    ]
    total = sum(r["phases_ms"].values())
    for name, ms in r["phases_ms"].items():
        lines.append(f"{name:15s} {ms:9.3f} {100 * ms / total:6.1f}%  {ms / r['plain_step_ms']:6.2f}")
    if r["forward_ms_by_width"]:
        one = r["forward_ms_by_width"].get(1)
        lines += ["", "target forward over T tokens per row" + (" (x one token)" if one else "")]
        for width, ms in r["forward_ms_by_width"].items():
            lines.append(f"  T {width:4d}: {ms:8.3f} ms" + (f"  {ms / one:5.2f}x" if one else ""))
    for what in ("cycle_ops", "plain_step_ops"):
        ops = r[what]
        lines += ["", f"{what.replace('_', ' ')}: {sum(ops.values())} ops"] + [f"  {k}: {v}" for k, v in ops.items()]
    return "\n".join(lines)


def parse_widths(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); '' -> ()."""
    try:
        widths = tuple(int(w) for w in text.split(",") if w.strip())
    except ValueError:
        raise EagleError(f"{text!r} is not a comma-separated list of token counts") from None
    if any(w < 1 for w in widths):
        raise EagleError(f"{text!r}: every width must be >= 1")
    return widths


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.profile", description=__doc__.split("\n\n")[0])
    models.add_flags(p, config=False, mesh=False, quantize=False, dtype_default="fp32")
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--depth", type=int, default=7)
    p.add_argument("--tree-top-k", type=int, default=10)
    p.add_argument("--tree", help="a static tree instead: 'mc_sim_7b_63' or a JSON list of rank paths")
    p.add_argument("--context", type=int, default=0, help="context candidates grafted onto the tree")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--widths", default="1,2,4,8,16,32,64", help="forward widths to time ('' for none)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    for name in ("batch", "prompt_len", "new_tokens"):
        if getattr(a, name) < 1 + (name == "new_tokens"):
            raise EagleError(f"--{name.replace('_', '-')} must be >= {1 + (name == 'new_tokens')}")
    with command.flag("--widths"):
        widths = parse_widths(a.widths)
    if a.json:
        files.check_output_file(
            a.json, "json", [p for p in (a.target, a.draft) if p], files.json_with("tree", "span", "prompt_len")
        )
    with command.flag("--tree"):
        tree = parse_static(a.tree) if a.tree else DynamicTree(a.total_tokens, a.depth, a.tree_top_k)
        tree = dataclasses.replace(tree, context=a.context)
    m = models.load(models.choose(a, pair=demo.tiny_pair))
    report = profile(
        (m.tcfg, m.tparams, m.dcfg, m.dparams),
        tree,
        a.batch,
        a.prompt_len,
        a.new_tokens,
        widths,
    )
    print(render(report))
    if a.json:
        files.write_json_atomic(
            Path(a.json),
            {**report, "target": command.shown_path(m.target_dir), "draft": command.shown_path(m.draft_dir)},
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

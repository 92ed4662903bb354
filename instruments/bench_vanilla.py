"""Plain-generation throughput of a random ~100M-parameter Llama: prefill and decode tokens/s per batch size.

    python -m instruments.bench_vanilla [--batch-sizes 1,8] [--prompt-len 128] [--new-tokens 64] [--json OUT]

Generation runs on an engine (`decoding.generation`); compilation is excluded (one warm-up run per batch size);
every timing ends with block_until_ready.
Decode tokens/s counts the tokens made by the decode loop (new_tokens - 1 per row; the first comes
from prefill). The random model never stops early: it has no eos ids.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cli import command
from eagle_jax.decoding import generation, schedule, speculative
from eagle_jax.decoding.engine import chunk_plan
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN
from eagle_jax.errors import EagleError
from eagle_jax.models import target
from eagle_jax.models.config import RopeConfig, TargetConfig
from eagle_jax.models.params import init_params, param_count, with_dtype

BENCH_CONFIG = TargetConfig(
    family="llama",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
    rms_norm_eps=1e-6,
    rope=RopeConfig(),
)


def bench_batch(
    params: dict, cfg: TargetConfig, batch: int, prompt_len: int, new_tokens: int, repeats: int, progress: tqdm
) -> dict:
    """Median prefill and decode throughput over `repeats` timed runs after one warm-up run."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(3, cfg.vocab_size, (batch, prompt_len)).tolist()
    capacity = schedule.plan([prompt_len] * batch, new_tokens).capacity
    plain = speculative.DecodeConfig(cfg, None, PLAIN, SamplingConfig())
    prefill_s, decode_s, decoded = [], [], 0
    for run in range(repeats + 1):
        res = generation.generate(params, None, prompts, new_tokens, plain, capacity=capacity)
        if run:  # run 0 compiles
            prefill_s.append(res.prefill_s)
            decode_s.append(res.decode_s)
            decoded = sum(res.new_tokens) - batch
        progress.update(1)
    prefill_t, decode_t = statistics.median(prefill_s), statistics.median(decode_s)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "chunks": chunk_plan(prompt_len),  # the prefill's chunk sizes
        "capacity": capacity,
        "new_tokens": new_tokens,
        "prefill_s": prefill_t,
        "prefill_tokens_per_s": batch * prompt_len / prefill_t,
        "decode_s": decode_t,
        "decode_tokens_per_s": decoded / decode_t,
        "decode_ms_per_step": 1000 * decode_t / (new_tokens - 1),
    }


def _main(argv: Sequence[str] | None) -> int:
    ap = command.ArgumentParser(prog="python -m instruments.bench_vanilla", description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per batch size (median reported)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", metavar="OUT", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    if args.new_tokens < 2 or args.prompt_len < 1 or not batches or min(batches) < 1:
        raise EagleError("need --new-tokens >= 2, --prompt-len >= 1 and positive --batch-sizes")

    cfg = BENCH_CONFIG
    specs = with_dtype(target.param_specs(cfg), jnp.dtype(args.dtype))
    params = jax.block_until_ready(init_params(specs, jax.random.key(0)))
    device = jax.devices()[0]
    print(
        f"model: {param_count(specs) / 1e6:.1f}M parameters ({args.dtype}); device: {device.platform} "
        f"{device.device_kind}; prompt {args.prompt_len}, {args.new_tokens} new tokens"
    )
    results = []
    with tqdm(total=len(batches) * (args.repeats + 1), desc="bench", unit="run") as progress:
        for batch in batches:
            results.append(bench_batch(params, cfg, batch, args.prompt_len, args.new_tokens, args.repeats, progress))
    for r in results:
        print(
            f"batch {r['batch']:>3}: prefill {r['prefill_tokens_per_s']:>9.1f} tok/s ({r['prefill_s'] * 1e3:.1f} ms)"
            f" | decode {r['decode_tokens_per_s']:>8.1f} tok/s ({r['decode_ms_per_step']:.2f} ms/step)"
        )
    if args.json:
        report = {
            "params": param_count(specs),
            "dtype": args.dtype,
            "device": f"{device.platform} {device.device_kind}",
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "results": results,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

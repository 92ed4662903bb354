"""Time the official PyTorch EAGLE code (SafeAILab/EAGLE) on CPU: speculative vs plain greedy decoding.

For each tree envelope (total_token / depth / top_k) this loads the official ``EaModel``, warms up once, then times
``eagenerate`` (speculative) and ``naivegenerate`` (plain decoding with the official KV cache) on each golden prompt,
batch 1, temperature 0, ``--repeats`` times, the two interleaved prompt by prompt. Reported per envelope: new tokens
(upstream overshoots --max-new-tokens by up to depth + 2, so the tokens actually produced are counted), wall seconds
(median over repeats of the time summed over prompts, prefill included), tokens/s both ways, speedup (ratio of the
tokens/s), cycles (``idx + 1`` from ``log=True``), tau = new tokens / cycles and
c = (speculative seconds / cycles) / (plain seconds / plain tokens) - 1. It also checks the greedy outputs against
``reference.npz``: the official run of the same head and envelope where the file has one, and plain greedy decoding.
Per prompt it also records, from one more untimed run, the new token ids and the drafts accepted in each cycle.

    python instruments/official_timing.py --eagle-repo DIR --target tests/golden/target --draft tests/golden/eagle3
        --prompts-npz tests/golden/reference.npz [--max-new-tokens 64] [--envelopes 60/7/10,16/4/4] [--repeats 3]
        [--kind auto|eagle3|eagle1] [--threads 2] [--json OUT]

This script is standalone: it imports neither eagle_jax nor anything else from this repository, and runs under
the official code's own environment. On a shared machine use ``--threads 1`` (results/cost_table/README.md says
why).

Setting up: fetch SafeAILab/EAGLE at commit cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b (the one the golden data was
made with) into a folder outside this repository, e.g. ``git archive cb7e084 eagle | tar -x -C ~/src/EAGLE``.
Make a Python 3.11 venv with ``pip install torch==2.13.0 transformers==4.53.3`` (a CPU build of torch; these bring
numpy, safetensors, tokenizers and huggingface_hub, which is all ``eagle/model`` needs on CPU; the official code does
not import under transformers 5). Then run this file with that venv's python, from the repository root:

    VENV/bin/python instruments/official_timing.py --eagle-repo ~/src/EAGLE --target tests/golden/target
        --draft tests/golden/eagle3 --prompts-npz tests/golden/reference.npz --json official.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a file, this folder is first on sys.path, where instruments/profile.py would shadow the standard library's
# `profile` (torch imports it through cProfile).
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402


def parse_envelopes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise SystemExit(f"--envelopes: expected total/depth/top_k, e.g. 60/7/10, got {item!r}")
        out.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return out


def head_kind(draft: Path) -> str:
    """'eagle3' if the head's state dict has the EAGLE-3 midlayer, else 'eagle1'."""
    binary = draft / "pytorch_model.bin"
    if binary.is_file():
        keys = list(torch.load(binary, map_location="cpu", weights_only=True))
    else:
        from safetensors import safe_open

        with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
            keys = list(f.keys())
    return "eagle3" if any(k.startswith("midlayer.") for k in keys) else "eagle1"


def timed(fn: Callable[..., Any], input_ids: torch.Tensor, max_new_tokens: int) -> tuple[float, np.ndarray, int]:
    """Seconds, output ids (prompt included) and idx + 1 (cycles, or plain steps) of one greedy generation."""
    start = time.perf_counter()
    ids, _, idx = fn(input_ids, temperature=0.0, max_new_tokens=max_new_tokens, log=True)
    return time.perf_counter() - start, ids[0].numpy(), int(idx) + 1


def recorded(model: Any, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """New token ids and accepted drafts per cycle of one greedy `eagenerate`: the official loop's
    `evaluate_posterior` is wrapped for the call to record each cycle's accept length."""
    module = sys.modules[type(model).__module__]
    official, lengths = module.evaluate_posterior, []

    def evaluate_posterior(*args, **kwargs):
        best, accept_length, sample_p = official(*args, **kwargs)
        lengths.append(int(accept_length))
        return best, accept_length, sample_p

    module.evaluate_posterior = evaluate_posterior
    try:
        ids = model.eagenerate(input_ids, temperature=0.0, max_new_tokens=max_new_tokens)
    finally:
        module.evaluate_posterior = official
    return ids[0, input_ids.shape[1] :].tolist(), lengths


def run_envelope(
    ea_model_cls: Any,
    args: argparse.Namespace,
    kind: str,
    envelope: tuple[int, int, int],
    prompts: list[torch.Tensor],
    ref: np.lib.npyio.NpzFile,
) -> dict:
    total, depth, top_k = envelope
    model = ea_model_cls.from_pretrained(
        use_eagle3=kind == "eagle3",
        base_model_path=str(args.target),
        ea_model_path=str(args.draft),
        total_token=total,
        depth=depth,
        top_k=top_k,
        torch_dtype=torch.float32,
    )
    model.eval()  # from_pretrained returns training mode, where the EAGLE-1 head takes a crashing checkpoint branch
    new = args.max_new_tokens
    for ids in prompts:  # warm-up
        model.eagenerate(ids, temperature=0.0, max_new_tokens=new)
        model.naivegenerate(ids, temperature=0.0, max_new_tokens=new)
    spec_s: list[float] = []
    plain_s: list[float] = []
    for _ in range(args.repeats):  # outputs are deterministic (greedy), so the last repeat's are kept
        runs = [(timed(model.eagenerate, ids, new), timed(model.naivegenerate, ids, new)) for ids in prompts]
        spec_s.append(sum(spec[0] for spec, _ in runs))
        plain_s.append(sum(plain[0] for _, plain in runs))
    spec_out, cycles = [spec[1] for spec, _ in runs], [spec[2] for spec, _ in runs]
    records = [recorded(model, ids, new) for ids in prompts]  # untimed
    plain_out = [plain[1] for _, plain in runs]
    spec_new = [len(o) - p.shape[1] for o, p in zip(spec_out, prompts, strict=True)]
    plain_new = [len(o) - p.shape[1] for o, p in zip(plain_out, prompts, strict=True)]
    run_key = f"{kind}.t{total}_d{depth}_k{top_k}"
    has_run = f"{run_key}.p0.output_ids" in ref.files
    spec_s_med, plain_s_med = statistics.median(spec_s), statistics.median(plain_s)
    return {
        "envelope": f"{total}/{depth}/{top_k}",
        "spec_new_tokens": sum(spec_new),
        "plain_new_tokens": sum(plain_new),
        "spec_seconds": spec_s_med,
        "plain_seconds": plain_s_med,
        "spec_seconds_all": spec_s,
        "plain_seconds_all": plain_s,
        "spec_tokens_per_s": sum(spec_new) / spec_s_med,
        "plain_tokens_per_s": sum(plain_new) / plain_s_med,
        "speedup": (sum(spec_new) / spec_s_med) / (sum(plain_new) / plain_s_med),
        "cycles": sum(cycles),
        "tau": sum(spec_new) / sum(cycles),
        "c": (spec_s_med / sum(cycles)) / (plain_s_med / sum(plain_new)) - 1,
        "per_prompt": [
            {
                "prompt_len": p.shape[1],
                "spec_new": s,
                "cycles": c,
                "plain_new": n,
                "output_ids": record[0],
                "accept_lengths": record[1],
            }
            for p, s, c, n, record in zip(prompts, spec_new, cycles, plain_new, records, strict=True)
        ],
        "reference_run": run_key if has_run else None,
        "spec_matches_reference_run": (
            all(np.array_equal(o, ref[f"{run_key}.p{i}.output_ids"]) for i, o in enumerate(spec_out))
            if has_run
            else None
        ),
        "spec_matches_greedy": all(
            np.array_equal(o, ref[f"p{i}.greedy_ids"][: len(o)]) for i, o in enumerate(spec_out)
        ),
        "plain_matches_naive": all(np.array_equal(o, ref[f"p{i}.naive_ids"]) for i, o in enumerate(plain_out)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle-repo", type=Path, required=True, help="checkout of SafeAILab/EAGLE (holds eagle/model)")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--prompts-npz", type=Path, required=True, help="reference.npz: p{i}.input_ids, i = 0, 1, ...")
    ap.add_argument("--kind", choices=("auto", "eagle3", "eagle1"), default="auto", help="auto: by the head's keys")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--envelopes", default="60/7/10,16/4/4", help="total_token/depth/top_k, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.eagle_repo.resolve()))
    import transformers
    from eagle.model.ea_model import EaModel

    transformers.logging.set_verbosity_error()  # the official rotary inv_freq buffer is reported "newly initialized"
    kind = head_kind(args.draft) if args.kind == "auto" else args.kind
    ref = np.load(args.prompts_npz)
    prompts = [
        torch.from_numpy(ref[f"p{i}.input_ids"])[None] for i in range(len(ref.files)) if f"p{i}.input_ids" in ref.files
    ]
    load_start = os.getloadavg()
    print(
        f"official EAGLE, {kind} head {args.draft}, target {args.target}; {len(prompts)} prompts, "
        f"max_new_tokens {args.max_new_tokens}, {args.repeats} repeats, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}; "
        f"load average {load_start[0]:.2f} on {os.cpu_count()} CPUs"
    )
    results = []
    for envelope in parse_envelopes(args.envelopes):
        start = time.perf_counter()
        r = run_envelope(EaModel, args, kind, envelope, prompts, ref)
        results.append(r)
        ref_check = (
            f"reference {r['reference_run']}: {'match' if r['spec_matches_reference_run'] else 'DIFFER'}"
            if r["reference_run"]
            else f"no reference run in {args.prompts_npz.name}"
        )
        print(
            f"{r['envelope']} done in {time.perf_counter() - start:.1f} s. Speculative outputs vs {ref_check}; "
            f"vs plain greedy: {'match' if r['spec_matches_greedy'] else 'DIFFER'}. Plain outputs vs "
            f"p{{i}}.naive_ids: {'match' if r['plain_matches_naive'] else 'DIFFER'}."
        )
    cols = (
        "envelope",
        "new tok spec/plain",
        "spec s",
        "plain s",
        "spec tok/s",
        "plain tok/s",
        "speedup",
        "cycles",
        "tau",
        "c",
    )
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in results:
        print(
            f"| {r['envelope']} | {r['spec_new_tokens']}/{r['plain_new_tokens']} | {r['spec_seconds']:.3f} | "
            f"{r['plain_seconds']:.3f} | {r['spec_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f} | {r['cycles']} | {r['tau']:.3f} | {r['c']:.2f} |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "kind": kind,
                    "target": str(args.target),
                    "draft": str(args.draft),
                    "eagle_repo": str(args.eagle_repo),
                    "max_new_tokens": args.max_new_tokens,
                    "repeats": args.repeats,
                    "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "load_average_start": load_start,
                    "load_average_end": os.getloadavg(),
                    "envelopes": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

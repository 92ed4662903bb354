"""Estimated speculative decoding speed on TPUs, without a TPU: compiler cost counts and a roofline.

    python -m instruments.tpu_estimate [--setup llama3.1-8b-eagle3@v6e-1 --setup llama3.3-70b-eagle3@v6e-8]
        [--trees 60/7/10,16/4/4,5/4/1] [--batch 1] [--context 1024] [--cpu] [--json OUT]

For each setup (a preset's target + head, bf16, abstract weights: nothing is allocated) one speculative
cycle per tree envelope and one plain decode step are compiled for the slice's topology by libtpu's
TPU compiler (no TPU needed; tensor parallel over the slice's chips, as the engine shards them), and
`cost_analysis()` gives flops and bytes accessed per chip. Roofline time = max(flops / peak,
bytes / HBM bandwidth) with the chip's published peak (v5e 197 TFLOP/s bf16, 819 GB/s; v6e 918 TFLOP/s,
1640 GB/s); c = cycle / step - 1 and the decoding speedup tau / (1 + c) for tau = 3, 4, 5. Two
bytes figures: the compiler's count (every operand of every fused op, layout copies included) and a
floor (the parameters and caches read once). This is an estimate, not a measurement: collectives,
launch overheads and below-peak kernels are left out.

Without libtpu (or with --cpu) XLA:CPU compiles the same programs on virtual CPU devices: its flops and
bytes are those of the same abstract shapes, a coarser stand-in for the TPU compiler's (it says so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
from tqdm import tqdm

from cli import command, plan
from eagle_jax.decoding.tree import parse_envelopes
from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.parallel import memory, sharding
from instruments import cost

TAUS = (3.0, 4.0, 5.0)
DEFAULT_SETUPS = (
    "llama3.1-8b-eagle3@v5e-1",  # target + head in bf16 exceed a v5e's 16 GiB: shown as refused
    "llama3.1-8b-eagle3@v5e-4",
    "llama3.1-8b-eagle3@v6e-1",
    "llama3.3-70b-eagle3@v6e-8",
)
DEFAULT_TREES = "60/7/10,16/4/4,5/4/1"

# slice -> (chip kind, chips, libtpu topology, chips per host)
SLICES = {
    "v5e-1": ("v5e", 1, "v5e:1x1", (1, 1, 1)),
    "v5e-4": ("v5e", 4, "v5e:2x2", (2, 2, 1)),
    "v5e-8": ("v5e", 8, "v5e:2x4", (2, 4, 1)),
    "v5p-8": ("v5p", 4, "v5p:2x2x1", (2, 2, 1)),
    "v6e-1": ("v6e", 1, "v6e:1x1", (1, 1, 1)),
    "v6e-4": ("v6e", 4, "v6e:2x2", (2, 2, 1)),
    "v6e-8": ("v6e", 8, "v6e:2x4", (2, 4, 1)),
}
HBM_GIB = {"v5e": 16, "v5p": 95, "v6e": 32}


def parse_setup(text: str) -> tuple[str, str]:
    config, sep, slice_ = text.partition("@")
    if not sep or slice_ not in SLICES:
        raise EagleError(f"bad setup {text!r}: expected PRESET@SLICE with SLICE in {', '.join(SLICES)}")
    return config, slice_


def estimate_row(chip: cost.Chip, tree: str, cycle: cost.Cost, step: cost.Cost, taus: Sequence[float] = TAUS) -> dict:
    """Roofline times of one cycle and one step, c and speedups, with the compiler's bytes and with the floor."""
    row = {
        "tree": tree,
        "cycle_gflop": cycle.flops / 1e9,
        "cycle_gb": cycle.bytes / 1e9,
        "cycle_floor_gb": cycle.resident / 1e9,
        "step_gflop": step.flops / 1e9,
        "step_gb": step.bytes / 1e9,
        "step_floor_gb": step.resident / 1e9,
        "cycle_bound": cycle.bound(chip),
    }
    for name, floor in (("", False), ("floor_", True)):
        cycle_s, step_s = cycle.roofline_s(chip, floor), step.roofline_s(chip, floor)
        c = cost.overhead(cycle_s, step_s)
        row[f"{name}cycle_ms"], row[f"{name}step_ms"], row[f"{name}c"] = 1e3 * cycle_s, 1e3 * step_s, c
        row[f"{name}speedup"] = {f"{tau:g}": cost.speedup(tau, c) for tau in taus}
    return row


def table(report: dict) -> str:
    """Markdown table of every setup's rows."""
    taus = report["taus"]
    head = (
        "| setup | tree | cycle GFLOP | cycle GB (floor) | step GFLOP | step GB (floor) | cycle ms | step ms | c | "
        + " | ".join(f"speedup tau={t:g}" for t in taus)
        + " | c (floor) | "
        + " | ".join(f"speedup tau={t:g} (floor)" for t in taus)
        + " |"
    )
    lines = [head, "|" + "---|" * (9 + 2 * len(taus) + 1)]
    for s in report["setups"]:
        for r in s["rows"]:
            lines.append(
                f"| {s['config']} @ {s['slice']} b{report['batch']} | {r['tree']} | {r['cycle_gflop']:.0f} | "
                f"{r['cycle_gb']:.1f} ({r['cycle_floor_gb']:.1f}) | {r['step_gflop']:.0f} | "
                f"{r['step_gb']:.1f} ({r['step_floor_gb']:.1f}) | {r['cycle_ms']:.2f} | {r['step_ms']:.2f} | "
                f"{r['c']:.2f} | "
                + " | ".join(f"{r['speedup'][f'{t:g}']:.2f}x" for t in taus)
                + f" | {r['floor_c']:.2f} | "
                + " | ".join(f"{r['floor_speedup'][f'{t:g}']:.2f}x" for t in taus)
                + " |"
            )
    return "\n".join(lines)


def compiler_backend(slices: Sequence[str], cpu: bool) -> bool:
    """True for libtpu's TPU compiler (installed, and not --cpu); else XLA:CPU gets a virtual device per chip of
    the largest slice, never fewer than XLA_FLAGS forces (other compiles in this process may need those)."""
    try:
        import libtpu  # noqa: F401

        use_tpu = not cpu
    except ImportError:
        use_tpu = False
    jax.config.update("jax_platforms", "cpu")
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    wanted = max(SLICES[s][1] for s in slices)
    if not use_tpu and wanted > (int(forced[1]) if forced else 1):
        with contextlib.suppress(RuntimeError):  # jax started already: devices_for says if too few
            jax.config.update("jax_num_cpu_devices", wanted)
    return use_tpu


def devices_for(slice_: str, use_tpu: bool) -> tuple[list, str]:
    kind, chips, topology, per_host = SLICES[slice_]
    if use_tpu:
        tpu = memory.Tpu(slice_, chips, HBM_GIB[kind], slice_, topology, per_host)
        devices = memory.tpu_devices(tpu)
        return devices, f"XLA:TPU ({devices[0].device_kind}, libtpu, no hardware)"
    if len(jax.devices("cpu")) < chips:
        raise EagleError(
            f"{slice_} needs {chips} virtual CPU devices, this process has {len(jax.devices('cpu'))}: run it in a "
            f"fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count={chips}"
        )
    return jax.devices("cpu")[:chips], "XLA:CPU (stand-in for the TPU compiler)"


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.tpu_estimate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--setup", action="append", help="PRESET@SLICE, repeatable (default: " + ", ".join(DEFAULT_SETUPS) + ")"
    )
    p.add_argument("--trees", default=DEFAULT_TREES, help="envelopes TOTAL/DEPTH/TOP_K, comma-separated")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024, help="cache slots every program attends over")
    p.add_argument("--cpu", action="store_true", help="compile with XLA:CPU even when libtpu is installed")
    p.add_argument("--quantize", help="the targets' weights quantised: int8 (as infer.generate --quantize)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    setups = [parse_setup(s) for s in a.setup or DEFAULT_SETUPS]
    trees = parse_envelopes(a.trees)
    use_tpu = compiler_backend([s for _, s in setups], a.cpu)
    report = {
        "what": "estimate, not a measurement: roofline of compiler cost counts (per chip), no TPU used",
        "batch": a.batch,
        "context": a.context,
        "dtype": "bfloat16",
        "quantize": a.quantize,
        "taus": list(TAUS),
        "setups": [],
    }
    bar = tqdm(total=len(setups) * (len(trees) + 1), desc="compile", unit="program", file=sys.stderr)
    for config, slice_ in setups:
        tcfg, dcfg, _, _ = plan.model_configs(config, quantize=a.quantize)
        devices, compiler = devices_for(slice_, use_tpu)
        mesh = sharding.make_mesh(f"tensor={len(devices)}" if len(devices) > 1 else None, devices)
        chip = cost.CHIPS[SLICES[slice_][0]]
        entry = {
            "config": config,
            "slice": slice_,
            "chip": dataclasses.asdict(chip),
            "compiler": compiler,
            "mesh": memory.mesh_text(mesh),
            "rows": [],
        }
        report["setups"].append(entry)
        done = 0
        try:
            step = cost.step_cost(tcfg, a.batch, a.context, mesh)
            bar.update()
            done += 1
            for tree in trees:
                cycle = cost.cycle_cost(tcfg, dcfg, tree, a.batch, a.context, mesh)
                entry["rows"].append(estimate_row(chip, f"{tree.total_tokens}/{tree.depth}/{tree.top_k}", cycle, step))
                bar.update()
                done += 1
        except jax.errors.JaxRuntimeError as exc:  # XLA:TPU refuses what exceeds a chip's HBM
            if not str(exc).startswith("RESOURCE_EXHAUSTED"):
                raise
            entry["refused"] = str(exc).splitlines()[0]
            bar.update(len(trees) + 1 - done)
    bar.close()
    weights = "bf16" + (f", {a.quantize} target weights" if a.quantize else "")
    print(f"ESTIMATE (no TPU was used): batch {a.batch}, {a.context} cache slots, {weights}; roofline per chip")
    for s in report["setups"]:
        print(f"  {s['config']} @ {s['slice']}: compiled by {s['compiler']}, mesh {s['mesh']}")
        if s.get("refused"):
            print(f"    refused by the compiler (does not fit): {s['refused']}")
    print(table(report))
    if a.json:
        files.write_json_atomic(Path(a.json), report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

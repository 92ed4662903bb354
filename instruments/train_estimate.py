"""Estimated EAGLE-3 training speed and memory on TPU slices, without a TPU: the step with the target
(online) against the step from stored features (offline, `train.features`), by the compiler's count.

    python -m instruments.train_estimate [--setup llama3.1-8b-eagle3@v5e-8 ...] [--length 2048]
        [--ttt-steps 7] [--batches 8,32] [--modes online,offline] [--cpu] [--json OUT] [--md OUT]

Rows are written to --json one by one: a rerun with the same --json continues with the rows not yet there
(and the table covers them all).

For each setup (a preset's target + head, bf16 compute, abstract weights: nothing is allocated), each mode
and each global batch, the training step (`train.step.plan_training`: fsdp over the slice's chips) is compiled
for the slice's topology by libtpu's compiler (no TPU needed). Its memory analysis says whether it fits
(XLA:TPU refuses a step whose temporaries exceed a chip's HBM); its cost analysis (the TTT steps are unrolled,
so each is counted) gives flops and bytes per chip (`step.step_flops_bytes`), and a roofline
max(flops / peak, bytes / HBM bandwidth) with the chip's published figures gives a step time and tokens/s
per chip; "compute ms" is the flops alone at peak. XLA's bytes count every operand of every fused op (an upper
bound on HBM traffic). An estimate, not a measurement: collectives, input loading and below-peak kernels are
left out.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from cli import command, plan
from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.parallel import memory, sharding
from eagle_jax.training import step
from instruments import cost
from instruments.tpu_estimate import HBM_GIB, SLICES, compiler_backend, devices_for, parse_setup

DEFAULT_SETUPS = tuple(
    f"{m}@{s}" for m in ("llama3.1-8b-eagle3", "llama3.3-70b-eagle3") for s in ("v5e-8", "v6e-8", "v5p-8")
)
MODES = ("online", "offline")


def estimate(config: str, slice_: str, mode: str, batch: int, length: int, ttt_steps: int, use_tpu: bool) -> dict:
    """One row: fits, peak per chip, flops and bytes per chip, roofline step time and tokens/s per chip."""
    tcfg, dcfg, _, _ = plan.model_configs(config)
    devices, compiler = devices_for(slice_, use_tpu)
    mesh = sharding.make_mesh(f"fsdp={len(devices)}", devices)
    chip = cost.CHIPS[SLICES[slice_][0]]
    hbm = HBM_GIB[SLICES[slice_][0]] * memory.GiB
    mem, flops, nbytes = step.step_flops_bytes(tcfg, dcfg, mesh, batch, length, ttt_steps, True, mode == "offline")
    (program,) = mem.programs
    row = {
        "setup": f"{config}@{slice_}",
        "mode": mode,
        "batch": batch,
        "length": length,
        "ttt_steps": ttt_steps,
        "compiler": compiler,
        "peak_gib": mem.peak / memory.GiB,
        "fits": not program.refused and mem.peak <= hbm,
        "refused": program.refused,
    }
    if flops:
        seconds = cost.Cost(flops, nbytes).roofline_s(chip)
        row.update(
            gflop=flops / 1e9,
            gb=nbytes / 1e9,
            step_ms=1e3 * seconds,
            compute_ms=1e3 * flops / chip.peak_flops,
            bound=cost.Cost(flops, nbytes).bound(chip),
            tokens_per_s_per_chip=batch * length / seconds / len(devices),
        )
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| setup | mode | batch x length | peak GiB/chip | fits | GFLOP/chip | GB/chip | compute ms | step ms | bound "
        "| tokens/s/chip |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        figures = (
            f"{r['gflop']:.0f} | {r['gb']:.1f} | {r['compute_ms']:.0f} | {r['step_ms']:.0f} | {r['bound']} | "
            f"{r['tokens_per_s_per_chip']:.0f}"
            if "gflop" in r
            else "- | - | - | - | - | -"
        )
        fits = "yes" if r["fits"] else "no (refused)" if r["refused"] else "no"
        lines.append(
            f"| {r['setup']} | {r['mode']} | {r['batch']} x {r['length']} | {r['peak_gib']:.1f} | {fits} | {figures} |"
        )
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.train_estimate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--setup", action="append", help="PRESET@SLICE, repeatable (default: " + ", ".join(DEFAULT_SETUPS) + ")"
    )
    p.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--batches", default="8,32", help="global batches (sequences per step), comma-separated")
    p.add_argument("--modes", default=",".join(MODES), help="online, offline or both, comma-separated")
    p.add_argument("--cpu", action="store_true", help="compile with XLA:CPU even when libtpu is installed")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--md", help="write the table to this Markdown file")
    a = p.parse_args(argv)
    setups = [parse_setup(s) for s in a.setup or DEFAULT_SETUPS]
    batches = [int(b) for b in a.batches.split(",")]
    use_tpu = compiler_backend([s for _, s in setups], a.cpu)
    modes = a.modes.split(",")
    if not set(modes) <= set(MODES):
        raise EagleError(f"--modes {a.modes}: choose from {', '.join(MODES)}")
    key = lambda r: (r["setup"], r["mode"], r["batch"], r["length"], r["ttt_steps"])  # noqa: E731
    rows = files.read_json(a.json)["rows"] if a.json and Path(a.json).is_file() else []  # an earlier run's: kept
    done = {key(r) for r in rows}
    jobs = [(c, s, m, b) for c, s in setups for m in modes for b in batches]
    jobs = [j for j in jobs if (f"{j[0]}@{j[1]}", j[2], j[3], a.length, a.ttt_steps) not in done]
    for config, slice_, mode, batch in tqdm(jobs, desc="compile", unit="step", file=sys.stderr):
        rows.append(estimate(config, slice_, mode, batch, a.length, a.ttt_steps, use_tpu))
        tqdm.write(table(rows[-1:]).splitlines()[-1], file=sys.stderr)
        if a.json:  # after each row: a rerun continues with the rows not yet there
            files.write_json_atomic(Path(a.json), {"what": "estimate, not a measurement", "rows": rows})
    text = (
        f"ESTIMATE (no TPU was used): EAGLE-3 training step, {a.ttt_steps} TTT steps, bf16 compute, fsdp over the "
        f"chips; roofline per chip\n\n{table(rows)}\n"
    )
    print(text)
    if a.md:
        files.write_text_atomic(Path(a.md), text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

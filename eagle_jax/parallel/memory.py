"""Memory per device of a sharded program, checked by the compiler: lower and compile on abstract
arguments (shapes, dtypes, shardings; nothing allocated) and read `compiled.memory_analysis()`.

Devices: virtual CPU devices (XLA:CPU), or a TPU slice's topology compiled by libtpu without the
hardware (`tpu_devices`); XLA:TPU refuses programs whose temporaries exceed a chip's HBM, which the
plan shows as such. Parameters, caches and state are exact; temporaries and the peak (arguments +
outputs - donated + temporaries) are the compiler's. XLA:CPU's are an estimate of a TPU's (it converts
bf16 matmul operands to f32 and fuses differently); XLA:TPU's are the real thing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from eagle_jax.errors import EagleError
from eagle_jax.models.params import is_spec

PyTree = Any
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Tpu:
    name: str  # the slice, as Cloud TPU names it
    chips: int  # JAX devices of the slice
    hbm_gib: float  # per chip
    accelerator: str  # Cloud TPU accelerator type
    topology: str  # libtpu topology name, for compiling without the hardware
    chips_per_host: tuple[int, int, int]


TPUS = (
    Tpu("v5e-8", 8, 16, "v5litepod-8", "v5e:2x4", (2, 4, 1)),
    Tpu("v5p-8", 4, 95, "v5p-8", "v5p:2x2x1", (2, 2, 1)),
    Tpu("v6e-8", 8, 32, "v6e-8", "v6e:2x4", (2, 4, 1)),
)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program's memory per device (bytes, from `compiled.memory_analysis()`).

    XLA:TPU refuses to compile a program whose temporaries exceed the chip's HBM: then `refused` holds
    its message and `temporaries` what it asked for.
    """

    name: str
    arguments: int
    outputs: int
    aliased: int  # outputs written in place of donated arguments
    temporaries: int
    refused: str | None = None
    flops: float = 0.0  # the compiler's cost analysis, per device (a loop body counted once)
    bytes_accessed: float = 0.0

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    title: str
    devices: int
    compiler: str  # whose memory_analysis: "XLA:CPU" or "XLA:TPU (TPU v5 lite)"
    resident: tuple[tuple[str, int], ...]  # (what, exact bytes per device) of the arrays kept on device
    programs: tuple[Program, ...]

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)


def tpu_devices(tpu: Tpu) -> list:
    """Compile-only devices of a TPU slice (libtpu's compiler, no TPU needed); the rest of jax stays on the CPU."""
    from jax.experimental import topologies

    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise EagleError(
            f"{tpu.name} compiles with libtpu, which is not installed; install the version "
            "your jax pins (pip install 'jax[tpu]'), or plan on virtual CPU devices",
            "tpu",
        ) from None
    jax.config.update("jax_platforms", "cpu")
    # a host without a TPU: tell libtpu not to look for one (else it warns about each missing variable)
    for name, value in (
        ("TPU_SKIP_MDS_QUERY", "1"),
        ("TPU_ACCELERATOR_TYPE", tpu.accelerator),
        ("TPU_WORKER_ID", "0"),
        ("TPU_WORKER_HOSTNAMES", "localhost"),
    ):
        os.environ.setdefault(name, value)
    return topologies.get_topology_desc(
        topology_name=tpu.topology, platform="tpu", chips_per_host_bounds=tpu.chips_per_host
    ).devices


# ---------------------------------------------------------------- accounting


def device_bytes(tree: PyTree) -> int:
    """Bytes one device holds of a tree of sharded `jax.ShapeDtypeStruct`s (the largest shard)."""

    def one(x) -> int:
        itemsize = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x.dtype.itemsize
        return math.prod(x.sharding.shard_shape(x.shape)) * itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def abstract(specs_or_shapes: PyTree, shardings: PyTree) -> PyTree:
    """ParamSpecs or ShapeDtypeStructs + NamedShardings -> sharded ShapeDtypeStructs (no memory)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), specs_or_shapes, shardings, is_leaf=is_spec
    )


# XLA:CPU has no bf16 matmul: it converts bf16 weights to f32 and, by default, hoists those converts out of
# the layer scan and the generation loop, i.e. keeps an f32 copy of every weight. TPUs compute bf16 natively,
# so the plan keeps the converts inside the loops (one layer's f32 copy at a time).
CPU_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def compile_program(name: str, mesh: Mesh, fn: Any, *args: Any) -> Program:
    """Lower and compile fn on the abstract args for the mesh's devices; its memory per device."""
    options = CPU_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None
    lowered = fn.lower(*args)
    try:
        compiled = lowered.compile(options)
    except jax.errors.JaxRuntimeError as exc:
        asked = re.search(r"HLO temporaries \(([0-9.]+)G\)", str(exc))
        if not str(exc).startswith("RESOURCE_EXHAUSTED") or asked is None:
            raise
        return Program(name, device_bytes(args), 0, 0, int(float(asked.group(1)) * GiB), str(exc).splitlines()[0])
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return Program(
        name,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
        m.temp_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def compiler_name(mesh: Mesh) -> str:
    device = mesh.devices.flat[0]
    return f"XLA:TPU ({device.device_kind})" if device.platform == "tpu" else f"XLA:{device.platform.upper()}"


def mesh_text(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"


# ---------------------------------------------------------------- report


def size(n: int) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:8.2f} MiB"


def fits(plan: MemoryPlan, tpus: Sequence[Tpu] = TPUS) -> list[str]:
    lines = []
    for tpu in tpus:
        spare = tpu.hbm_gib * GiB - plan.peak
        verdict = f"fits, {spare / GiB:.1f} GiB spare" if spare >= 0 else f"does not fit, {-spare / GiB:.1f} GiB short"
        note = (
            f" (the slice has {tpu.chips} devices, this plan {plan.devices}: plan it with --devices {tpu.chips})"
            if tpu.chips != plan.devices
            else ""
        )
        lines.append(f"  TPU {tpu.name:6s} {tpu.chips} x {tpu.hbm_gib:g} GiB: {verdict}{note}")
    return lines


def report(name: str, plan: MemoryPlan, tpus: Sequence[Tpu] = TPUS) -> str:
    lines = [f"{name}: {plan.title}, {plan.devices} devices ({plan.compiler})", "per device:"]
    lines += [f"  {what:34s} {size(n)}" for what, n in plan.resident]
    for p in plan.programs:
        lines.append(f"  {p.name}:")
        if p.refused:
            lines.append(f"    refused by the compiler: {p.refused}")
        lines.append(f"    {'arguments + outputs - donated':32s} {size(p.arguments + p.outputs - p.aliased)}")
        lines.append(f"    {'temporaries':32s} {size(p.temporaries)}")
        lines.append(f"    {'peak':32s} {size(p.peak)}{' (at least)' if p.refused else ''}")
    lines.append(f"peak per device {size(plan.peak).strip()}:")
    return "\n".join(lines + fits(plan, tpus))

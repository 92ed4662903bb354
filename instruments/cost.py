"""What one speculative cycle and one plain decode step cost, by the compiler's count (flops and bytes per device).

Both are lowered on abstract parameters and state (shapes, dtypes, shardings; nothing allocated), compiled for a
mesh's devices (virtual CPU devices, or a TPU topology through libtpu without the hardware), and read through
`compiled.cost_analysis()`: flops and bytes accessed per device, and XLA:TPU's own time estimate.

A roofline turns them into times on a chip: max(flops / peak flops, bytes / HBM bandwidth). It leaves
out collectives, launch overheads and anything slower than the peak, so it is an estimate (a lower
bound), not a measurement.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eagle_jax.decoding import programs, speculative
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, TreeConfig
from eagle_jax.models import draft, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.params import with_dtype
from eagle_jax.parallel.memory import CPU_OPTIONS, abstract, device_bytes
from eagle_jax.parallel.sharding import check_mesh


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip


# Published per-chip figures (Cloud TPU documentation).
CHIPS = {
    "v5e": Chip("TPU v5e", 197e12, 819e9),
    "v5p": Chip("TPU v5p", 459e12, 2765e9),
    "v6e": Chip("TPU v6e", 918e12, 1640e9),
}


@dataclasses.dataclass(frozen=True)
class Cost:
    """One compiled program per device: flops, bytes accessed, and the compiler's own estimate (XLA:TPU only)."""

    flops: float
    bytes: float
    resident: float = 0.0  # bytes of the parameters and caches the program reads: a floor under `bytes`
    compiler_s: float | None = None

    def roofline_s(self, chip: Chip, floor: bool = False) -> float:
        """max(flops / peak, bytes / bandwidth); floor: with the resident bytes instead of the compiler's count."""
        return max(self.flops / chip.peak_flops, (self.resident if floor else self.bytes) / chip.hbm_bandwidth)

    def bound(self, chip: Chip) -> str:
        return "compute" if self.flops / chip.peak_flops >= self.bytes / chip.hbm_bandwidth else "memory"


def cost_of(compiled: Any, resident: float = 0.0) -> Cost:
    """The compiled program's cost analysis (XLA:TPU's `optimal_seconds` kept when it is a time, > 0)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list | tuple) else ca
    seconds = ca.get("optimal_seconds")
    seconds = float(seconds) if seconds is not None and seconds > 0 else None
    return Cost(float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0)), float(resident), seconds)


def overhead(cycle_s: float, step_s: float) -> float:
    """c = cycle time / plain step time - 1."""
    return cycle_s / step_s - 1


def speedup(tau: float, c: float) -> float:
    """Decoding speedup tau / (1 + c) of cycles yielding tau tokens each."""
    return tau / (1 + c)


def _compile(mesh: Mesh, fn: Any, *args: Any) -> Any:
    options = CPU_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None
    return fn.lower(*args).compile(options)


def cycle_cost(
    tcfg: TargetConfig,
    dcfg: DraftConfig | None,
    tree: TreeConfig,
    batch: int,
    capacity: int,
    mesh: Mesh,
    dtype: Any = jnp.bfloat16,
    sampling: SamplingConfig = SamplingConfig(),
) -> Cost:
    """One cycle (draft tree, verification, acceptance, draft catch-up) of `batch` rows attending over `capacity`
    cache slots, sharded as the engine shards it on `mesh`: its cost per device. Plain decoding's step is the
    cycle of `tree.PLAIN` without a head (`step_cost`)."""
    check_mesh(mesh, tcfg, dcfg, batch)
    cfg = speculative.DecodeConfig(tcfg, dcfg, tree, sampling)
    progs = programs.spec_programs(cfg, capacity, mesh)  # the engine's shardings
    tsh, dsh, ssh = progs.target, progs.draft, progs.state
    tparams = abstract(with_dtype(target.param_specs(tcfg), dtype), tsh)
    dparams = abstract(with_dtype(draft.param_specs(dcfg), dtype), dsh) if dcfg is not None else None
    state = abstract(jax.eval_shape(lambda: speculative.empty_state(cfg, batch, capacity, dtype)), ssh)

    def one_cycle(tp, dp, s):  # the program's name in the compiler's reports
        return speculative.one_cycle(tp, dp, s, cfg, capacity)[0]

    cycle = jax.jit(one_cycle, in_shardings=(tsh, dsh, ssh), out_shardings=ssh, donate_argnums=(2,))
    reads = device_bytes((tparams, dparams, state.target_cache, state.draft_cache))
    return cost_of(_compile(mesh, cycle, tparams, dparams, state), reads)


def step_cost(
    tcfg: TargetConfig,
    batch: int,
    capacity: int,
    mesh: Mesh,
    dtype: Any = jnp.bfloat16,
    sampling: SamplingConfig = SamplingConfig(),
) -> Cost:
    """One plain decode step of `batch` rows attending over `capacity` cache slots on `mesh`: its cost per device."""
    return cycle_cost(tcfg, None, PLAIN, batch, capacity, mesh, dtype, sampling)

"""Multi-host start: call `jax.distributed.initialize()` when the environment says we are one of several processes.

Every process of a multi-host job (a TPU pod slice with more than one host, several slices, a SLURM
or Open MPI job, or an explicit coordinator) must call `maybe_initialize()` before anything touches
a device; the CLIs do it first thing. A single host is left alone. Recognised, in this order:

- `EAGLE_JAX_DISTRIBUTED=0|1`: force off / on (on: `initialize()` with JAX's own cluster detection;
  use it on Cloud TPU VM pods started with `gcloud ... ssh --worker=all`, which set no variables);
- `COORDINATOR_ADDRESS` (host:port) + `NUM_PROCESSES` + `PROCESS_ID`: passed on explicitly;
- `JAX_COORDINATOR_ADDRESS` (JAX reads it, with `JAX_NUM_PROCESSES` / `JAX_PROCESS_ID` if set);
- TPU on GKE: `TPU_WORKER_HOSTNAMES` or `TPU_PROCESS_ADDRESSES` listing more than one host;
- multislice TPU: `MEGASCALE_NUM_SLICES` > 1 or `MEGASCALE_COORDINATOR_ADDRESS`;
- SLURM: `SLURM_JOB_ID` with `SLURM_NTASKS` (or `SLURM_STEP_NUM_TASKS`) > 1;
- Open MPI: `OMPI_COMM_WORLD_SIZE` > 1.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax
import numpy as np

from eagle_jax.errors import EagleError

MIN_MESSAGE = 256  # bytes: messages are padded to powers of two from here (one compiled broadcast per size)


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the environment says: why we are multi-host, and the arguments for `jax.distributed.initialize`."""

    reason: str
    kwargs: dict


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise EagleError(f"environment variable {name}={value!r} must be a non-negative integer")
    return int(value)


def _more_than_one(env: Mapping[str, str], *names: str) -> str | None:
    """The first of `names` that is set to an integer > 1."""
    return next((n for n in names if n in env and _int(env, n) > 1), None)


def detect(env: Mapping[str, str] | None = None) -> Launch | None:
    """The multi-host launch the environment describes, or None for a single process."""
    env = os.environ if env is None else env
    forced = env.get("EAGLE_JAX_DISTRIBUTED", "").strip()
    if forced not in ("", "0", "1"):
        raise EagleError(f"EAGLE_JAX_DISTRIBUTED={forced!r} must be 0 or 1")
    if forced == "0":
        return None
    if forced == "1":
        return Launch("EAGLE_JAX_DISTRIBUTED=1", {})
    if "COORDINATOR_ADDRESS" in env:
        missing = [n for n in ("NUM_PROCESSES", "PROCESS_ID") if n not in env]
        if missing:
            raise EagleError(f"COORDINATOR_ADDRESS is set but {' and '.join(missing)} is not; set all three")
        n, i = _int(env, "NUM_PROCESSES"), _int(env, "PROCESS_ID")
        if not 0 <= i < n:
            raise EagleError(f"PROCESS_ID={i} must lie in [0, NUM_PROCESSES={n})")
        if n == 1:
            return None
        return Launch(
            f"COORDINATOR_ADDRESS with {n} processes",
            {"coordinator_address": env["COORDINATOR_ADDRESS"], "num_processes": n, "process_id": i},
        )
    if "JAX_COORDINATOR_ADDRESS" in env:
        return Launch("JAX_COORDINATOR_ADDRESS", {})
    for name in ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES"):
        hosts = [h for h in env.get(name, "").split(",") if h.strip()]
        if len(hosts) > 1:
            return Launch(f"{name} lists {len(hosts)} TPU hosts", {})
    if name := _more_than_one(env, "MEGASCALE_NUM_SLICES"):
        return Launch(f"{name}={env[name]}", {})
    if "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return Launch("MEGASCALE_COORDINATOR_ADDRESS", {})
    if "SLURM_JOB_ID" in env and (name := _more_than_one(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")):
        return Launch(f"SLURM job with {name}={env[name]}", {})
    if name := _more_than_one(env, "OMPI_COMM_WORLD_SIZE"):
        return Launch(f"Open MPI job with {name}={env[name]}", {})
    return None


def maybe_initialize(env: Mapping[str, str] | None = None) -> str | None:
    """Initialise JAX's distributed runtime when `detect` finds a multi-host launch; returns the reason or None.

    Call before any device use. Safe to call twice (the second call does nothing).
    """
    launch = detect(env)
    if launch is None or jax.distributed.is_initialized():
        return None
    jax.distributed.initialize(**launch.kwargs)
    return launch.reason


def is_multi_host() -> bool:
    return jax.process_count() > 1


def host_value(tree):
    """A pytree of arrays read whole on this host (numpy), also where they are split over several hosts'
    devices: then every process must call it at the same point, for it gathers."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def message_size(size: int) -> int:
    """Bytes a message of `size` bytes is sent as."""
    return max(MIN_MESSAGE, 1 << max(0, size - 1).bit_length())


def broadcast(message: bytes | None) -> bytes | None:
    """Process 0's `message` on every process (None: it has no more to say), over the devices' collectives.

    Every process calls it at the same point; the argument is read on process 0 only. A message goes as a
    fixed header then (unless empty) its bytes padded to `message_size`, so each size compiles one small program.
    """
    from jax.experimental import multihost_utils

    source = jax.process_index() == 0
    header = np.asarray([message is not None, len(message or b"")] if source else [0, 0], np.int32)
    present, size = (int(v) for v in multihost_utils.broadcast_one_to_all(header))
    if not present or not size:
        return b"" if present else None
    body = np.zeros(message_size(size), np.uint8)
    if source:
        body[:size] = np.frombuffer(message, np.uint8)
    return multihost_utils.broadcast_one_to_all(body)[:size].tobytes()

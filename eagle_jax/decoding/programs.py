"""The engine's programs on a device mesh, compiled ahead of time, and the memory plan they need.

Parameters, KV caches and loop state are placed by their logical axes (`sharding.LOGICAL_RULES`):
attention heads, MLP width and vocabularies over `tensor`, batch rows over `data` (and `fsdp`),
everything else replicated, so the state keeps its layout across cycles and the loop never reshards.
The model code is unchanged: XLA's partitioner derives the collectives from the placements.
`Precompiled` compiles the engine's programs on worker threads (and keeps them in the executable store);
`plan_inference` compiles the sharded prefill and generation loop with abstract parameters for their memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Collection
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from eagle_jax.decoding import executables, speculative
from eagle_jax.decoding.logprobs import Logprobs
from eagle_jax.decoding.rows import RowControls
from eagle_jax.decoding.speculative import DecodeConfig, SpecState
from eagle_jax.decoding.tree import DynamicTree, TreeConfig
from eagle_jax.errors import EagleError
from eagle_jax.models import draft, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.kv_cache import CACHE_AXES, KVCache
from eagle_jax.models.params import with_dtype
from eagle_jax.parallel import sharding
from eagle_jax.parallel.memory import MemoryPlan, abstract, compile_program, compiler_name, device_bytes, mesh_text
from eagle_jax.parallel.sharding import check_mesh, draft_shardings, target_shardings

PyTree = Any
BATCH = ("batch",)


def _named(mesh: Mesh, rules: dict, axes: tuple[str | None, ...]) -> NamedSharding:
    """Logical axes -> NamedSharding (sizes are assumed checked by `check_mesh`)."""
    return NamedSharding(mesh, sharding.partition_spec(axes, rules))


def cache_shardings(num_kv_heads: int, mesh: Mesh) -> KVCache:
    """KV caches [L, B, S, KV, D]: batch over data, kv heads over tensor (or replicated), lengths over data."""
    rules = sharding.rules_for(num_kv_heads, mesh)
    return KVCache(_named(mesh, rules, CACHE_AXES), _named(mesh, rules, CACHE_AXES), _named(mesh, rules, BATCH))


def spec_state_shardings(
    tcfg: TargetConfig, dcfg: DraftConfig | None, mesh: Mesh, per_row: bool = False, logprobs: int = 0
) -> SpecState:
    """The speculative loop state: caches as `cache_shardings`, per-row fields over data, the rest replicated;
    `per_row`: with per-row sampling controls (a server's batch), also over data; `logprobs`: with their buffers."""
    by_row, by_row_wide, by_step, replicated = (
        _named(mesh, sharding.LOGICAL_RULES, axes) for axes in (BATCH, ("batch", None), (None, "batch"), ())
    )
    head = dcfg is not None
    return SpecState(
        target_cache=cache_shardings(tcfg.num_kv_heads, mesh),
        draft_cache=cache_shardings(dcfg.num_kv_heads, mesh) if head else None,
        root=by_row,
        draft_hidden=by_row_wide if head else None,
        history=by_row_wide,
        out=by_row_wide,
        counts=by_row,
        limits=by_row,
        done=by_row,
        eos=by_row,
        cycle=replicated,
        accept_lengths=by_step,
        key=replicated,
        controls=RowControls(by_row, by_row, by_row, by_row) if per_row else None,
        logprobs=Logprobs(by_row, by_row_wide, by_row_wide, by_row_wide) if logprobs else None,
        sources=by_row_wide,
    )


@dataclasses.dataclass(frozen=True)
class SpecPrograms:
    """The engine's prefill and generation loop for one setting, jitted with in/out shardings.

    prefill(tparams, dparams, tokens [B, P], lengths [B], limits [B], key) -> SpecState
    run(tparams, dparams, state) -> SpecState (state donated; attention spans the whole cache)
    """

    target: PyTree  # NamedShardings of the target parameters
    draft: PyTree
    state: SpecState
    rows: NamedSharding  # [B, ...] host inputs
    replicated: NamedSharding
    prefill: Any
    run: Any


@functools.lru_cache(maxsize=16)
def spec_programs(cfg: DecodeConfig, capacity: int, mesh: Mesh) -> SpecPrograms:
    tcfg, dcfg = cfg.tcfg, cfg.dcfg
    check_mesh(mesh, tcfg, dcfg)
    tsh, dsh = target_shardings(tcfg, mesh), draft_shardings(dcfg, mesh) if dcfg is not None else None
    ssh = spec_state_shardings(tcfg, dcfg, mesh)
    rows, replicated = ssh.counts, ssh.key
    prefill = jax.jit(
        functools.partial(speculative.prefill, capacity=capacity, cfg=cfg),
        in_shardings=(tsh, dsh, rows, rows, rows, replicated),
        out_shardings=ssh,
    )
    run = jax.jit(
        functools.partial(speculative.run_loop, cfg=cfg),
        in_shardings=(tsh, dsh, ssh),
        out_shardings=ssh,
        donate_argnums=(2,),
    )
    return SpecPrograms(tsh, dsh, ssh, rows, replicated, prefill, run)


# Programs compiled ahead of time: lowered on arguments shaped like the real ones and compiled on worker threads,
# so nothing runs to compile them, several compile at once (XLA compiles a program on one core), and a program a
# caller needs first is not held up by the rest (`EAGLE_JAX_COMPILE_WORKERS` at once). The executable store
# (`executables`) serves a second start.
COMPILE_WORKERS = int(os.environ.get("EAGLE_JAX_COMPILE_WORKERS") or min(4, os.cpu_count() or 1))
_COMPILER = concurrent.futures.ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="eagle-jax-compile")
_COMPILED: dict[tuple, concurrent.futures.Future] = {}
_COMPILED_LOCK = threading.Lock()


def _shape(x: Any) -> jax.ShapeDtypeStruct:
    """An argument's shape, dtype and placement (none for one device's: jit moves those where they are needed)."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):  # a shape from `jax.eval_shape` is placed as its array is
        placed = x.sharding is not None and len(x.sharding.device_set) > 1
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if placed else None)
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)


def _program(fn: Any, args: tuple, static: dict) -> tuple:
    """What identifies a compiled program: the function, its static arguments, and its arguments' shapes."""
    leaves, tree = jax.tree.flatten(args)
    return fn, tuple(sorted(static.items())), tree, tuple(_shape(x) for x in leaves)


def _executable(program: tuple) -> jax.stages.Compiled:
    """A program loaded from the executable store (`executables`), else traced, lowered, compiled and stored."""
    fn, static, tree, shapes = program
    name = executables.key(*program)
    compiled = executables.load(name) if name else None
    if compiled is None:
        compiled = fn.lower(*tree.unflatten(shapes), **dict(static)).compile()
        if name:
            executables.store(name, compiled)
    return compiled


def _compile(program: tuple, here: bool = False) -> concurrent.futures.Future:
    """The future of a program's executable: the one under way or done, else (never asked, cancelled or failed) a
    new one, compiled on a worker thread, or on this thread with `here` (a caller that would only wait for it)."""
    with _COMPILED_LOCK:
        known = _COMPILED.get(program)
        fresh = known is None or known.cancelled() or (known.done() and known.exception() is not None)
        if fresh:
            _COMPILED[program] = concurrent.futures.Future() if here else _COMPILER.submit(_executable, program)
        future = _COMPILED[program]
    if fresh and here and future.set_running_or_notify_cancel():  # other callers wait on the future meanwhile
        try:
            future.set_result(_executable(program))
        except Exception as exc:  # noqa: BLE001 (the caller and any other waiter get it from the future)
            future.set_exception(exc)
    return future


def forget() -> None:
    """Let go of the programs compiled so far (engines keep theirs): the next engine compiles its own afresh."""
    with _COMPILED_LOCK:
        _COMPILED.clear()


def compiling() -> bool:
    """Whether a compilation is under way on a worker thread (a process that ends normally waits for it)."""
    with _COMPILED_LOCK:
        return any(future.running() for future in _COMPILED.values())


def compile_ahead(fn: Any, *args: Any, **static: Any) -> concurrent.futures.Future:
    """The jitted `fn` compiled for arguments shaped (and placed) like `args`, with its static arguments `static`,
    on a worker thread: a future of the executable (called with `args` alone). Asked again, the same future."""
    return _compile(_program(fn, args, static))


class Precompiled:
    """Named programs compiled ahead of time (`compile_ahead`): `submit` starts one, calling one waits for its own
    compilation only (starting it if nobody has), `wait` for all that were started."""

    def __init__(self):
        self._programs: dict[str, tuple] = {}
        self._ready: dict[str, Any] = {}

    def submit(self, name: str, fn: Any, *args: Any, here: bool = False, **static: Any) -> concurrent.futures.Future:
        if name not in self._programs:
            self._programs[name] = _program(fn, args, static)
        return _compile(self._programs[name], here)

    def __call__(self, name: str, fn: Any, *args: Any, **static: Any) -> Any:
        """fn(*args, **static) with the program compiled for `name` (compiled on this thread when nobody has started
        it: the caller waits for it either way)."""
        executable = self._ready.get(name)
        if executable is None:
            executable = self._ready[name] = self.submit(name, fn, *args, here=True, **static).result()
        return executable(*args)

    def wait(self, names: Collection[str] | None = None) -> None:
        """Until the programs started (those of `names` only, when given) are compiled."""
        for name, program in self._programs.items():
            if names is None or name in names:
                _compile(program).result()

    def cancel(self) -> int:
        """Drop the compilations not yet begun (a process that ends waits for those under way only; asked for
        again, they start again); how many."""
        return sum(_compile(program).cancel() for program in self._programs.values())


def plan_inference(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    mesh: Mesh,
    batch: int,
    max_len: int,
    dtype: Any,
    tree: TreeConfig = DynamicTree(),
    prompt_len: int | None = None,
) -> MemoryPlan:
    """Compile the sharded prefill (prompts [batch, prompt_len], default max_len) and generation loop with
    abstract parameters; their memory per device."""
    check_mesh(mesh, tcfg, dcfg, batch)
    prompt_len = prompt_len or max_len
    if not tree.cache_overhead < max_len or not 0 < prompt_len <= max_len:
        raise EagleError(
            f"a cache of {max_len} slots must exceed one cycle's {tree.cache_overhead} slots and hold the "
            f"{prompt_len}-token prompt"
        )
    progs = spec_programs(DecodeConfig(tcfg, dcfg, tree), max_len, mesh)
    tparams = abstract(with_dtype(target.param_specs(tcfg), dtype), progs.target)
    dparams = abstract(with_dtype(draft.param_specs(dcfg), dtype), progs.draft)
    rows = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=progs.rows)  # noqa: E731
    key = jax.ShapeDtypeStruct((), jax.eval_shape(jax.random.key, 0).dtype, sharding=progs.replicated)
    inputs = (rows((batch, prompt_len)), rows((batch,)), rows((batch,)), key)
    state = abstract(jax.eval_shape(progs.prefill, tparams, dparams, *inputs), progs.state)
    caches = (state.target_cache, state.draft_cache)
    resident = (
        ("target parameters", device_bytes(tparams)),
        ("draft parameters", device_bytes(dparams)),
        ("target KV cache", device_bytes(state.target_cache)),
        ("draft KV cache", device_bytes(state.draft_cache)),
        ("other loop state", device_bytes(state) - device_bytes(caches)),
    )
    compiled = (
        compile_program(f"prefill ({prompt_len}-token prompts)", mesh, progs.prefill, tparams, dparams, *inputs),
        compile_program("generation loop (cycles)", mesh, progs.run, tparams, dparams, state),
    )
    weights = jnp.dtype(dtype).name + (f" ({tcfg.quantize} target weights)" if tcfg.quantize else "")
    title = f"inference: batch {batch}, max-len {max_len}, {weights}, tree {tree}, mesh {mesh_text(mesh)}"
    return MemoryPlan(title, mesh.size, compiler_name(mesh), resident, compiled)

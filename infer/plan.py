"""Memory plan checked by the compiler: bytes per device of the speculative cycle or a TTT training step.

    python -m infer.plan --config llama3.3-70b-eagle3 --mesh tensor=8 --batch 8 --max-len 4096 [--tpu v6e-8]
    python -m infer.plan --train --config llama3.3-70b-eagle3 --mesh fsdp=8 --batch 8 --max-len 1024 --bf16
    (`python -m train.eagle3 --plan ...` runs the second)

The program is lowered with abstract parameters (shapes, dtypes and shardings only: no weights are
allocated) and compiled by XLA's SPMD partitioner for the mesh. Inference compiles the engine's
prefill (by default a prompt filling the whole cache, the worst case) and its generation loop
(`lax.while_loop` over draft -> verify -> accept cycles); training compiles the trainer's jitted step
(frozen target forward + TTT loss + AdamW update, `train.eagle3.make_train_step`).

Devices: by default N virtual CPU devices (`--devices`, default the mesh's size), compiled by XLA:CPU.
With `--tpu v5e-8|v5p-8|v6e-8` the TPU compiler in libtpu compiles for that slice's topology (no TPU
needed, only the libtpu package); it refuses programs whose temporaries exceed a chip's HBM, which the
report shows as such.

--config is a preset (configs/NAME.json, by name or path), an eagle-jax store or a Hugging Face model
directory. A preset's dimensions come from its checkpoints' config.json under --models when they are
there, else from the public values built in below for its hub names; a model directory (or a store
without a head) gets an EAGLE-3 head shaped like one of its layers.

Parameters, KV caches and loop state are exact (shapes and shardings). Temporaries and the peak
(arguments + outputs - donated + temporaries) are the compiler's `memory_analysis()`. XLA:CPU's are an
estimate of a TPU's (it converts bf16 matmul operands to f32 and fuses differently); XLA:TPU's are
the real thing. The verdict compares the peak with each chip's nominal HBM.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from cli import command, presets
from eagle_jax.decoding import programs
from eagle_jax.decoding.speculative import SpecConfig
from eagle_jax.errors import EagleError
from eagle_jax.io import store
from eagle_jax.models import draft, target
from eagle_jax.models.config import TargetConfig, load_target_config, read_json, target_config_from_hf
from eagle_jax.models.draft import DraftConfig, draft_config_from_hf
from eagle_jax.models.params import is_spec, with_dtype
from eagle_jax.parallel import sharding
from eagle_jax.training import objective

PyTree = Any
GiB = 2**30

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072, "tie_word_embeddings": False,
          "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
_EAGLE3 = {"num_hidden_layers": 1, "vocab_size": 128256, "draft_vocab_size": 32000, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 2048}
# Public config.json values of the checkpoints the presets name (used when they are not downloaded).
HUB_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.3-70B-Instruct": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672,
                                          "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8},
    "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B": {**_EAGLE3, "hidden_size": 8192, "intermediate_size": 28672,
                                             "num_attention_heads": 64, "num_key_value_heads": 8},
    "meta-llama/Llama-3.1-8B-Instruct": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336,
                                         "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8},
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": {**_EAGLE3, "hidden_size": 4096, "intermediate_size": 14336,
                                            "num_attention_heads": 32, "num_key_value_heads": 8},
}


@dataclasses.dataclass(frozen=True)
class Tpu:
    name: str  # the slice, as Cloud TPU names it
    chips: int  # JAX devices of the slice
    hbm_gib: float  # per chip
    accelerator: str  # Cloud TPU accelerator type
    topology: str  # libtpu topology name, for compiling without the hardware
    chips_per_host: tuple[int, int, int]


TPUS = (Tpu("v5e-8", 8, 16, "v5litepod-8", "v5e:2x4", (2, 4, 1)), Tpu("v5p-8", 4, 95, "v5p-8", "v5p:2x2x1", (2, 2, 1)),
        Tpu("v6e-8", 8, 32, "v6e-8", "v6e:2x4", (2, 4, 1)))


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

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class Plan:
    title: str
    devices: int
    compiler: str  # whose memory_analysis: "XLA:CPU" or "XLA:TPU (TPU v5 lite)"
    resident: tuple[tuple[str, int], ...]  # (what, exact bytes per device) of the arrays kept on device
    programs: tuple[Program, ...]

    @property
    def peak(self) -> int:
        return max(p.peak for p in self.programs)


# ---------------------------------------------------------------- devices


def use_cpu_devices(n: int, argv: Sequence[str]) -> list:
    """n virtual CPU devices: configure jax before its backend starts, else re-execute this module."""
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # jax started already (perhaps with the right devices)
        pass
    if jax.default_backend() == "cpu" and jax.device_count() == n:
        return jax.devices()
    if os.environ.get("EAGLE_JAX_PLAN_CHILD"):
        raise EagleError(f"could not get {n} virtual CPU devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
    env = {**os.environ, "EAGLE_JAX_PLAN_CHILD": "1", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "infer.plan", *argv], env)


def tpu_devices(tpu: Tpu) -> list:
    """Compile-only devices of a TPU slice (libtpu's compiler, no TPU needed); the rest of jax stays on the CPU."""
    from jax.experimental import topologies

    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise EagleError(f"--tpu {tpu.name} compiles with libtpu, which is not installed; install the version "
                         "your jax pins (pip install 'jax[tpu]'), or plan on virtual CPU devices without --tpu") from None
    jax.config.update("jax_platforms", "cpu")
    # a host without a TPU: tell libtpu not to look for one (else it warns about each missing variable)
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", tpu.accelerator), ("TPU_WORKER_ID", "0"),
                        ("TPU_WORKER_HOSTNAMES", "localhost")):
        os.environ.setdefault(name, value)
    return topologies.get_topology_desc(topology_name=tpu.topology, platform="tpu",
                                        chips_per_host_bounds=tpu.chips_per_host).devices


# ---------------------------------------------------------------- configs


def model_configs(config: str, models: str | None = None,
                  draft_vocab: int = 32000) -> tuple[TargetConfig, DraftConfig, Any, str | None]:
    """(TargetConfig, DraftConfig, tree or None, dtype name or None) from a preset or an HF model directory."""
    path = Path(config)
    if store.is_store(path):
        m = store.read_manifest(path)
        if m.target_config is None:
            raise EagleError(f"{path}: the store holds no target")
        tcfg = target_config_from_hf(m.target_config)
        dcfg = (draft_config_from_hf(m.draft_config, m.draft_kind) if m.draft_config is not None
                else head_like(tcfg, min(draft_vocab, tcfg.vocab_size)))
        return tcfg, dcfg, None, None
    if path.is_dir():
        tcfg = load_target_config(path)
        return tcfg, head_like(tcfg, min(draft_vocab, tcfg.vocab_size)), None, None
    preset = presets.load_preset(config)

    def raw(which: str) -> dict:
        ref = preset.target if which == "target" else preset.draft
        local = Path(models or os.environ.get(presets.MODELS_ENV) or "models") / ref.dir / "config.json"
        if local.is_file():
            return read_json(local)
        if ref.hub not in HUB_CONFIGS:
            preset.model_dir(which, models)  # raises: says where to put the checkpoint
        return HUB_CONFIGS[ref.hub]

    tcfg = target_config_from_hf(raw("target"))
    return tcfg, draft_config_from_hf(raw("draft"), preset.draft_kind), preset.tree, preset.dtype


def head_like(tcfg: TargetConfig, draft_vocab: int) -> DraftConfig:
    """An EAGLE-3 head shaped like one target layer."""
    return DraftConfig(kind="eagle3", hidden_size=tcfg.hidden_size, intermediate_size=tcfg.intermediate_size,
                       num_layers=1, num_heads=tcfg.num_heads, num_kv_heads=tcfg.num_kv_heads, head_dim=tcfg.head_dim,
                       rms_norm_eps=tcfg.rms_norm_eps, rope=tcfg.rope, vocab_size=tcfg.vocab_size,
                       draft_vocab_size=draft_vocab, target_hidden_size=tcfg.hidden_size)


# ---------------------------------------------------------------- accounting


def device_bytes(tree: PyTree) -> int:
    """Bytes one device holds of a tree of sharded `jax.ShapeDtypeStruct`s (the largest shard)."""

    def one(x) -> int:
        itemsize = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x.dtype.itemsize
        return math.prod(x.sharding.shard_shape(x.shape)) * itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def abstract(specs_or_shapes: PyTree, shardings: PyTree) -> PyTree:
    """ParamSpecs or ShapeDtypeStructs + NamedShardings -> sharded ShapeDtypeStructs (no memory)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), specs_or_shapes, shardings,
                        is_leaf=is_spec)


# XLA:CPU has no bf16 matmul: it converts bf16 weights to f32 and, by default, hoists those converts out of
# the layer scan and the generation loop, i.e. keeps an f32 copy of every weight. TPUs compute bf16 natively,
# so the plan keeps the converts inside the loops (one layer's f32 copy at a time).
CPU_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def compile_program(name: str, mesh: Mesh, fn: Any, *args: Any) -> Program:
    """Lower and compile fn on the abstract args for the mesh's devices; its memory per device."""
    options = CPU_OPTIONS if mesh.devices.flat[0].platform == "cpu" else None
    lowered = fn.lower(*args)
    try:
        m = lowered.compile(options).memory_analysis()
    except jax.errors.JaxRuntimeError as exc:
        asked = re.search(r"HLO temporaries \(([0-9.]+)G\)", str(exc))
        if not str(exc).startswith("RESOURCE_EXHAUSTED") or asked is None:
            raise
        return Program(name, device_bytes(args), 0, 0, int(float(asked.group(1)) * GiB), str(exc).splitlines()[0])
    return Program(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes)


# ---------------------------------------------------------------- plans


def plan_inference(tcfg: TargetConfig, dcfg: DraftConfig, mesh: Mesh, batch: int, max_len: int, dtype: Any,
                   tree: Any = None, prompt_len: int | None = None) -> Plan:
    """Compile the sharded prefill (prompt [batch, prompt_len], default max_len) and generation loop."""
    programs.check_mesh(mesh, tcfg, dcfg, batch)
    spec = SpecConfig(tree) if tree is not None else SpecConfig()
    prompt_len = prompt_len or max_len
    if not spec.cache_overhead < max_len or not 0 < prompt_len <= max_len:
        raise EagleError(f"--max-len {max_len} must exceed one cycle's {spec.cache_overhead} slots and hold the "
                         f"{prompt_len}-token prompt")
    progs = programs.spec_programs(tcfg, dcfg, spec, max_len, mesh)
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
    title = (f"inference: batch {batch}, max-len {max_len}, {jnp.dtype(dtype).name}, tree {spec.tree}, "
             f"mesh {mesh_text(mesh)}")
    return Plan(title, mesh.size, compiler_name(mesh), resident, compiled)


def plan_training(tcfg: TargetConfig, dcfg: DraftConfig, mesh: Mesh, batch: int, seq_len: int, ttt_steps: int = 7,
                  bf16: bool = True) -> Plan:
    """Compile the trainer's step (train.eagle3.make_train_step) on [batch, seq_len] token batches."""
    from train import eagle3 as trainer

    programs.check_mesh(mesh, tcfg, dcfg, batch)
    rc = trainer.RunConfig(target="", data=(), out="", batch_size=batch, max_length=seq_len, ttt_steps=ttt_steps,
                           bf16=bf16)
    compute = jnp.bfloat16 if bf16 else jnp.float32
    optimizer = trainer.make_optimizer(rc)
    sh = trainer.make_shardings(tcfg, dcfg, optimizer, mesh, compute)
    step = trainer.make_train_step(tcfg, dcfg, optimizer, ttt_steps, sh, compute)
    trainable_specs, map_specs = objective.split_trainable(draft.param_specs(dcfg))
    trainable = abstract(trainable_specs, sh.trainable)
    opt_state = abstract(jax.eval_shape(optimizer.init, trainable), sh.opt_state)
    vocab_map = abstract(map_specs, sh.vocab_map)
    tparams = abstract(with_dtype(target.param_specs(tcfg), compute), sh.target)
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sh.batch)
    resident = (
        ("target parameters (frozen)", device_bytes(tparams)),
        ("draft parameters (f32 master)", device_bytes(trainable) + device_bytes(vocab_map)),
        ("optimizer state", device_bytes(opt_state)),
    )
    program = compile_program(f"train step ([{batch}, {seq_len}] tokens, {ttt_steps} TTT steps)", mesh, step,
                              trainable, opt_state, vocab_map, tparams, tokens, tokens, tokens)
    title = (f"training: batch {batch}, length {seq_len}, {'bf16 compute' if bf16 else 'f32'}, "
             f"mesh {mesh_text(mesh)}")
    return Plan(title, mesh.size, compiler_name(mesh), resident, (program,))


def compiler_name(mesh: Mesh) -> str:
    device = mesh.devices.flat[0]
    return f"XLA:TPU ({device.device_kind})" if device.platform == "tpu" else f"XLA:{device.platform.upper()}"


def mesh_text(mesh: Mesh) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items() if n > 1) or "one device"


# ---------------------------------------------------------------- report


def size(n: int) -> str:
    return f"{n / GiB:8.2f} GiB" if n >= GiB // 10 else f"{n / 2**20:8.2f} MiB"


def fits(plan: Plan, tpus: Sequence[Tpu] = TPUS) -> list[str]:
    lines = []
    for tpu in tpus:
        spare = tpu.hbm_gib * GiB - plan.peak
        verdict = f"fits, {spare / GiB:.1f} GiB spare" if spare >= 0 else f"does not fit, {-spare / GiB:.1f} GiB short"
        note = (f" (the slice has {tpu.chips} devices, this plan {plan.devices}: plan it with --devices {tpu.chips})"
                if tpu.chips != plan.devices else "")
        lines.append(f"  TPU {tpu.name:6s} {tpu.chips} x {tpu.hbm_gib:g} GiB: {verdict}{note}")
    return lines


def report(name: str, plan: Plan, tpus: Sequence[Tpu] = TPUS) -> str:
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


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m infer.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", "--target", dest="config", required=True,
                   help="preset name or .json (configs/), store, or Hugging Face model directory")
    p.add_argument("--mesh", default=None, help="e.g. tensor=8 or data=2,tensor=4 (default: tensor over all devices; "
                                                "training: fsdp over all devices)")
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=1)
    p.add_argument("--max-len", "--max-length", dest="max_len", type=int, default=4096,
                   help="inference: cache slots per row; training: sequence length")
    p.add_argument("--devices", type=int, default=None, help="virtual devices (default: the mesh's size, else 8)")
    p.add_argument("--tpu", choices=[t.name for t in TPUS], default=None,
                   help="compile with the TPU compiler for this slice (needs libtpu; no TPU needed) instead of on CPU")
    p.add_argument("--dtype", choices=tuple(command.DTYPES), default=None, help="weights (default: the preset's, else bf16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prefill prompt length (default: --max-len)")
    p.add_argument("--train", "--plan", dest="train", action="store_true", help="plan a TTT training step instead")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--bf16", action="store_true", help="training: bf16 target and compute (as train.eagle3 --bf16)")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="head vocabulary for a bare model directory")
    p.add_argument("--models", default=None, help="models root of the presets (default $EAGLE_JAX_MODELS, else ./models)")
    a = p.parse_args(argv)
    for name in ("batch", "max_len", "ttt_steps"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    return a


def _devices(a: argparse.Namespace) -> int:
    if a.devices is not None:
        if a.devices < 1:
            raise EagleError(f"--devices must be >= 1, got {a.devices}")
        return a.devices
    return math.prod(sharding.parse_mesh(a.mesh).values()) if a.mesh else 8


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    tpu = next((t for t in TPUS if t.name == a.tpu), None)
    devices = tpu_devices(tpu) if tpu else use_cpu_devices(_devices(a), argv)

    tcfg, dcfg, tree, preset_dtype = model_configs(a.config, a.models, a.draft_vocab_size)
    n = len(devices)
    mesh = sharding.make_mesh(a.mesh or (f"fsdp={n}" if a.train else f"tensor={n}"), devices)
    name = Path(a.config).name.removesuffix(".json")
    if a.train:
        plan = plan_training(tcfg, dcfg, mesh, a.batch, a.max_len, a.ttt_steps, bf16=a.bf16 or a.dtype == "bf16")
    else:
        dtype = command.parse_dtype(a.dtype or preset_dtype or "bf16")
        plan = plan_inference(tcfg, dcfg, mesh, a.batch, a.max_len, dtype, tree, a.prompt_len)
    print(report(name, plan, (tpu,) if tpu else TPUS), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

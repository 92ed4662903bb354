"""Memory plan checked by the compiler: bytes per device of the speculative cycle or a TTT training step.

    python -m infer.plan --config llama3.3-70b-eagle3 --mesh tensor=8 --batch 8 --max-len 4096 [--tpu v6e-8]
    python -m infer.plan --train --config llama3.3-70b-eagle3 --mesh fsdp=8 --batch 8 --max-len 1024 --bf16 [--offline]
    (`python -m train.eagle3 --plan ...` runs the second; --offline: the step from stored features)

The program is lowered with abstract parameters (shapes, dtypes and shardings only: no weights are
allocated) and compiled by XLA's SPMD partitioner for the mesh. Inference compiles the engine's
prefill (by default a prompt filling the whole cache, the worst case) and its generation loop
(`lax.while_loop` over draft -> verify -> accept cycles); training compiles the trainer's jitted step
(frozen target forward + TTT loss + AdamW update, `train.eagle3.make_train_step`).

Devices: by default N virtual CPU devices (`--devices`, default the mesh's size), compiled by XLA:CPU.
With `--tpu v5e-8|v5p-8|v6e-8` the TPU compiler in libtpu compiles for that slice's topology (no TPU
needed, only the libtpu package); it refuses programs whose temporaries exceed a chip's HBM, which the
report shows as such.

The model flags are every command's (`cli.models`): --config, a preset (configs/NAME.json, by name or
path), or --target, an eagle-jax store, a Hugging Face model directory or a GGUF file. A preset's
dimensions come from its checkpoints' config.json under --models when they are there, else from the
public values built in below for its hub names; a model directory (or a store without a head) gets an
EAGLE-3 head shaped like one of its layers.

Parameters, KV caches and loop state are exact (shapes and shardings). Temporaries and the peak
(arguments + outputs - donated + temporaries) are the compiler's `memory_analysis()`. XLA:CPU's are an
estimate of a TPU's (it converts bf16 matmul operands to f32 and fuses differently); XLA:TPU's are
the real thing. The verdict compares the peak with each chip's nominal HBM.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from cli import command, models, presets
from eagle_jax.decoding import programs
from eagle_jax.decoding.tree import DynamicTree
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading, store
from eagle_jax.models.config import (
    DraftConfig,
    TargetConfig,
    draft_config_from_hf,
    eagle3_head_like,
    target_config_from_hf,
)
from eagle_jax.parallel import memory, sharding
from eagle_jax.training import step


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
    env = {
        **os.environ,
        "EAGLE_JAX_PLAN_CHILD": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
    }
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "infer.plan", *argv], env)


def model_configs(
    config: str, models: str | None = None, draft_vocab: int = 32000, quantize: str | None = None
) -> tuple[TargetConfig, DraftConfig, Any, str | None]:
    """(TargetConfig, DraftConfig, tree or None, dtype name or None) from a preset, a store, an HF model
    directory or a GGUF file; a target without its own head gets an EAGLE-3 head shaped like one of its layers.
    `quantize` ("int8") plans the target's weights quantised (`models.quantize`)."""
    tcfg, dcfg, tree, dtype = _model_configs(config, models, draft_vocab)
    if quantize:
        from eagle_jax.models import quantize as quantizing  # qwix loads only for a quantised target

        tcfg = quantizing.quantized_config(tcfg, quantize)
    return tcfg, dcfg, tree, dtype


def _model_configs(
    config: str, models: str | None, draft_vocab: int
) -> tuple[TargetConfig, DraftConfig, Any, str | None]:
    path = Path(config)
    if path.is_dir() or loading.is_gguf(path):
        tcfg = loading.target_config(path)
        m = store.read_manifest(path) if store.is_store(path) else None
        dcfg = (
            draft_config_from_hf(m.draft_config, m.draft_kind)
            if m is not None and m.draft_config is not None
            else eagle3_head_like(tcfg, min(draft_vocab, tcfg.vocab_size))
        )
        return tcfg, dcfg, None, None
    preset = presets.load_preset(config)

    def raw(which: str) -> dict:
        ref = preset.target if which == "target" else preset.draft
        local = Path(models or os.environ.get(presets.MODELS_ENV) or "models") / ref.dir / "config.json"
        if local.is_file():
            return files.read_json(local)
        if ref.hub not in presets.HUB_CONFIGS:
            preset.model_dir(which, models)  # raises: says where to put the checkpoint
        return presets.HUB_CONFIGS[ref.hub]

    tcfg = target_config_from_hf(raw("target"))
    return tcfg, draft_config_from_hf(raw("draft"), preset.draft_kind), preset.tree, preset.dtype


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m infer.plan", description=__doc__.split("\n\n")[0])
    models.add_flags(
        p,
        draft=False,
        dtype_help="the preset's, else bf16",
        mesh_help="(default: tensor over all devices; training: fsdp over all devices)",
    )
    p.add_argument("--batch", "--batch-size", dest="batch", type=int, default=1)
    p.add_argument(
        "--max-len",
        "--max-length",
        dest="max_len",
        type=int,
        default=4096,
        help="inference: cache slots per row; training: sequence length",
    )
    p.add_argument("--devices", type=int, default=None, help="virtual devices (default: the mesh's size, else 8)")
    p.add_argument(
        "--tpu",
        choices=[t.name for t in memory.TPUS],
        default=None,
        help="compile with the TPU compiler for this slice (needs libtpu; no TPU needed) instead of on CPU",
    )
    p.add_argument("--prompt-len", type=int, default=None, help="prefill prompt length (default: --max-len)")
    p.add_argument("--train", "--plan", dest="train", action="store_true", help="plan a TTT training step instead")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument(
        "--offline",
        action="store_true",
        help="training: the step from stored features (train.features): only the target's readout resident",
    )
    p.add_argument("--bf16", action="store_true", help="training: bf16 target and compute (as train.eagle3 --bf16)")
    p.add_argument("--draft-vocab-size", type=int, default=32000, help="head vocabulary for a bare model directory")
    a = p.parse_args(argv)
    if (a.config is None) == (a.target is None):
        raise EagleError(
            "name one model to plan: --config PRESET or --target FOLDER (a store, a Hugging Face folder, a GGUF file)"
        )
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
    tpu = next((t for t in memory.TPUS if t.name == a.tpu), None)
    devices = memory.tpu_devices(tpu) if tpu else use_cpu_devices(_devices(a), argv)

    if a.train and a.quantize:
        raise EagleError("training reads a float target: leave --quantize out of --train", "quantize")
    source = a.target or a.config
    tcfg, dcfg, tree, preset_dtype = model_configs(source, a.models, a.draft_vocab_size, a.quantize)
    n = len(devices)
    mesh = sharding.make_mesh(a.mesh or (f"fsdp={n}" if a.train else f"tensor={n}"), devices)
    name = Path(source).name.removesuffix(".json")
    if a.train:
        bf16 = a.bf16 or a.dtype == "bf16"
        result = step.plan_training(tcfg, dcfg, mesh, a.batch, a.max_len, a.ttt_steps, bf16, a.offline)
    else:
        dtype = command.parse_dtype(a.dtype or preset_dtype or "bf16")
        result = programs.plan_inference(
            tcfg, dcfg, mesh, a.batch, a.max_len, dtype, tree or DynamicTree(), a.prompt_len
        )
    print(memory.report(name, result, (tpu,) if tpu else memory.TPUS), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)

"""The model flags of every command that decodes, declared once, and their one resolution: which preset, target and
head, in which dtype, on which mesh; then the models loaded.

    p = command.ArgumentParser(...)
    models.add_flags(p)
    a = p.parse_args(argv)
    pair = models.choose(a)   # the preset and the folders; loads nothing
    m = models.load(pair)     # the mesh, the target and the head
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
from jax.sharding import Mesh

from cli import command, demo, presets
from eagle_jax.io import loading
from eagle_jax.models.config import DRAFT_KINDS, DraftConfig, TargetConfig
from eagle_jax.parallel import sharding

QUANTIZE_HELP = "quantise the target's weights as it loads: int8 (weight-only, one scale per output channel)"
DEMO_DTYPE = "fp32"  # the demo pair runs in float32 (it is stored in fp16)


def add_flags(
    p: argparse.ArgumentParser,
    *,
    config: bool = True,
    draft: bool = True,
    draft_kind: bool = False,
    dtype: bool = True,
    mesh: bool = True,
    quantize: bool = True,
    dtype_default: str | None = None,
    dtype_help: str = "the preset's, else as stored; the demo pair: fp32",
    mesh_help: str = "(default: the preset's, else one device)",
) -> None:
    """--config/--models (presets), --target, --draft, --draft-kind, --dtype, --mesh, --quantize: those a command
    takes (`dtype_default`: --dtype's default, else `dtype_help` says what it falls back to)."""
    g = p.add_argument_group("models")
    if config:
        g.add_argument("--config", help=f"preset name in configs/ ({', '.join(presets.available())}) or a .json path")
        g.add_argument(
            "--models", help=f"folder holding the preset's checkpoints (default: ${presets.MODELS_ENV} or ./models)"
        )
    g.add_argument("--target", help="store, Hugging Face folder or GGUF file (default: the demo pair)")
    if draft:
        g.add_argument("--draft", help=f"{presets.DRAFT_HELP} (default: the target store's head, or the demo pair's)")
    if draft_kind:
        g.add_argument("--draft-kind", choices=DRAFT_KINDS, help="assert the head kind (default: detected)")
    if dtype:
        shown = dtype_default or dtype_help
        g.add_argument(
            "--dtype", choices=tuple(command.DTYPES), default=dtype_default, help=f"weights dtype (default: {shown})"
        )
    if mesh:
        g.add_argument("--mesh", help=f"device mesh, e.g. tensor=8 or data=2,tensor=4 {mesh_help}")
    if quantize:
        g.add_argument("--quantize", help=QUANTIZE_HELP)


def add_tree_flags(p: argparse.ArgumentParser, static: bool = True) -> None:
    """The draft-tree flags: --total-tokens, --depth, --tree-top-k, --tree (`static`), --context, --auto-budget."""
    g = p.add_argument_group("draft tree (default: the envelope measured fastest on this machine for the batch)")
    g.add_argument("--total-tokens", type=int, help="tree nodes including the root")
    g.add_argument("--depth", type=int, help="expansion steps (depth + 1 draft levels)")
    g.add_argument("--tree-top-k", type=int, help="children per node and frontier width")
    if static:
        g.add_argument("--tree", help="static tree: 'static' / 'mc_sim_7b_63' or a JSON list of rank paths")
    g.add_argument(
        "--context",
        type=int,
        help="K candidates per cycle copied from the context (prompt lookup), grafted onto the tree; alone: "
        "the only drafts (what --draft context uses)",
    )
    g.add_argument(
        "--auto-budget",
        action="store_true",
        help="measure the envelopes again here (ignore the head's budget.json and the cache) and use the fastest, "
        "or plain decoding if none wins",
    )


@dataclasses.dataclass(frozen=True)
class Pair:
    """What the model flags name, resolved: nothing loaded yet."""

    preset: presets.Preset | None
    target: Path
    draft: Path | None  # None: plain decoding, or drafts from the context alone
    dtype: str | None  # bf16 / fp16 / fp32, None: as stored
    mesh: str | None  # the mesh's text, None: one device
    quantize: str | None
    kind: str | None  # the head kind asserted (--draft-kind)
    note: str | None  # which demo pair stands in (said once the command's other checks pass)


def choose(
    a: argparse.Namespace,
    plain: bool = False,
    pair: Callable[[], tuple[Path, Path, str | None]] = demo.default_pair,
    fallback: str = "",
) -> Pair:
    """The preset, target and head the flags name (a store's own head, the preset's, or, with no model named, the
    demo `pair` in float32), the dtype and the mesh (the preset's when --mesh is not given; made by `load`). No
    head with `plain` (plain decoding) or --draft context. `fallback` adds another way out to a missing head's
    error."""
    config, models_root = getattr(a, "config", None), getattr(a, "models", None)
    preset = presets.load_preset(config) if config else None
    draft = getattr(a, "draft", None)
    note = None
    if a.target is None and preset is None:
        target_dir, demo_draft, note = pair()
        draft_dir = None if plain or draft == presets.CONTEXT_DRAFT else Path(draft or demo_draft)
        dtype = getattr(a, "dtype", None) or DEMO_DTYPE
    else:
        if plain:
            target_dir, draft_dir = presets.target_folder(a.target, preset, models_root), None
        else:
            target_dir, draft_dir = presets.model_dirs(a.target, draft, preset, models_root, fallback)
        dtype = getattr(a, "dtype", None) or (preset.dtype if preset else None)
    given = getattr(a, "mesh", None)
    mesh = given if given is not None else (preset.mesh if preset else None)
    kind = getattr(a, "draft_kind", None)
    return Pair(preset, target_dir, draft_dir, dtype, mesh, getattr(a, "quantize", None), kind, note)


@dataclasses.dataclass(frozen=True)
class Models:
    tcfg: TargetConfig
    tparams: dict
    dcfg: DraftConfig | None
    dparams: dict | None
    target_dir: Path
    draft_dir: Path | None
    mesh: Mesh | None  # parameters sharded over it (generation runs the mesh programs), else one device


def load(pair: Pair, check_mesh: Callable[[Mesh | None], None] | None = None) -> Models:
    """Target (quantised by --quantize) and head on the mesh (or the default device); the head in the target's
    floating dtype. `check_mesh` refuses a mesh the command cannot use (an error names --mesh)."""
    with command.flag("--mesh") if pair.mesh else contextlib.nullcontext():  # names --mesh only when one is given
        mesh = sharding.make_mesh(pair.mesh) if pair.mesh else None
        if check_mesh is not None:
            check_mesh(mesh)
        tcfg, tparams = loading.load_target(pair.target, command.parse_dtype(pair.dtype), mesh, quantize=pair.quantize)
        dcfg = dparams = None
        if pair.draft is not None:
            dcfg, dparams = loading.load_draft(pair.draft, tcfg, pair.kind, tparams["embed"].dtype, mesh)
    if mesh is None:
        tparams, dparams = jax.device_put((tparams, dparams))
    return Models(tcfg, tparams, dcfg, dparams, pair.target, pair.draft, mesh)

"""One checkpoint directory for a target, its draft head, both configs and the tokenizer.

Layout of a store directory:

    eagle_jax.json   manifest: format, the raw HF config of the target (+ generation config), the raw
                     config.json of the draft head, the head's kind and the stored dtypes
    target/          orbax checkpoint of the target parameter tree (optional)
    draft/           orbax checkpoint of the draft parameter tree (optional)
    tokenizer/       the target's tokenizer files, loadable with `AutoTokenizer.from_pretrained`

Restores build the abstract parameter tree from the configs' `param_specs`, so a store restores to
host (numpy) or straight onto a device mesh: each leaf gets the `NamedSharding` its logical axes map
to and orbax reads only the slices each device holds. Training runs save their head with
`save_draft` into the same format; `convert.orbax_to_torch` exports either kind of store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.models import draft as draft_model
from eagle_jax.models import target as target_model
from eagle_jax.models.config import (
    DraftConfig,
    TargetConfig,
    check_draft_fits,
    draft_config_from_hf,
    target_config_from_hf,
)
from eagle_jax.models.params import check_against_specs, is_spec, map_specs, with_dtype
from eagle_jax.parallel import sharding

FORMAT = "eagle-jax-store/2"  # /1 stacked the target's layers on one axis
MANIFEST = "eagle_jax.json"
STORE_NAMES = (MANIFEST, "target", "draft", "tokenizer")  # what a store folder holds
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json",
    "generation_config.json",
)  # fmt: skip

PyTree = Any


@dataclasses.dataclass(frozen=True)
class TargetPart:
    """A target to store: its raw HF config.json (+ generation_config.json) and parameters."""

    config: dict
    params: PyTree
    generation_config: dict | None = None
    quantize: str | None = None  # the method `params` were quantised by (`models.quantize`), if any


@dataclasses.dataclass(frozen=True)
class DraftPart:
    """A draft head to store: its raw official config.json, its kind and parameters."""

    config: dict
    kind: str
    params: PyTree


@dataclasses.dataclass(frozen=True)
class Manifest:
    target_config: dict | None
    generation_config: dict | None
    draft_config: dict | None
    draft_kind: str | None
    target_dtype: str | None
    draft_dtype: str | None
    format: str = FORMAT
    target_quantize: str | None = None  # "int8": the target's weights are stored quantised (`models.quantize`)


def is_store(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if not path.is_dir():
        raise EagleError(f"{path}: directory not found")
    raw = files.read_json(path / MANIFEST)
    if raw.get("format") == "eagle-jax-store/1":
        raise EagleError(
            f"{path}: a store of an earlier format (layers stacked on one axis); convert the checkpoint "
            "again with python -m convert.torch_to_orbax"
        )
    if raw.get("format") != FORMAT:
        raise EagleError(f"{path / MANIFEST}: format {raw.get('format')!r} is not {FORMAT!r}")
    try:
        return Manifest(**raw)
    except TypeError as exc:
        raise EagleError(f"{path / MANIFEST}: not a valid manifest ({exc})") from None


def tokenizer_dir(path: str | Path) -> Path | None:
    """The store's tokenizer directory, if it holds one."""
    tok = Path(path) / "tokenizer"
    return tok if tok.is_dir() else None


# ---------------------------------------------------------------- saving


def _float_dtype(params: PyTree) -> str | None:
    dtypes = {str(np.dtype(x.dtype)) for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating)}
    if len(dtypes) > 1:
        raise EagleError(f"parameters mix floating dtypes {sorted(dtypes)}; cast them to one dtype before saving")
    return dtypes.pop() if dtypes else None


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {files.first_line(exc)}"


@contextlib.contextmanager
def _quiet_orbax():
    """Silence orbax's absl warnings (e.g. on unreadable metadata): failures surface as one EagleError."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _checkpointer():
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _nbytes(params: PyTree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def save(
    out: str | Path,
    target: TargetPart | None = None,
    draft: DraftPart | None = None,
    tokenizer_from: str | Path | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Write a store; parameters are checked against their configs first.

    The store is written next to `out` and renamed into place, so `out` is never half-written.
    """
    import orbax.checkpoint as ocp

    out = Path(out).absolute()
    parts: dict[str, PyTree] = {}
    if target is not None:
        tcfg = dataclasses.replace(
            target_config_from_hf(target.config, target.generation_config), quantize=target.quantize
        )
        check_against_specs(target.params, target_model.param_specs(tcfg), "target")
        parts["target"] = target.params
    if draft is not None:
        dcfg = draft_config_from_hf(draft.config, draft.kind)
        check_against_specs(draft.params, draft_model.param_specs(dcfg), "draft")
        if target is not None:
            check_draft_fits(dcfg, tcfg, "draft")
        parts["draft"] = draft.params
    if not parts:
        raise EagleError("nothing to save: give a target, a draft or both")
    manifest = Manifest(
        target_config=target.config if target else None,
        generation_config=target.generation_config if target else None,
        draft_config=draft.config if draft else None,
        draft_kind=draft.kind if draft else None,
        target_dtype=_float_dtype(target.params) if target else None,
        draft_dtype=_float_dtype(draft.params) if draft else None,
        target_quantize=target.quantize if target else None,
    )
    tokenizer_files = [
        Path(tokenizer_from) / f
        for f in TOKENIZER_FILES
        if tokenizer_from is not None and (Path(tokenizer_from) / f).is_file()
    ]
    with (
        files.new_directory(out, overwrite, STORE_NAMES) as tmp,
        _checkpointer() as ckpt,
        tqdm(
            total=sum(_nbytes(p) for p in parts.values()),
            unit="B",
            unit_scale=True,
            desc=f"saving {out.name}",
            disable=not progress,
        ) as bar,
    ):
        for name, params in parts.items():
            bar.set_postfix_str(name)
            ckpt.save(tmp / name, args=ocp.args.StandardSave(params))
            bar.update(_nbytes(params))
        (tmp / MANIFEST).write_text(json.dumps(dataclasses.asdict(manifest), indent=2) + "\n")
        if tokenizer_files:
            (tmp / "tokenizer").mkdir()
            for f in tokenizer_files:
                shutil.copy2(f, tmp / "tokenizer" / f.name)
    return out


def save_draft(
    out: str | Path,
    config: dict,
    params: PyTree,
    kind: str | None = None,
    overwrite: bool = True,
    progress: bool = False,
) -> Path:
    """Save a draft head alone (e.g. from a training run). kind defaults to the one its parameters imply."""
    kind = kind or ("eagle3" if "lm_head" in params else "eagle1")
    return save(out, draft=DraftPart(config, kind, jax.device_get(params)), overwrite=overwrite, progress=progress)


# ---------------------------------------------------------------- restoring


def _restore(path: Path, specs: PyTree, shardings: PyTree | None) -> PyTree:
    """Restore a parameter tree: numpy without shardings, else arrays placed by them (each device reads
    only its own slices)."""
    import orbax.checkpoint as ocp

    if not path.is_dir():
        raise EagleError(f"{path}: checkpoint directory not found")
    path = path.absolute()  # orbax finds no item metadata under a relative path
    shardings = shardings if shardings is not None else map_specs(lambda _: None, specs)
    abstract = jax.tree.map(
        lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), specs, shardings, is_leaf=is_spec
    )

    with _checkpointer() as ckpt, _quiet_orbax():
        try:
            stored = ckpt.metadata(path).item_metadata
        except Exception as exc:  # orbax raises several types for unreadable metadata
            raise EagleError(f"{path}: not a readable orbax checkpoint ({_failure(exc)})") from None
        if stored is None:
            raise EagleError(
                f"{path}: not a readable orbax checkpoint (no array metadata); the store may be incomplete"
            )
        check_against_specs(stored.tree, specs, f"{path}: parameters do not match the config")
        try:
            return ckpt.restore(path, args=ocp.args.StandardRestore(abstract))
        except Exception as exc:  # missing or truncated array files
            raise EagleError(f"{path}: cannot restore ({_failure(exc)}); the store may be incomplete") from None


def _in_dtype(specs: PyTree, requested: Any, stored: str | None) -> PyTree:
    """Specs with floating leaves in `requested`, else in the stored dtype."""
    dtype = requested if requested is not None else (np.dtype(stored) if stored else None)
    return specs if dtype is None else with_dtype(specs, dtype)


def target_config(path: str | Path) -> TargetConfig:
    """The config of a store's target, quantised as it is stored."""
    m = read_manifest(path)
    if m.target_config is None:
        raise EagleError(f"{path}: this store holds no target (it holds only a draft head)")
    return dataclasses.replace(target_config_from_hf(m.target_config, m.generation_config), quantize=m.target_quantize)


def load_target_store(path: str | Path, dtype: Any = None, mesh: Mesh | None = None) -> tuple[TargetConfig, PyTree]:
    """(config, params) of a store's target; dtype None keeps the stored one."""
    path = Path(path)
    cfg = target_config(path)
    specs = _in_dtype(target_model.param_specs(cfg), dtype, read_manifest(path).target_dtype)
    return cfg, _restore(path / "target", specs, sharding.target_shardings(cfg, mesh) if mesh is not None else None)


def draft_config(path: str | Path) -> DraftConfig:
    """The config of a store's draft head."""
    m = read_manifest(path)
    if m.draft_config is None:
        raise EagleError(f"{path}: this store holds no draft head")
    return draft_config_from_hf(m.draft_config, m.draft_kind)


def load_draft_store(
    path: str | Path,
    target: TargetConfig | None = None,
    kind: str | None = None,
    dtype: Any = None,
    mesh: Mesh | None = None,
) -> tuple[DraftConfig, PyTree]:
    """(config, params) of a store's draft head, checked to fit `target` when given.

    `kind` forces the head kind (a mismatch with the stored kind is an error).
    """
    path = Path(path)
    cfg = draft_config(path)
    if kind is not None and kind != cfg.kind:
        raise EagleError(
            f"{path}: this is an {cfg.kind.upper()} head but {kind.upper()} was requested; drop the override"
        )
    if target is not None:
        check_draft_fits(cfg, target, str(path))
    specs = _in_dtype(draft_model.param_specs(cfg), dtype, read_manifest(path).draft_dtype)
    return cfg, _restore(path / "draft", specs, sharding.draft_shardings(cfg, mesh) if mesh is not None else None)

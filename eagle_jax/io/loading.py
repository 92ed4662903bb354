"""One way in for every model path a user gives: an eagle-jax store, a Hugging Face folder, an
official EAGLE head folder or a GGUF file.

    tcfg, tparams = load_target(path, dtype, mesh)        # store | HF folder | .gguf
    dcfg, dparams = load_draft(path, tcfg, kind, dtype, mesh)  # store | official head folder
    tokenizer = load_tokenizer(path)                       # the target's: store tokenizer/ | HF folder | .gguf

Without a mesh parameters come back on the host (numpy); with one, every leaf is placed by its logical
axes (`parallel.sharding`), a store restoring each device's shards directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from eagle_jax.errors import EagleError
from eagle_jax.io import hf, official, store
from eagle_jax.models.config import DraftConfig, TargetConfig, target_config_from_hf
from eagle_jax.parallel import sharding

PyTree = Any
# `tokenizer_class` values for which AutoTokenizer builds the generic fast tokenizer from tokenizer.json: loaded
# as that class directly, without transformers' model registry (and torch, which it imports: seconds of a start)
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def target_config(path: str | Path) -> TargetConfig:
    """The target's config, without reading its weights."""
    if is_gguf(path):
        from eagle_jax.io import gguf

        return target_config_from_hf(*gguf.read_gguf_config(path))
    if store.is_store(path):
        return store.target_config(path)
    return hf.load_target_config(path)


def load_target(
    path: str | Path, dtype: Any = None, mesh: Mesh | None = None, progress: bool = False, quantize: str | None = None
) -> tuple[TargetConfig, PyTree]:
    """(config, parameters) of a target; dtype None keeps the stored one. `quantize` ("int8") quantises its weights
    after loading them (`models.quantize`), or names how a store holds them quantised (which it must)."""
    stored = target_config(path)
    if mesh is not None:
        sharding.check_mesh(mesh, stored)
    if stored.quantize and quantize != stored.quantize:
        raise EagleError(f"{path}: the target is stored quantised ({stored.quantize}): load it so", "quantize")
    if quantize and not stored.quantize:
        from eagle_jax.models import quantize as quantizing  # qwix loads only for a quantised target (0.3 s)

        quantizing.check(stored, quantize)
    if store.is_store(path):
        cfg, params = store.load_target_store(path, dtype, mesh)
    elif is_gguf(path):
        from eagle_jax.io import gguf

        model = gguf.read_gguf(path, progress)
        cfg = target_config_from_hf(model.config, model.generation_config)
        params = hf.target_params_from_tensors(model.tensors, cfg, str(path), dtype)
    else:
        cfg, params = hf.load_target(path, dtype, progress)
    if quantize and not stored.quantize:
        cfg, params = quantizing.quantize_target(cfg, params, quantize)
    return cfg, params if mesh is None else sharding.place(params, sharding.target_shardings(cfg, mesh))


def holds_draft(path: str | Path) -> bool:
    """Does this path (a store) also hold a draft head?"""
    return store.is_store(path) and store.read_manifest(path).draft_config is not None


def load_draft(
    path: str | Path, target: TargetConfig, kind: str | None = None, dtype: Any = None, mesh: Mesh | None = None
) -> tuple[DraftConfig, PyTree]:
    """(config, parameters) of a draft head checked to fit `target`; `kind` asserts eagle1/eagle3."""
    if store.is_store(path):
        if mesh is not None:
            sharding.check_mesh(mesh, target, store.draft_config(path))
        cfg, params = store.load_draft_store(path, target, kind, dtype, mesh)
        check_vocab_map(params, target, path)
        return cfg, params
    cfg, params = official.load_head(path, target, kind, dtype)
    check_vocab_map(params, target, path)
    if mesh is None:
        return cfg, params
    sharding.check_mesh(mesh, target, cfg)
    return cfg, sharding.place(params, sharding.draft_shardings(cfg, mesh))


def check_vocab_map(params: PyTree, target: TargetConfig, where: str | Path) -> None:
    """Refuse a head whose d2t sends a draft token outside the target vocabulary (draft d -> d + d2t[d])."""
    if "d2t" not in params:
        return
    ids = np.arange(params["d2t"].shape[0]) + np.asarray(jax.device_get(params["d2t"]), dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= target.vocab_size))
    if bad.size:
        d, last = int(bad[0]), target.vocab_size - 1
        raise EagleError(
            f"{where}: d2t maps draft token {d} to {int(ids[d])}, outside the target vocabulary 0..{last} "
            f"({bad.size} such tokens); use the head trained for this target"
        )


def load_tokenizer(path: str | Path, chat_template: str | None = None):
    """The target's tokenizer from a store, HF folder or GGUF file; `chat_template` fills in a missing one."""
    if is_gguf(path):
        from eagle_jax.io import gguf

        tok = gguf.tokenizer_from_gguf(path)
    else:
        folder = store.tokenizer_dir(path) if store.is_store(path) else Path(path)
        if folder is None:
            raise EagleError(f"{path}: the store holds no tokenizer")
        try:
            tok = _tokenizer_class(Path(folder)).from_pretrained(str(folder))
        except (OSError, ValueError) as exc:
            raise EagleError(f"{folder}: cannot load a tokenizer ({str(exc).strip().splitlines()[0]})") from None
    if not tok.chat_template and chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _tokenizer_class(folder: Path):
    """The class AutoTokenizer would load `folder` with, imported without the model registry when generic."""
    config = folder / "tokenizer_config.json"
    try:
        name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        name = None
    if name in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


def encode_chat(tok, messages: list[dict[str, str]], use_template: bool = True) -> list[int]:
    """Token ids of a conversation: the chat template with the generation prompt, or the raw texts joined."""
    if use_template:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False).input_ids)
    return list(tok("\n".join(m["content"] for m in messages)).input_ids)

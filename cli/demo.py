"""The demo pair shipped in `demo/`: what the commands use when no model is named."""

from pathlib import Path

from eagle_jax.decoding.tree import DynamicTree

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "demo" / "target"
DRAFT = REPO / "demo" / "eagle3"
TREE = DynamicTree(total_tokens=5, depth=3, top_k=1)  # `infer.benchmark --auto-budget`'s pick on a 2-core CPU
PROMPT = "What are some tips for writing a good resume?"

"""The demo pair shipped in `demo/`: what the commands use when no model is named."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "demo" / "target"
DRAFT = REPO / "demo" / "eagle3"
PROMPT = "What are some tips for writing a good resume?"

"""Commands that convert checkpoints: Hugging Face + official EAGLE heads <-> orbax stores, GGUF -> Hugging Face."""

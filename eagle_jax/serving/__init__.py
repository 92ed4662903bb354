"""Serving many users at once: continuous batching of speculative rows (`batcher`) behind an
OpenAI-compatible HTTP API (`api`)."""

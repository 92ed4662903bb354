"""Generating tokens: sizing (`schedule`), draft trees, sampling, acceptance, output emission, plain and
speculative decoding, and the same programs jitted for a device mesh."""

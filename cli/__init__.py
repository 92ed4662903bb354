"""Plumbing the commands share: one-line errors with exit code 2, flag names on library errors, presets,
the demo pair and the memory-plan command."""

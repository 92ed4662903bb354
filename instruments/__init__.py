"""Instruments: what measures the engine (profiles, cost tables, official timing, TPU estimates, load tests)."""

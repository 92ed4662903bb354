"""Generation under grammars: every prompt a row of one engine, each following its own matcher (None: free text),
cycled until all are done. What `programs.generate` is for free text, with the masks the host computes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.grammar import Matcher
from eagle_jax.decoding.speculative import DecodeConfig, SpecResult, head_for


def generate(
    tparams,
    dparams,
    prompts: list[list[int]],
    max_new_tokens: int,
    cfg: DecodeConfig,
    matchers: Sequence[Matcher | None],
    seed: int = 0,
    capacity: int = 4096,
    on_new: Callable[[list[list[int]]], None] | None = None,
) -> SpecResult:
    """Up to max_new_tokens new tokens per prompt with `cfg` (its tree `tree.PLAIN`: plain decoding), row r under
    matchers[r] (fresh ones); `on_new(new tokens per row)` is called after every cycle."""
    cfg, dparams = head_for(cfg, dparams)
    engine = Engine(tparams, dparams, cfg, len(prompts), capacity)
    for slot, (prompt, matcher) in enumerate(zip(prompts, matchers, strict=True)):
        engine.admit(slot, prompt, max_new_tokens, seed=seed, owner=slot, grammar=matcher)
    tokens, accepted, reasons = [[] for _ in prompts], [[] for _ in prompts], ["length"] * len(prompts)
    while engine.live:
        new = [[] for _ in prompts]
        for step in engine.cycle():
            new[step.slot] = step.tokens
            tokens[step.slot] += step.tokens
            if step.finish is not None:
                reasons[step.slot] = "eos" if step.finish == "stop" else "length"
        if on_new is not None:
            on_new(new)
    for slot in range(len(prompts)):
        accepted[slot] = engine.accept_lengths(slot)
    return SpecResult(tokens, accepted, reasons)

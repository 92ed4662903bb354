"""A conversation kept on device: one row of an `engine.Engine`, its caches kept across turns.

Each turn gets the whole conversation's token ids; the row keeps the longest prefix its caches already hold (the
earlier turns, the answers it generated) and prefills only the rest, in chunks of a few fixed sizes
(`engine.pieces`). So the programs it runs do not depend on the conversation: one `extend` per chunk size and per
attention span of `schedule.all_spans` one cycle (an answer streams cycle by cycle), or, for plain decoding or
without `stream`, one loop of cycles (a host round trip per token costs a small model as much as its step).
`warm_up` compiles exactly that set ahead of time, on worker threads (a turn waits only for the programs it needs);
afterwards no prompt length or number of turns compiles anything.

Output equals decoding the conversation from scratch (`generation.generate` with the same tree and seed): the
caches hold the same tokens at the same positions, and each turn samples with the same keys.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
from jax.sharding import Mesh

from eagle_jax.decoding import engine as engines
from eagle_jax.decoding.engine import CHUNKS
from eagle_jax.decoding.grammar import Matcher
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.errors import EagleError
from eagle_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int
    reused_tokens: int  # prompt tokens already in the caches
    prefill_s: float
    decode_s: float
    tokens: list[int]  # the answer
    accept_lengths: list[int]  # per cycle (all 0 for plain decoding)


class Session:
    """One conversation (one row) on one device or a mesh's tensor axis, decoded as `cfg` says (its tree `PLAIN`:
    plain decoding)."""

    def __init__(
        self,
        tparams: dict,
        dparams: dict | None,
        cfg: DecodeConfig,
        capacity: int = 4096,
        chunks: Sequence[int] = CHUNKS,
        mesh: Mesh | None = None,
        stream: bool = True,
        structured: bool = False,
    ):
        """`structured`: its turns may follow grammars (`reply(grammar=)`), and the warm-up compiles their programs."""
        if mesh is not None and sharding.data_parallelism(mesh) > 1:  # the caches split over `tensor` alone
            raise EagleError("a conversation is one row: use a mesh with data=1 and fsdp=1 (e.g. tensor=N)")
        loop = not (stream and cfg.tree.drafts)  # a speculative answer streams cycle by cycle, else in loops
        self.engine = engines.Engine(
            tparams, dparams, cfg, 1, capacity, chunks, loop=loop, mesh=mesh, structured=structured
        )
        self.capacity = capacity
        self.turns = 0

    @property
    def cfg(self) -> DecodeConfig:
        """The settings its cycles run with (without a head where the tree does not grow from one)."""
        return self.engine.settings[1]

    @property
    def state(self):
        return self.engine.state

    @property
    def compiled(self):
        return self.engine.compiled

    @property
    def cached(self) -> list[int]:
        """Token ids the caches hold (positions 0..), the last answer included."""
        return self.engine.rows[0].cached

    @property
    def spans(self) -> list[int]:
        return self.engine.spans

    def programs(self) -> list[str]:
        return self.engine.programs()

    def warm_up(self, wait: bool = True, first: int | None = None) -> float:
        return self.engine.warm_up(wait, first)

    def reply(
        self, prompt: Sequence[int], max_new_tokens: int, seed: int = 0, grammar: Matcher | None = None
    ) -> Iterator[list[int]]:
        """Answer the conversation `prompt` (all its token ids so far), following `grammar` (a fresh matcher) when
        given: yields new tokens as they are accepted; `last` then holds the turn's figures. The caches keep the
        prompt and the answer."""
        prompt = list(prompt)
        t0 = time.perf_counter()
        keep = self.engine.admit(0, prompt, max_new_tokens, seed=seed, owner=self, grammar=grammar)
        jax.block_until_ready(self.engine.state)
        t1 = time.perf_counter()
        tokens: list[int] = []
        finish = None
        while finish is None:
            (step,) = self.engine.cycle()
            finish = step.finish
            if step.tokens:
                tokens += step.tokens
                yield step.tokens
        self.turns += 1
        accepts = self.engine.accept_lengths(0)
        self.last = TurnStats(len(prompt), keep, t1 - t0, time.perf_counter() - t1, tokens, accepts)

"""The `eagle` extension of stream chunks: where each token of an answer came from, cycle by cycle.

A request that asks for it (`"eagle": {"trace": true}`) gets, in every chunk that carries text or ends a choice,

    "eagle": {"tree": "4/3/1", "cycles": [{"accepted": 2, "source": ["target", "head", "head"]}],
              "spans": [{"text": "Hello", "source": "target", "cycle": 7}, ...]}

`tree` is the envelope of the latest cycle (`tree.envelope_name`); `cycles` are the cycles that ended since the
previous chunk, each with the drafts it accepted and the source of each token it emitted (the first is the
target's own token, `speculative.SOURCES`); `spans` split the chunk's text by token (concatenated, they are its
delta), each with its token's source and the cycle (from 1) that emitted it. OpenAI clients ignore the field.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Trace:
    """One answer's tokens, their sources and cycles, and where each one's text ends in the answer's text."""

    tree: str = ""
    sources: list[str] = dataclasses.field(default_factory=list)  # per token
    cycles: list[int] = dataclasses.field(default_factory=list)  # per token: the cycle (from 1) that emitted it
    ends: list[int] = dataclasses.field(default_factory=list)  # per token: where its text ends
    fresh: list[dict] = dataclasses.field(default_factory=list)  # cycles not yet reported in a chunk
    count: int = 0  # cycles so far
    shown: int = 0  # characters of text already reported in spans

    def cycle(self, sources: list[str], tree: str) -> None:
        """A cycle emitted tokens from `sources` (their ids follow in `tokens`) with the envelope `tree`."""
        self.count, self.tree = self.count + 1, tree
        self.sources += sources
        self.cycles += [self.count] * len(sources)
        self.fresh.append({"accepted": sum(s != "target" for s in sources), "source": sources})

    def tokens(self, ids: list[int], decode: Callable[[list[int]], str]) -> None:
        """The answer's ids so far: where the text of each new one ends (an incomplete character counts as none)."""
        for j in range(len(self.ends), len(ids)):
            end = len(decode(ids[: j + 1]).rstrip("\ufffd"))
            self.ends.append(max(end, self.ends[-1] if self.ends else 0))

    def field(self, delta: str) -> dict:
        """The chunk's `eagle` field for the next `delta` of the answer's text; reports the fresh cycles."""
        start, stop = self.shown, self.shown + len(delta)
        spans = []
        j = min(bisect.bisect_right(self.ends, start), len(self.ends) - 1)  # the token whose text holds `start`
        while start < stop and j >= 0:
            end = stop if j == len(self.ends) - 1 else min(stop, self.ends[j])  # the last token takes any rest
            if end > start:
                text = delta[start - self.shown : end - self.shown]
                spans.append({"text": text, "source": self.sources[j], "cycle": self.cycles[j]})
            start, j = max(start, end), j + 1
        field = {"tree": self.tree, "cycles": self.fresh, "spans": spans}
        self.shown, self.fresh = stop, []
        return field

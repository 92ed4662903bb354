"""Choosing the draft-tree envelope per batch size from costs measured on the machine at hand.

speedup = tau / (1 + c): tau grows slowly with the tree, c grows with every draft level and with the
verification width once the target is compute-bound (large batches, CPUs). So the best envelope depends
on the hardware and the batch size, and at some batch size none beats plain decoding. `measure` times
plain decoding and each candidate envelope on calibration prompts (generation end to end, after one
compiling pass, in interleaved rounds so that a slow spell of the machine does not land on one candidate);
`choose` keeps the fastest, or plain decoding (`PLAIN`) unless an envelope beats it by `MARGIN` (a tie
within the noise of a shared machine goes to plain decoding, which cannot lose to itself). A `Budget`
holds the choices per batch size and serialises to JSON.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import jax

from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.tree import PLAIN, DynamicTree, NoDraft, envelope_from_json, envelope_json, envelope_name

Envelope = DynamicTree | NoDraft

# The head's chains of 2-7 drafts (top-k 1: what an accurate head wants where verifying is not free), deep
# narrow trees and wide ones up to upstream's 60 / 7 / 10; context candidates alone (prompt lookup, no head);
# and both, the context branch grafted onto a chain or a tree.
CANDIDATES: tuple[Envelope, ...] = (
    *(
        DynamicTree(*t)
        for t in (
            (3, 2, 1),
            (4, 3, 1),
            (5, 4, 1),
            (6, 5, 1),
            (8, 7, 1),
            (8, 3, 2),
            (12, 5, 2),
            (16, 6, 2),
            (16, 4, 4),
            (32, 7, 4),
            (60, 7, 10),
        )
    ),
    *(NoDraft(k, m) for k, m in ((3, 2), (5, 2), (7, 1), (7, 2), (7, 3))),
    *(DynamicTree(*t, context=k) for *t, k in ((4, 3, 1, 5), (5, 4, 1, 7), (8, 3, 2, 7), (16, 4, 4, 7))),
)


def candidates_for(head: bool) -> tuple[Envelope, ...]:
    """The default candidates of a target with (or without) a head."""
    return tuple(t for t in CANDIDATES if head or not t.needs_head)


MARGIN = 0.05  # what speculation must gain over plain decoding's measured tokens/s to be chosen


@dataclasses.dataclass(frozen=True)
class Measured:
    tree: Envelope  # PLAIN: plain decoding
    tau: float  # tokens per cycle (1 for plain decoding)
    tokens_per_s: float  # median over the rounds, prefill included


@dataclasses.dataclass(frozen=True)
class Budget:
    """The envelope to use per batch size (`PLAIN`: plain decoding), and what it was chosen from."""

    device: str
    choices: dict[int, Envelope]
    measured: dict[int, list[Measured]] = dataclasses.field(default_factory=dict)

    def for_batch(self, batch: int) -> Envelope:
        """The choice for `batch` rows: that of the largest measured batch size <= batch (else the smallest)."""
        sizes = sorted(self.choices)
        return self.choices[max([s for s in sizes if s <= batch], default=sizes[0])]

    def to_json(self) -> dict:
        tree = envelope_json
        return {
            "device": self.device,
            "choices": {str(b): tree(t) for b, t in self.choices.items()},
            "measured": {
                str(b): [{"tree": tree(m.tree), "tau": m.tau, "tokens_per_s": m.tokens_per_s} for m in ms]
                for b, ms in self.measured.items()
            },
        }

    @staticmethod
    def from_json(doc: dict) -> Budget:
        tree = envelope_from_json
        return Budget(
            device=doc["device"],
            choices={int(b): tree(t) for b, t in doc["choices"].items()},
            measured={
                int(b): [Measured(tree(m["tree"]), m["tau"], m["tokens_per_s"]) for m in ms]
                for b, ms in doc.get("measured", {}).items()
            },
        )


def device_kind() -> str:
    """What a budget was measured on: platform and device kind (and count, except for CPUs, whose virtual
    devices are parts of one host)."""
    d = jax.devices()[0]
    return f"{d.platform} {d.device_kind}" + ("" if d.platform == "cpu" else f" x{jax.device_count()}")


def measure(
    tparams,
    dparams,
    cfg: speculative.DecodeConfig,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    candidates: Sequence[Envelope] | None = None,
    rounds: int = 3,
    log: Callable[[str], None] | None = None,
) -> list[Measured]:
    """Tokens/s of plain decoding and of each candidate (as the tree of `cfg`) on `prompts` (one batch), median of
    `rounds`."""
    prompts = [list(p) for p in prompts]

    def run(tree: Envelope) -> tuple[int, int]:
        """(new tokens, cycles) of one generation."""
        settings, head = speculative.head_for(dataclasses.replace(cfg, tree=tree), dparams)
        res = generation.generate(tparams, head, prompts, new_tokens, settings)
        return sum(res.new_tokens), sum(res.cycles)

    default = candidates_for(cfg.dcfg is not None)
    trees: list[Envelope] = [PLAIN, *(default if candidates is None else candidates)]
    counts = {t: run(t) for t in trees}  # compiles every program
    rates: dict[Envelope, list[float]] = {t: [] for t in trees}
    for _ in range(rounds):
        for tree in trees:
            start = time.perf_counter()
            jax.block_until_ready(run(tree))
            rates[tree].append(counts[tree][0] / (time.perf_counter() - start))
    measured = [Measured(t, counts[t][0] / max(1, counts[t][1]), statistics.median(rates[t])) for t in trees]
    if log:
        for m in measured:
            log(f"{envelope_name(m.tree)}: tau {m.tau:.2f}, {m.tokens_per_s:.1f} tokens/s")
    return measured


def choose(measured: Sequence[Measured], margin: float = MARGIN) -> Envelope:
    """The fastest envelope when it beats plain decoding (`PLAIN`) by `margin`, else `PLAIN`."""
    plain_rate = next(m.tokens_per_s for m in measured if not m.tree.drafts)
    fastest = max((m for m in measured if m.tree.drafts), key=lambda m: m.tokens_per_s, default=None)
    return fastest.tree if fastest and fastest.tokens_per_s >= (1 + margin) * plain_rate else PLAIN


def calibrate(
    tparams,
    dparams,
    cfg: speculative.DecodeConfig,
    prompts: Sequence[Sequence[int]],
    batch_sizes: Sequence[int],
    new_tokens: int,
    candidates: Sequence[Envelope] | None = None,
    rounds: int = 3,
    log: Callable[[str], None] | None = None,
) -> Budget:
    """A `Budget` for each batch size, measured on batches made of `prompts` (repeated as needed), with `cfg`'s
    target, head and sampling."""
    measured = {}
    for b in batch_sizes:
        if log:
            log(f"batch {b}:")
        rows = [prompts[i % len(prompts)] for i in range(b)]
        measured[b] = measure(tparams, dparams, cfg, rows, new_tokens, candidates, rounds, log=log)
        jax.clear_caches()  # a dozen programs per batch size: free them before the next
    return Budget(device_kind(), {b: choose(ms) for b, ms in measured.items()}, measured)

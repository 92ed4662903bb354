"""Structured output: a row's constraint (JSON schema, regex, choices, Lark grammar), its masks, and their use.

The grammar engine is llguidance (chosen by `instruments.grammar_bench`): a `Matcher` follows a row's committed
tokens on the host and gives the set of tokens allowed next as a packed bitmask ([W] int32, W = ceil(V / 32), bit
t % 32 of word t // 32). A draft tree is verified under the mask of the grammar state after each node's path
(`tree_masks`: a depth-first walk with rollback), so the target's law restricted to the allowed tokens and
renormalised (`restrict`, before temperature, top-k and top-p) is kept exactly, greedy and sampled. Where the
grammar allows one continuation only, `Matcher.forced` gives it: a chain the grammar drafts for free.

Masks are data (arrays given to the programs), never static arguments: a new schema compiles no new program.
Compiled grammars (a matcher at the start, copied for each row) are cached by the hash of their kind and canonical
text (`Grammars`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
COMPILE_SECONDS = 5.0  # a grammar whose compilation (and first mask) takes longer is refused
LIMITS = {"max_grammar_size": 500_000, "initial_lexer_fuel": 1_000_000, "max_lexer_states": 250_000}


class GrammarError(EagleError):
    """A constraint that cannot be used: its message names what is wrong and how to fix it."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a row's answer must match: `kind` (one of KINDS) and its canonical text (the schema as sorted compact
    JSON, properties in their order, the regex, the choices as a JSON list, the Lark grammar)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))  # key order kept: it is the answer's

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise GrammarError(f"invalid regex {pattern!r}: {exc}") from None
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls("grammar", lark)

    @property
    def key(self) -> str:
        """The cache key: a hash of kind and text."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()

    def definition(self) -> str:
        """llguidance's grammar definition (compact JSON, no free whitespace between JSON tokens)."""
        import llguidance

        m = llguidance.LLMatcher
        if self.kind in ("json_schema", "json_object"):
            return m.grammar_from_json_schema(self.text, defaults={"whitespace_flexible": False})
        if self.kind == "regex":
            return m.grammar_from_regex(self.text)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.text)
        return m.grammar_from_lark(self.text)


class Grammars:
    """The compiled grammars of one tokenizer and vocabulary, cached by constraint hash (`cache` most recent)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int], cache: int = 256):
        import llguidance.hf

        self.vocab_size, self.words = vocab_size, (vocab_size + 31) // 32
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))
        self.encode = functools.partial(tokenizer.encode, add_special_tokens=False)
        self.eos_ids = tuple(eos_ids)
        self._compiled = functools.lru_cache(maxsize=cache)(self._compile)

    def _compile(self, constraint: Constraint) -> Matcher:
        import llguidance

        try:
            definition = constraint.definition()
        except (ValueError, RuntimeError) as exc:
            raise GrammarError(f"invalid {constraint.kind}: {_line(exc)}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, self.tokenizer)
        if failed or messages:  # warnings too: an unknown format or keyword would silently not be enforced
            raise GrammarError(f"{constraint.kind} refused: {_line(messages[0] if messages else 'rejected')}; fix it")
        m = llguidance.LLMatcher(self.tokenizer, definition, limits=llguidance.LLParserLimits(**LIMITS))
        if m.is_error():
            raise GrammarError(f"{constraint.kind} refused: {_line(m.get_error())}; fix it")
        start = Matcher(m, self.words, self.eos_ids, self.encode)
        start.mask()  # the lazy part of the compilation (and a check that it can start)
        return start

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher at the start of `constraint` (compiled once per distinct constraint, then copied)."""
        start = self._compiled(constraint)
        return Matcher(start.m.deep_copy(), start.words, start.eos_ids, self.encode)

    def check(self, constraint: Constraint) -> None:
        """Compile (or find cached) `constraint`; raises GrammarError naming the problem."""
        self._compiled(constraint)


def _line(exc: object) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else "rejected"


class Matcher:
    """A row's grammar state on the host, after the tokens it was given (`advance`)."""

    def __init__(self, m, words: int, eos_ids: Sequence[int], encode: Callable[[str], list[int]]):
        self.m, self.words, self.eos_ids, self.encode = m, words, frozenset(eos_ids), encode

    @property
    def stopped(self) -> bool:
        return self.m.is_stopped()

    def mask(self) -> np.ndarray:
        """[W] int32 the tokens allowed next: an eos once the grammar is complete and nothing may follow (every
        token after an eos, whose next choice is never used)."""
        if self.m.is_stopped():
            bits = np.zeros(self.words, np.int32)
            for t in self.eos_ids:
                bits[t >> 5] |= np.int32(1 << (t & 31)) if t & 31 != 31 else np.int32(-(1 << 31))
        else:
            bits = np.frombuffer(self.m.compute_bitmask(), np.int32)[: self.words].copy()
        return bits if bits.any() else np.full(self.words, -1, np.int32)

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed tokens (up to an eos: nothing follows it)."""
        for t in tokens:
            if self.m.is_stopped():
                return
            if not self.m.consume_token(int(t)):
                raise GrammarError(f"token {t} breaks the grammar: {self.m.get_error()}")

    def forced(self, k: int) -> list[int]:
        """Up to k tokens of the text the grammar forces next (a chain to draft for free): its forced bytes as the
        tokenizer spells them, as far as the grammar allows those tokens, or the tokens the grammar forces when
        they go further. (Those stop where the text could be split into tokens more than one way: before the `":"`
        after a schema's key, say. A tokenizer that prefixes a space spells nothing the grammar allows.)"""
        if self.m.is_stopped():
            return []
        spelt = self.encode(self.m.compute_ff_bytes().decode("utf-8", "ignore"))[:k]
        spelt = spelt[: self.m.validate_tokens(spelt)] if spelt else []
        tokens = self.m.compute_ff_tokens()[:k]
        return [int(t) for t in max(spelt, tokens, key=len)]

    def path_chain(self, tokens: np.ndarray, parents: np.ndarray, heads: int, k: int) -> list[int]:
        """tokens, parents [N] of a tree -> up to k tokens to graft from its root: its first path (each node's first
        child among the head's `heads` nodes, its likeliest) as far as the grammar allows it, then the text the
        grammar forces after it (`forced`); empty when nothing is forced there."""
        path, node = [], 0
        while (child := next((j for j in range(node + 1, heads) if parents[j] == node), None)) is not None:
            if int(tokens[child]) in self.eos_ids:
                break
            path.append(int(tokens[child]))
            node = child
        taken = self.m.try_consume_tokens(path[: k - 1]) if path and not self.m.is_stopped() else 0
        forced = self.forced(k - taken)
        self.m.rollback(taken)
        return path[:taken] + forced if forced else []

    def tree_masks(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        """tokens, parents [N] of a tree whose root (node 0) is the state's last token -> [N, W]: the mask after
        each node's path. Nodes the grammar rejects (never accepted: the choice at their parent is masked), eos
        nodes and anything below them take every token."""
        n = tokens.shape[0]
        out = np.full((n, self.words), -1, np.int32)
        children: list[list[int]] = [[] for _ in range(n)]
        for j in range(1, n):
            children[int(parents[j])].append(j)
        out[0] = self.mask()

        def walk(node: int) -> None:
            allowed = out[node]
            for child in children[node]:
                t = int(tokens[child])
                if t < 0 or t in self.eos_ids or not (allowed[t >> 5] >> (t & 31)) & 1:
                    continue
                if self.m.consume_token(t):
                    out[child] = self.mask()
                    walk(child)
                    self.m.rollback(1)

        walk(0)
        return out


def candidates(chains: Sequence[Sequence[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """A chain of up to k tokens per row -> tokens [R, k] int32, valid [R, k] bool, in the shape of the context
    candidates they replace (a row with an empty chain keeps its own)."""
    tokens, valid = np.full((len(chains), k), -1, np.int32), np.zeros((len(chains), k), bool)
    for i, chain in enumerate(chains):
        tokens[i, : len(chain)], valid[i, : len(chain)] = chain, True
    return tokens, valid


def forced_chains(matchers: Sequence[Matcher | None], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Up to k forced tokens per row (None: a row without grammar), as `candidates`."""
    return candidates([m.forced(k) if m is not None else [] for m in matchers], k)


def restrict(logits: jax.Array, bits: jax.Array | None) -> jax.Array:
    """logits [..., V] with the tokens outside bits [..., W] (packed, `Matcher.mask`) set to -inf."""
    if bits is None:
        return logits
    return jnp.where(allowed(bits, logits.shape[-1]), logits, -jnp.inf)


def allowed(bits: jax.Array, vocab: int) -> jax.Array:
    """bits [..., W] int32 -> [..., V] bool."""
    unpacked = (bits[..., :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [..., W, 32]
    return unpacked.reshape(*bits.shape[:-1], -1)[..., :vocab].astype(bool)


def draft_top_k(dparams: dict, dcfg, out: jax.Array, head: jax.Array | None, k: int, bits: jax.Array | None):
    """`draft.top_k` of outputs out [B, H] among the tokens bits [B, W] allow, mapped into the head's draft
    vocabulary (d -> d + d2t[d]); a row whose draft vocabulary holds no allowed token keeps every token."""
    from eagle_jax.models import draft

    if bits is None:
        return draft.top_k(dparams, dcfg, out, head, k)
    lg = draft.logits(dparams, dcfg, out, head)  # [B, Vd]
    ok = allowed(bits, jnp.iinfo(jnp.int32).max)  # [B, W * 32]
    ok = ok[:, jnp.minimum(draft.to_target_ids(dparams, dcfg, jnp.arange(lg.shape[-1])), ok.shape[-1] - 1)]
    lg = jnp.where(ok | ~jnp.any(ok, axis=-1, keepdims=True), lg, -jnp.inf)
    values, ids = jax.lax.top_k(jax.nn.log_softmax(lg, axis=-1), k)
    return draft.to_target_ids(dparams, dcfg, ids), values


def everything(shape: Sequence[int], vocab: int) -> np.ndarray:
    """[*shape, W] masks that allow every token (rows with no constraint)."""
    return np.full((*shape, (vocab + 31) // 32), -1, np.int32)

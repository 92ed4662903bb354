"""Timing plain and speculative generation of the same prompts with one target and head (what the benchmark
and the cost table measure): float32 compute, the same cache layout both ways, every program warmed first."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np

from eagle_jax.decoding import generation, schedule, speculative
from eagle_jax.decoding.grammar import Constraint, GrammarError, Grammars
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, TreeConfig
from eagle_jax.errors import EagleError
from eagle_jax.io import loading
from eagle_jax.training import data


class Runner:
    """One target + draft head (or none: drafts from the context) + tokenizer; times plain and speculative
    generation of a batch of prompts."""

    def __init__(
        self,
        target_dir,
        draft_dir,
        temperature: float,
        max_new_tokens: int,
        max_prompt_tokens: int,
        chat_template: str | None = None,
        seed: int = 0,
        quantize: str | None = None,
    ):
        # float32 compute: half-precision checkpoints (the shipped demo pair) are upcast
        self.paths = (Path(target_dir), None if draft_dir is None else Path(draft_dir))
        self.tcfg, self.tparams = loading.load_target(target_dir, dtype=np.float32, quantize=quantize)
        self.dcfg = self.dparams = None
        if draft_dir is not None:
            self.dcfg, self.dparams = loading.load_draft(draft_dir, self.tcfg, dtype=np.float32)
        self.tparams, self.dparams = jax.device_put((self.tparams, self.dparams))
        self.chat_template = chat_template
        self.sampling = SamplingConfig(temperature=temperature)
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.seed = seed
        self.tree: TreeConfig = PLAIN
        self._warm: set = set()

    @functools.cached_property
    def tokenizer(self):
        """The target's tokenizer with a chat template (loaded when first needed: token-id prompts need none)."""
        return data.chat_tokenizer(self.paths[0], self.chat_template)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The target's tokenizer prepared for grammars (made when a question first has a constraint)."""
        return Grammars(self.tokenizer, self.tcfg.vocab_size, self.tcfg.eos_token_ids)

    @property
    def models(self) -> tuple:
        return self.tcfg, self.tparams, self.dcfg, self.dparams

    def set_tree(self, tree: TreeConfig) -> None:
        """The envelope of the speculative side (`PLAIN`: plain decoding there too)."""
        self.tree = tree
        self._warm = set()

    def prompt(self, history: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids[-self.max_prompt_tokens :]  # keep the end (the question and the generation prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prepare(self, prompts: list[list[int]], max_new_tokens: int) -> schedule.Prompts:
        """Both decoders' layout: the capacity holds prompt bucket + budget + one cycle's tree."""
        return speculative.prepare(prompts, max_new_tokens, speculative.DecodeConfig(self.tcfg, tree=self.tree))

    def _settings(self, tree: TreeConfig) -> tuple[speculative.DecodeConfig, dict | None]:
        """The settings and head a run with `tree` takes (`speculative.head_for`)."""
        return speculative.head_for(speculative.DecodeConfig(self.tcfg, self.dcfg, tree, self.sampling), self.dparams)

    def plain(
        self, prompts: list[list[int]], max_new_tokens: int | None = None, constraints: list | None = None
    ) -> dict:
        return self._run(PLAIN, prompts, max_new_tokens, constraints)

    def speculative(
        self, prompts: list[list[int]], max_new_tokens: int | None = None, constraints: list | None = None
    ) -> dict:
        return self._run(self.tree, prompts, max_new_tokens, constraints)

    def _matchers(self, constraints: list[Constraint | None] | None) -> list | None:
        """A fresh matcher per constrained row (None: free text), or None when no row has a constraint."""
        if not constraints or not any(constraints):
            return None
        return [None if c is None else self.grammars.matcher(c) for c in constraints]

    def _run(
        self,
        tree: TreeConfig,
        prompts: list[list[int]],
        max_new_tokens: int | None,
        constraints: list[Constraint | None] | None = None,
    ) -> dict:
        """Prefill, then the cycles with `tree`, each timed (in the speculative side's cache layout): an engine's
        on-device loops (`generation.generate`), or its cycles one by one when a row follows a grammar (the host
        masks each cycle)."""
        max_new_tokens = max_new_tokens or self.max_new_tokens
        p = self.prepare(prompts, max_new_tokens)
        cfg, head = self._settings(tree)
        matchers = self._matchers(constraints)
        res = generation.generate(
            self.tparams, head, prompts, max_new_tokens, cfg, self.seed, p.capacity, matchers=matchers
        )
        return {
            "tokens": res.tokens,
            "accept_lengths": res.accept_lengths,
            "prefill_s": res.prefill_s,
            "decode_s": res.decode_s,
            "seconds": res.prefill_s + res.decode_s,
            "cycles": max(res.cycles),  # of the batch: every row is computed until the last is done
        }

    def warm(self, prompts: list[list[int]], constraints: list[Constraint | None] | None = None) -> None:
        """Compile both decoders' programs for the batch's cache layout (every chunk size and attention span: the
        engine's warm-up) and run a short generation through them (under the rows' grammars: the masked cycle's
        programs), so that the timed runs compile nothing."""
        constrained = any(constraints or ())
        shape = (len(prompts), self.prepare(prompts, self.max_new_tokens).capacity, constrained)
        if shape in self._warm:
            return
        self._warm = set()
        for tree in dict.fromkeys((PLAIN, self.tree)):
            cfg, head = self._settings(tree)
            generation.engine_for(self.tparams, head, prompts, self.max_new_tokens, cfg, shape[1]).warm_up()
            generation.generate(
                self.tparams, head, prompts, 2, cfg, self.seed, shape[1], matchers=self._matchers(constraints)
            )
        self._warm.add(shape)


CONSTRAINTS = {"schema": Constraint.json_schema, "regex": Constraint.regex, "choice": Constraint.choice}


def _constraint(q: dict, where: str) -> Constraint | None:
    """A question's constraint: its `schema` (a JSON schema), `regex` or `choice` (a list of strings), or None."""
    given = [k for k in CONSTRAINTS if k in q]
    if len(given) > 1:
        raise EagleError(f"{where}: one constraint per question, not {' and '.join(given)}")
    try:
        return CONSTRAINTS[given[0]](q[given[0]]) if given else None
    except (GrammarError, TypeError) as exc:
        raise EagleError(f"{where}: bad {given[0]}: {exc}") from None


def read_questions(path: Path, limit: int | None) -> list[dict]:
    """The first `limit` (all when None) questions of a JSONL file: {question_id, category, turns, constraint};
    a question's every turn follows its `schema`, `regex` or `choice` when it has one (`constraint`: else None)."""
    if not path.is_file():
        raise EagleError(f"{path}: question file not found")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EagleError(f"{path}:{n}: not JSON ({exc.msg})") from None
        turns = q.get("turns") if isinstance(q, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise EagleError(f"{path}:{n}: expected an object with 'turns' (a non-empty list of strings)")
        out.append(
            {
                "question_id": q.get("question_id", n),
                "category": str(q.get("category") or path.stem),
                "turns": turns,
                "constraint": _constraint(q, f"{path}:{n}"),
            }
        )
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise EagleError(f"{path}: no questions")
    return out

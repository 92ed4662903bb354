"""The demo: where speculation wins and where it cannot, on the demo pair, speculative against plain decoding.

    python -m infer.demo [--max-new-tokens 96]         # what `make demo` runs after `python -m cli.smollm2`

A few short named cases, each answered twice, greedy, after every program has compiled: with the envelope the
head's measured budget picks for one row (context drafts, `ctx7`, for SmolLM2 on a CPU), then with the target
alone, both in on-device loops as the benchmark times them, twice in alternating order. Each prints the answer,
each mode's decoding speed (its faster run) and whether the token ids are identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence

from cli import command, demo, envelope, generation, models
from eagle_jax.decoding import session
from eagle_jax.decoding.grammar import Constraint, Grammars, Matcher
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, NoDraft
from eagle_jax.errors import EagleError
from eagle_jax.io import loading

ROUNDS = 2  # timed runs per mode and case
CAPACITY = 512  # one cache for every case: the programs compile once, before the clock starts
CHUNKS = (128, 32)  # the cases' prompts are short: two prefill sizes to compile, each prompt fed in one or two calls
FALLBACK = NoDraft(7, 2)  # context drafts, when no measured budget speculates here
TYPOS = (
    "Maria Lopez joinned Northwind Labs in March 2019 as a data analist. In 2021 she moved to Berlin to lead the "
    "analitics team, and in June 2023 she was named head of reserch. She holds a degree in statistics from the "
    "Univercity of Porto."
)
QUESTION = "What are some tips for writing a good resume?"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "job": {"type": "string"},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "job", "city", "languages"],
    "additionalProperties": False,
}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # what it shows
    turns: tuple[str, ...]  # user turns; every turn is answered, the last one is shown and timed
    schema: dict | None = None  # a JSON schema every answer follows (structured output)


CASES = (
    Case("a fresh question (nothing in the context to copy)", (QUESTION,)),
    Case(
        "a second turn that rewrites the first answer (it copies from it)",
        (QUESTION, "Write your answer again, word for word."),
    ),
    Case("a text to correct (the answer copies it)", (f"Fix the spelling in this text: {TYPOS}",)),
    Case(
        "structured output: JSON under a schema (the grammar drafts its keys and punctuation)",
        ("Extract the person as JSON: Maria Lopez, 34, is a nurse from Valencia who speaks Spanish and English.",),
        PERSON,
    ),
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m infer.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per answer (default 96)")
    a = p.parse_args(argv)
    if a.max_new_tokens < 1:
        raise EagleError(f"--max-new-tokens {a.max_new_tokens} must be >= 1")
    return a


def pick_tree(m: models.Models):
    """The budget's envelope for one row on this kind of device, or context drafts (and why) when it has none."""
    models, paths = (m.tcfg, m.tparams, m.dcfg, m.dparams), (m.target_dir, m.draft_dir)
    try:
        tree = envelope.default_tree(models, paths, 1, lambda: [], measure=False)
    except EagleError:
        return FALLBACK, "no budget measured on this kind of device"
    return (tree, None) if tree.drafts else (FALLBACK, "the measured budget prefers plain decoding here")


def answer(talk: session.Session, prompt: list[int], max_new: int, grammar: Matcher | None) -> tuple[list[int], float]:
    """One turn (following `grammar` when given): its tokens and its decoding tokens/s (the prompt's prefill, the
    same for both modes, left out)."""
    for _ in talk.reply(prompt, max_new, grammar=grammar):
        pass
    return talk.last.tokens, len(talk.last.tokens) / talk.last.decode_s


def timed(
    spec: session.Session,
    plain: session.Session,
    prompt: list[int],
    max_new: int,
    grammar: Callable[[], Matcher | None],
) -> tuple:
    """Both answers and each mode's faster run of ROUNDS, in alternating order (a neighbour's load spike lands on
    one run, not on one mode), each under a fresh `grammar()`: (speculative tokens, its tokens/s, plain tokens,
    its tokens/s)."""
    runs = {id(spec): [], id(plain): []}
    for i in range(ROUNDS):
        for talk in (spec, plain) if i % 2 == 0 else (plain, spec):
            runs[id(talk)].append(answer(talk, prompt, max_new, grammar()))
    (tokens, _), (base, _) = runs[id(spec)][0], runs[id(plain)][0]
    return tokens, max(r for _, r in runs[id(spec)]), base, max(r for _, r in runs[id(plain)])


def parses(text: str, max_new: int) -> str:
    """Whether a structured answer parses as JSON (it follows its schema by construction when it ended)."""
    try:
        json.loads(text)
    except ValueError:
        return f"unfinished within {max_new} tokens (a longer --max-new-tokens finishes it)"
    return "valid JSON under its schema"


def run_case(case: Case, spec: session.Session, plain: session.Session, tok, max_new: int, grammars: Grammars) -> bool:
    """Answer the case's turns with both sessions; show the last answer, both speeds, and whether they are identical."""
    history: list[dict[str, str]] = []

    def grammar() -> Matcher | None:  # a fresh matcher for each answer
        return None if case.schema is None else grammars.matcher(Constraint.json_schema(case.schema))

    for text in case.turns:
        history.append({"role": "user", "content": text})
        prompt = loading.encode_chat(tok, history, True)
        tokens, spec_rate, base, plain_rate = timed(spec, plain, prompt, max_new, grammar)
        history.append({"role": "assistant", "content": tok.decode(tokens, skip_special_tokens=True)})
    print(f"> {case.turns[-1]}\n{history[-1]['content']}", flush=True)
    if case.schema is not None:
        print(f"[{parses(history[-1]['content'], max_new)}]", flush=True)
    same = "outputs identical" if tokens == base else "OUTPUTS DIFFER"
    cycles = len(spec.last.accept_lengths)
    print(
        f"\n[decoding: speculative {spec_rate:.1f} tokens/s (tau {len(tokens) / max(cycles, 1):.2f}), "
        f"plain {plain_rate:.1f} tokens/s: {spec_rate / plain_rate:.2f}x; {same}]\n",
        flush=True,
    )
    return tokens == base


def _main(argv: Sequence[str] | None) -> int:
    a = parse_args(argv)
    target, draft, note = demo.default_pair()
    if note:
        print(note, file=sys.stderr, flush=True)
    m = models.load(models.Pair(None, target, draft, "fp32", None, None, None, note))
    tree, why = pick_tree(m)
    said = f" ({why}: the demo shows them anyway)" if why else " (the head's measured budget for one row here)"
    print(f"demo: {generation.pair_name(m, tree)}{said}; greedy, against plain decoding", flush=True)
    spec, plain = (
        session.Session(
            m.tparams, m.dparams, DecodeConfig(m.tcfg, m.dcfg, t), CAPACITY, CHUNKS, stream=False, structured=True
        )
        for t in (tree, PLAIN)
    )
    names = len(spec.programs()) + len(plain.programs())
    print(f"compiling {names} programs (a later run loads them from the cache) ...", end=" ", flush=True)
    t0 = time.perf_counter()
    tok = generation.load_tokenizer(target, None)
    spec.warm_up(wait=False)
    plain.warm_up()
    spec.compiled.wait()
    grammars = Grammars(tok, m.tcfg.vocab_size, m.tcfg.eos_token_ids)
    print(f"{time.perf_counter() - t0:.1f} s\n", flush=True)
    identical = True
    for i, case in enumerate(CASES, 1):
        print(f"{i}/{len(CASES)}: {case.name}", flush=True)
        identical &= run_case(case, spec, plain, tok, a.max_new_tokens, grammars)
    print(
        "Next: chat with the pair: python -m infer.generate --target "
        f"{target} --draft {draft}\n"
        "      serve it (OpenAI API):  python -m infer.serve --port 8000   (no model named: the demo pair)\n"
        "      then the chat page at http://127.0.0.1:8000/ and the API at http://127.0.0.1:8000/v1/chat/completions",
        flush=True,
    )
    return 0 if identical else 1  # speculation must not change a greedy answer


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

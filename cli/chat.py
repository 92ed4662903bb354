"""The interactive chat of `infer.generate`: one `session.Session` keeps the conversation's caches on device, and
text streams as cycles are accepted."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from cli import command
from cli.generation import CHAT_MAX_LEN, Settings, pair_name, uses_chat_template
from cli.models import Models
from eagle_jax.decoding import session
from eagle_jax.decoding.engine import EngineError
from eagle_jax.io import loading


class TextStream:
    """Prints the decoded text of a growing token list, holding back incomplete characters."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, new: list[list[int]]) -> None:
        self.ids += new[0]
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[self.shown :])
            sys.stdout.flush()
            self.shown = len(text)


def print_ids(new: list[list[int]]) -> None:
    if new[0]:
        sys.stdout.write(" ".join(map(str, new[0])) + " ")
        sys.stdout.flush()


def chat(m: Models, tokenizer: Callable[[], Any], s: Settings, raw: bool, system: str | None) -> None:
    """Multi-turn chat on stdin/stdout. One `session.Session` keeps the conversation's caches: a turn prefills only
    its new tokens. Every program starts compiling at once, in the background: the first turn waits only for its own,
    and no later turn compiles anything."""
    capacity = s.max_len or min(CHAT_MAX_LEN, m.tcfg.rope.max_position_embeddings)
    talk = session.Session(
        m.tparams,
        m.dparams,
        s.decode,
        capacity=capacity,
        mesh=m.mesh,
    )
    if hasattr(sys.stdin, "reconfigure"):
        sys.stdin.reconfigure(errors="replace")  # bytes that are not UTF-8 read as U+FFFD, not a crash
    print(f"chatting with {pair_name(m, s.decode.tree)}; /exit or end of input quits", file=sys.stderr)
    names = talk.programs()
    talk.warm_up(wait=False, first=2)  # a short first turn's programs while the tokenizer loads, then the rest
    print(f"warm-up: compiling {len(names)} programs ({', '.join(names)})", file=sys.stderr, flush=True)
    tok = tokenizer()
    talk.warm_up(wait=False)  # a turn waits only for the programs it runs
    try:
        converse(talk, tok, s, uses_chat_template(tok, raw), system)
    finally:
        talk.compiled.cancel()  # quitting waits only for a compilation under way


def converse(talk: session.Session, tok, s: Settings, use_template: bool, system: str | None) -> None:
    """Turns read from stdin until /exit or the end of input; the oldest turns are dropped when the conversation
    outgrows the session's cache."""
    capacity = talk.capacity
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    first = 1 if system else 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if text == "/exit":
            break
        if not text:
            continue
        history.append({"role": "user", "content": text})
        ids = loading.encode_chat(tok, history, use_template)
        while len(ids) + s.decode.tree.cache_overhead >= capacity and len(history) - first > 1:
            del history[first : first + 2]
            ids = loading.encode_chat(tok, history, use_template)
        if len(ids) + s.decode.tree.cache_overhead >= capacity:
            command.warn(f"this message alone ({len(ids)} tokens) does not fit the cache ({capacity}); raise --max-len")
            history.pop()
            continue
        show = TextStream(tok)
        try:
            for new in talk.reply(ids, s.max_new_tokens, s.seed + talk.turns):
                show([new])
        except EngineError as exc:  # the turn is lost; the conversation goes on from fresh caches
            if exc.dead:
                raise
            print(flush=True)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            history.pop()
            continue
        print(flush=True)
        print(turn_line(talk.last, s.decode.tree.drafts), file=sys.stderr, flush=True)
        history.append({"role": "assistant", "content": tok.decode(talk.last.tokens, skip_special_tokens=True)})


def turn_line(t: session.TurnStats, spec: bool) -> str:
    """A chat turn's figures: prefill (and how much of the prompt the caches already held), decoding (with cycles
    and tau when the tree drafts)."""
    new = len(t.tokens)
    cycles = f", {len(t.accept_lengths)} cycles, tau {new / max(1, len(t.accept_lengths)):.2f}" if spec else ""
    return (
        f"[prefill {t.prompt_tokens - t.reused_tokens} of {t.prompt_tokens} prompt tokens "
        f"({t.reused_tokens} kept in the cache) {1000 * t.prefill_s:.0f} ms; {new} new tokens{cycles}, "
        f"{new / t.decode_s if t.decode_s > 0 else 0:.1f} tokens/s]"
    )

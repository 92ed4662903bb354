"""Emitted tokens' logprobs (`decoding.logprobs.TokenLogprobs`) in OpenAI's shapes: a chat choice's
`logprobs.content` and a completion choice's legacy `logprobs` (tokens, token_logprobs, top_logprobs, text_offset).

A token's text is its id decoded alone (special tokens shown); `bytes` are that text's UTF-8 bytes (as vLLM gives
them). A completion's `text_offset` of a token is where it starts in the answer: the summed lengths of the texts of
the tokens before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eagle_jax.decoding.logprobs import TokenLogprobs

Text = Callable[[int], str]  # a token id's text


def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat(tokens: Sequence[TokenLogprobs], top: int, text: Text) -> dict:
    """A chat choice's `logprobs` (or a chunk's, for the tokens it carries): each token and its `top` alternatives."""
    return {
        "content": [
            {**_entry(text(t.token), t.logprob), "top_logprobs": [_entry(text(i), lp) for i, lp in t.top[:top]]}
            for t in tokens
        ]
    }


def completion(tokens: Sequence[TokenLogprobs], top: int, text: Text, offset: int) -> dict:
    """A completion choice's legacy `logprobs` for tokens whose first starts `offset` characters into the answer:
    `top_logprobs` maps the `top` alternatives and the token itself (up to top + 1 entries, as OpenAI's) to logprobs."""
    texts = [text(t.token) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{**{text(i): lp for i, lp in t.top[:top]}, s: t.logprob} for t, s in zip(tokens, texts)],
        "text_offset": offsets,
    }

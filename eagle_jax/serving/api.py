"""The OpenAI-compatible HTTP API over a `Batcher`: chat and text completions (streamed as server-sent
events or whole), models, health and Prometheus metrics.

Each request is read (up to a byte limit: 413 beyond it), parsed and tokenised on a worker thread (the event
loop keeps serving meanwhile) and admitted before its response starts (429 with Retry-After when the free
slots and the queue cannot take it, streaming or not). Each prompt becomes a `batcher.Request`; the engine
thread hands its tokens to an asyncio queue of the request's handler, which detokenises them incrementally,
applies stop strings (a met stop string cancels the row) and writes OpenAI-format chunks. A client that goes
away, streaming or not, cancels its rows; their slots are free before the next cycle. Every error is an
OpenAI error object: input the server cannot take (a value of the wrong type or range, a number too large,
JSON nested too deeply, text that is not valid Unicode) is a 400 naming the field or the body; a prompt plus
an explicit `max_tokens` beyond a row's context is a 400 `context_length_exceeded` (without `max_tokens`, the
default `--max-tokens` is cut to what the context leaves); anything else is a 500 "internal error" with a
request id, its traceback logged once, and the connection is kept. Fields the server does not implement
(tools, response formats, penalties, logit bias, echo, best_of, suffix) are refused with a 400 that names them.
Logprobs (chat `logprobs` + `top_logprobs`, completions `logprobs`) are the target's raw ones (`serving.logprobs`);
each chunk of a stream carries those of the tokens received since the last. On shutdown (`serve`) running requests
have a grace period to finish; those cut at its end get 503 (whole answers) or an error event and `[DONE]` (streams).
A request's `eagle` object may ask for the stream's extension field (`"trace": true`, `serving.trace`) or plain
decoding (`"speculate": false`); `GET /` is the chat page (`web/`) that uses both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import reprlib
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from eagle_jax.decoding import prefix
from eagle_jax.decoding.grammar import Constraint, Grammars
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.errors import EagleError
from eagle_jax.io.loading import encode_chat
from eagle_jax.serving import batcher as batching
from eagle_jax.serving import logprobs as logprob_shapes
from eagle_jax.serving import structured
from eagle_jax.serving.trace import Trace

RETRY_AFTER_S = 1
MAX_STOPS = 4
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# fields that change an answer and are not implemented: refused unless left at their default
UNSUPPORTED: dict[str, Callable[[object], bool]] = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none", "auto"),
    "logit_bias": lambda v: not v,
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
}
MAX_DIGITS = sys.get_int_max_str_digits() or 4300  # the longest integer a body may hold
SHUTDOWN = "the server shut down before the answer was complete; retry"
PROMPT_HELP = "'prompt' must be a non-empty string, a list of token ids, or a non-empty list of either"
EAGLE = {"trace": False, "speculate": True}  # the request's `eagle` object: its fields and their defaults
WEB = Path(__file__).parent / "web"  # the chat page (plain HTML, CSS and JavaScript)
ERROR_TYPES = {404: "not_found_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


LOG = logging.getLogger(__name__)


class ShuttingDown(Exception):
    """The server's grace period ended before this answer did."""


class EngineFailed(Exception):
    """A row of the request ended with the engine's failure (its traceback is in the log)."""


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error object (a response's body, or a stream's event)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    message: str, status: int, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    """An OpenAI error object."""
    if status in (429, 503):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    body = error_body(message, status, param, code)
    # ASCII JSON: a message quoting a client's text renders whatever that text holds
    return Response(json.dumps(body), status, headers, media_type="application/json")


@dataclass(frozen=True)
class Parsed:
    prompts: tuple[list[int], ...]  # one per choice (a chat has one; a completion takes a list of prompts)
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None = None  # alternatives per token when the tokens' logprobs were asked for
    trace: bool = False  # chunks carry the `eagle` field (`serving.trace`)
    speculate: bool = True  # False: decoded plainly
    constraint: Constraint | None = None  # the grammar each answer follows (`structured`)


@dataclass
class Choice:
    """One answer being generated: its row's request, its ids so far, what of its text was sent."""

    req: batching.Request
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text already handed out
    tokens: int = 0  # what usage counts: up to the token that completes a stop string
    reason: str | None = None  # finish reason, once finished
    logprobs: list = field(default_factory=list)  # `TokenLogprobs` of `ids`, when asked for
    logprobs_sent: int = 0  # of them already handed out
    chars: int = 0  # characters of the texts of the tokens whose logprobs were handed out (a completion's offsets)
    trace: Trace | None = None  # where its tokens came from (asked for: `Parsed.trace`)


def _shown(value: object) -> str:
    """A client's value as an error message quotes it: short, whatever its size or depth."""
    return reprlib.repr(value)


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    real = isinstance(value, int | float) and not isinstance(value, bool)
    if not real or (isinstance(value, float) and not (math.isfinite(value) and (kind is float or value.is_integer()))):
        kind_name = "an integer" if kind is int else "a finite number"
        raise BadRequest(f"'{name}' must be {kind_name}, got {_shown(value)}", param=name)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise BadRequest(f"'{name}' must be {bounds}, got {_shown(value)}", param=name)
    return kind(value)  # within its bounds (every float field has an upper one): no overflow


def _unicode(text: str, param: str) -> str:
    """Text the tokenizer can take: refused when it holds a lone surrogate (valid JSON, not valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(
            f"'{param}' holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character {exc.start}; send valid "
            "Unicode",
            param=param,
        ) from None
    return text


def _json_int(digits: str) -> int:
    """An integer of the body: beyond Python's digit limit, refused as such (not as an interpreter error)."""
    if len(digits) > MAX_DIGITS:
        raise BadRequest(f"the request body holds an integer of {len(digits)} digits; no field takes one")
    return int(digits)


def _seed(seed: int | None) -> int:
    """A request's 64-bit seed folded into the 32 bits a row's key takes (seeds below 2**32 unchanged); a request
    without one gets a fresh random seed, so unseeded samples differ as OpenAI's do."""
    if seed is None:
        return secrets.randbits(32)
    seed %= 2**64
    return (seed & 0xFFFFFFFF) ^ (seed >> 32)


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


def _text(content: object, param: str) -> str:
    """A message's content: a string, or a non-empty list of text parts joined by newlines."""
    if isinstance(content, str):
        return _unicode(content, param)
    if (
        isinstance(content, list)
        and content
        and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)
    ):
        return _unicode("\n".join(p["text"] for p in content), param)
    raise BadRequest(
        f"'{param}' must be a string or a non-empty list of text parts ({{type: text, text}})", param=param
    )


def _stop_at(text: str, stops: Sequence[str]) -> int:
    """Where the first stop string starts in text, or -1."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def request_bytes_for(max_prompt: int, max_token_chars: int) -> int:
    """A body limit that takes the longest prompt the server accepts: every token as long as the longest in the
    vocabulary, every character escaped in JSON (6 bytes), plus 64 KiB for the other fields."""
    return max_prompt * 6 * max_token_chars + 65536


async def _read(request: Request, limit: int) -> bytes:
    """The request's body, refused with 413 beyond `limit` bytes (at once when its Content-Length says so)."""
    size = request.headers.get("content-length", "")
    too_big = f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)"
    if size.isdigit() and int(size) > limit:
        raise BadRequest(too_big, 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise BadRequest(too_big, 413)
    return bytes(body)


async def _cancel_when_gone(request: Request, choices: list[Choice]) -> None:
    """Cancel the rows of a client that disconnects before its whole answer is ready."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for c in choices:
        c.req.cancel()


class Api:
    """Request parsing and response writing for one model served by one batcher."""

    def __init__(
        self,
        engine: batching.Batcher,
        tokenizer,
        model: str,
        default_max_tokens: int = 256,
        max_request_bytes: int | None = None,
    ):
        self.engine, self.tok, self.model, self.default_max_tokens = engine, tokenizer, model, default_max_tokens
        self.max_token_chars = max(map(len, tokenizer.get_vocab()))  # no token covers more characters
        self.max_request_bytes = max_request_bytes or request_bytes_for(engine.max_prompt, self.max_token_chars)
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-jax-tokenizer")
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs
        self.draining = False  # shutting down: new requests get 503
        self.inflight: set[asyncio.Queue] = set()  # the event queues of the requests being answered
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda i: tokenizer.decode([i]))  # logprobs' tokens
        self._grammars: Grammars | None = None  # made with the first constrained request (about a second)
        self._grammars_made = threading.Lock()

    @property
    def grammars(self) -> Grammars:
        """The compiled grammars of this model's tokenizer and vocabulary."""
        with self._grammars_made:
            if self._grammars is None:
                tcfg = self.engine.cfg.tcfg
                self._grammars = Grammars(self.tok, tcfg.vocab_size, tcfg.eos_token_ids)
            return self._grammars

    async def read(self, request: Request, chat: bool) -> Parsed:
        """Read, parse and tokenise a request off the event loop."""
        raw = await _read(request, self.max_request_bytes)
        return await asyncio.get_running_loop().run_in_executor(self.worker, self.parse, raw, chat)

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse, without tokenising it, a prompt whose characters already need more tokens than a row holds."""
        if chars > self.engine.max_prompt * self.max_token_chars:
            raise BadRequest(
                f"the prompt has at least {-(-chars // self.max_token_chars)} tokens ({chars} characters); this "
                f"server takes {self.engine.max_prompt}; shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def _check_context(self, prompt: int, max_tokens: int | None, name: str) -> None:
        """Refuse a prompt and an explicit max_tokens that together outgrow a row's context (no silent clamp)."""
        context = self.engine.max_prompt + 1  # the cache less what a cycle's tree needs
        if max_tokens is not None and prompt + max_tokens > context:
            raise BadRequest(
                f"this server's context holds {context} tokens, but {_shown(prompt + max_tokens)} were asked for "
                f"({prompt} in the prompt, {_shown(max_tokens)} in '{name}'); shorten the prompt or lower '{name}' (or "
                "leave it out: the answer then stops where the context ends)",
                param=name,
                code="context_length_exceeded",
            )

    def _chat_prompt(self, messages: object) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list of {role, content}", param="messages")
        turns = []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise BadRequest(
                    f"messages[{i}]: role {role!r} is not supported; use {', '.join(ROLES)}",
                    param=f"messages[{i}].role",
                )
            turns.append({"role": ROLES[role], "content": _text(m.get("content"), f"messages[{i}].content")})
        self._check_chars(sum(len(t["content"]) for t in turns), "messages")
        return encode_chat(self.tok, turns, self.tok.chat_template is not None)

    def _text_prompts(self, prompt: object) -> list[list[int]]:
        if isinstance(prompt, str) or _is_ids(prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(PROMPT_HELP, param="prompt")
        most = self.engine.slots + self.engine.max_queue
        if len(prompt) > most:
            raise BadRequest(f"{len(prompt)} prompts in one request; this server takes at most {most}", param="prompt")
        vocab = self.engine.cfg.tcfg.vocab_size
        ids = []
        for p in prompt:
            if isinstance(p, str) and p:
                self._check_chars(len(_unicode(p, "prompt")), "prompt")
                ids.append(list(self.tok(p).input_ids))
            elif _is_ids(p):
                if not all(0 <= t < vocab for t in p):
                    raise BadRequest(f"'prompt' holds token ids outside 0..{vocab - 1}", param="prompt")
                ids.append(list(p))
            else:
                raise BadRequest(PROMPT_HELP, param="prompt")
        return ids

    def parse(self, raw: bytes, chat: bool) -> Parsed:
        try:
            body = json.loads(raw, parse_int=_json_int)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("the request body nests deeper than this server reads") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise BadRequest(f"'model' must be a string, got {_shown(model)}", param="model")
        if model is not None and model != self.model:
            raise BadRequest(
                f"the model {_shown(model)} does not exist; this server serves '{self.model}'",
                404,
                "model",
                "model_not_found",
            )
        if _number(body, "n", 1, int) != 1:
            raise BadRequest("only n=1 is supported", param="n")
        refused = [name for name, unset in UNSUPPORTED.items() if not unset(body.get(name))]
        if refused:
            raise BadRequest(
                f"this server does not support {', '.join(map(repr, refused))}; leave {'them' if refused[1:] else 'it'}"
                " out",
                param=refused[0],
                code="unsupported_parameter",
            )
        prompts = [self._chat_prompt(body.get("messages"))] if chat else self._text_prompts(body.get("prompt"))
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, max_name, None, int, low=1)
        vocab = self.engine.cfg.tcfg.vocab_size
        try:
            sampling = SamplingConfig(
                _number(body, "temperature", 1.0, low=0, high=2),
                _number(body, "top_p", 1.0, low=0, high=1, low_open=True),
                min(_number(body, "top_k", 0, int, low=0), vocab),  # k beyond the vocabulary keeps every token
            )
        except EagleError as exc:
            raise BadRequest(str(exc)) from None
        seed = _seed(_number(body, "seed", None, int, low=-(2**63), high=2**63 - 1))
        stops = body.get("stop")
        stops = (stops,) if isinstance(stops, str) else stops
        if stops is not None and (
            not isinstance(stops, list | tuple)
            or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)
        ):
            raise BadRequest(
                f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings", param="stop"
            )
        stops = tuple(_unicode(s, "stop") for s in stops or ())
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", param="stream")
        options = body.get("stream_options")
        if options is not None and not (
            isinstance(options, dict) and options.get("include_usage") in (None, True, False)
        ):
            raise BadRequest(
                "'stream_options' must be an object {include_usage: true or false}", param="stream_options"
            )
        include_usage = bool(options and options.get("include_usage"))
        eagle = body.get("eagle") or {}
        if not isinstance(eagle, dict) or not all(k in EAGLE and v in (None, True, False) for k, v in eagle.items()):
            raise BadRequest(
                "'eagle' must be an object {trace: true or false, speculate: true or false}", param="eagle"
            )
        eagle = {**EAGLE, **{k: v for k, v in eagle.items() if v is not None}}
        param = "messages" if chat else "prompt"
        for prompt in prompts:
            try:
                self.engine.check(prompt, max_tokens or 1)
            except EagleError as exc:
                raise BadRequest(str(exc), param=param, code="context_length_exceeded") from None
            self._check_context(len(prompt), max_tokens, max_name)
        max_tokens = max_tokens or self.default_max_tokens  # a row stops where its context ends
        logprobs = self._logprobs(body, chat)
        try:
            constraint = structured.constraint(body)
            if constraint is not None:
                field = "structured_outputs" if body.get("structured_outputs") is not None else "response_format"
                if self.engine.multi_host:
                    raise BadRequest("structured output is served by one-host servers only; leave it out", param=field)
                structured.compile_bounded(self.grammars, constraint, field)
        except structured.Refused as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        args = (stops, stream, include_usage, logprobs, eagle["trace"], eagle["speculate"], constraint)
        return Parsed(tuple(prompts), max_tokens, sampling, seed, *args)

    def _logprobs(self, body: dict, chat: bool) -> int | None:
        """The alternatives per token a request asks logprobs with (chat: `logprobs` true and `top_logprobs`;
        completions: `logprobs`), bounded by what the engine records; None when it asks none."""
        most = self.engine.cfg.logprobs
        if not chat:
            if body.get("top_logprobs") is not None:
                raise BadRequest("'top_logprobs' is a chat field; completions take 'logprobs': N", param="top_logprobs")
            asked = _number(body, "logprobs", None, int, low=0, high=most)
        else:
            wants = body.get("logprobs")
            if wants is not None and not isinstance(wants, bool):
                raise BadRequest(f"'logprobs' must be true or false, got {_shown(wants)}", param="logprobs")
            top = _number(body, "top_logprobs", None, int, low=0, high=most)
            if top is not None and not wants:
                raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            asked = (top or 0) if wants else None
        if asked is not None and not most:
            raise BadRequest("this server records no logprobs; leave 'logprobs' out", param="logprobs")
        return asked

    def admit(self, parsed: Parsed) -> tuple[list[Choice], asyncio.Queue]:
        """Queue a row per prompt, all or none (`batcher.QueueFull`), before any response starts. The engine
        thread puts (choice index, "tokens" | "finish", new ids | reason) on the returned queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def request(i: int, prompt: list[int]) -> batching.Request:
            def put(kind: str, value) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (i, kind, value))

            return batching.Request(
                prompt,
                parsed.max_tokens,
                parsed.sampling,
                parsed.seed,
                on_tokens=lambda ids: put("tokens", ids),
                on_finish=lambda why: put("finish", why),
                on_logprobs=None if parsed.logprobs is None else lambda lp: put("logprobs", lp),
                speculate=parsed.speculate,
                on_sources=(lambda *cycle: put("sources", cycle)) if parsed.trace else lambda *cycle: None,
                grammar=self.grammars.matcher(parsed.constraint) if parsed.constraint else None,
            )

        choices = [Choice(request(i, p), trace=Trace() if parsed.trace else None) for i, p in enumerate(parsed.prompts)]
        self.engine.submit(*(c.req for c in choices))
        self.inflight.add(events)
        return choices, events

    def drain(self, grace: float) -> None:
        """Shut down: refuse new requests with 503, and end those still running after `grace` seconds."""
        self.draining = True
        asyncio.get_running_loop().call_later(grace, self.cut)

    def cut(self) -> None:
        """End every running request (`deltas` raises `ShuttingDown`)."""
        for events in self.inflight:
            events.put_nowait((0, "shutdown", None))

    async def deltas(
        self, parsed: Parsed, choices: list[Choice], events: asyncio.Queue
    ) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice index, text delta, None) as text becomes final, and (index, last delta, finish reason) once
        per choice; every row is cancelled on the way out (a no-op for finished ones). `ShuttingDown` when `cut`."""
        decode = lambda ids: self.tok.decode(ids, skip_special_tokens=True)  # noqa: E731
        hold = max((len(s) for s in parsed.stops), default=1) - 1
        try:
            while any(c.reason is None for c in choices):
                i, kind, value = await events.get()
                if kind == "shutdown":
                    raise ShuttingDown
                c = choices[i]
                if c.reason is not None:  # a row cancelled by its stop string, still finishing
                    continue
                if kind == "logprobs":  # those of the tokens that come next
                    c.logprobs += value
                    continue
                if kind == "finish" and value == "error":
                    raise EngineFailed
                if kind == "sources":
                    c.trace.cycle(*value)
                    continue
                if kind == "finish":
                    c.reason = "length" if value == "length" else "stop"
                    yield i, decode(c.ids)[c.sent :], c.reason
                    continue
                before, c.ids = len(c.ids), c.ids + value
                if c.trace is not None:
                    c.trace.tokens(c.ids, decode)
                text = decode(c.ids)
                cut = _stop_at(text, parsed.stops)
                if cut >= 0:  # usage counts up to the token that completes the stop string
                    c.req.cancel()
                    ends = (j for j in range(before + 1, len(c.ids)) if _stop_at(decode(c.ids[:j]), parsed.stops) >= 0)
                    c.tokens, c.reason = next(ends, len(c.ids)), "stop"
                    yield i, text[c.sent : cut], c.reason
                    continue
                c.tokens = len(c.ids)
                ready = len(text) - hold
                if text.endswith("\ufffd"):
                    ready = min(ready, len(text.rstrip("\ufffd")))
                if ready > c.sent:
                    yield i, text[c.sent : ready], None
                    c.sent = ready
        finally:
            self.inflight.discard(events)
            for c in choices:
                c.req.cancel()

    def _body(self, rid: str, created: int, chat: bool, part: str, choices: list[dict]) -> dict:
        """A response (part "message") or stream chunk (part "delta") around its choices."""
        kind = ("chat.completion" if part == "message" else "chat.completion.chunk") if chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.model, "choices": choices}

    @staticmethod
    def _usage(parsed: Parsed, choices: list[Choice]) -> dict:
        prompt, completion = sum(map(len, parsed.prompts)), sum(c.tokens for c in choices)
        cached = {"cached_tokens": sum(c.req.cached for c in choices)}
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": cached,
        }

    def _lp(self, parsed: Parsed, chat: bool, c: Choice) -> dict | None:
        """The logprobs of the choice's tokens not yet handed out (up to those usage counts) in its shape, now handed
        out; None when the request asked none."""
        if parsed.logprobs is None:
            return None
        new = c.logprobs[c.logprobs_sent : c.tokens]
        c.logprobs_sent += len(new)
        if chat:
            return logprob_shapes.chat(new, parsed.logprobs, self.token_text)
        part = logprob_shapes.completion(new, parsed.logprobs, self.token_text, c.chars)
        c.chars += sum(map(len, part["tokens"]))
        return part

    async def respond(self, parsed: Parsed, chat: bool, request: Request) -> Response:
        choices, events = self.admit(parsed)  # QueueFull here is a 429, before any byte of the response
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not parsed.stream:
            texts = [""] * len(choices)
            watch = asyncio.create_task(_cancel_when_gone(request, choices))
            try:
                async for i, delta, _ in self.deltas(parsed, choices, events):
                    texts[i] += delta
            except EngineFailed:
                return error_response(internal_error(rid), 500)
            finally:
                watch.cancel()
            parts = [
                _choice(
                    chat,
                    "message",
                    {"role": "assistant", "content": t} if chat else t,
                    c.reason,
                    i,
                    self._lp(parsed, chat, c),
                )
                for i, (t, c) in enumerate(zip(texts, choices))
            ]
            body = self._body(rid, created, chat, "message", parts)
            return JSONResponse({**body, "usage": self._usage(parsed, choices)})

        def chunk(choice: dict | None, usage: dict | None = None, trace: Trace | None = None, delta: str = "") -> str:
            body = self._body(rid, created, chat, "delta", [choice] if choice else [])
            if usage is not None:
                body["usage"] = usage
            if trace is not None:
                body["eagle"] = trace.field(delta)
            return f"data: {json.dumps(body)}\n\n"

        async def stream() -> AsyncIterator[str]:
            if chat:
                yield chunk(_choice(chat, "delta", {"role": "assistant", "content": ""}, None))
            try:
                async for i, delta, why in self.deltas(parsed, choices, events):
                    c = choices[i]
                    trace = c.trace
                    if delta or (parsed.logprobs is not None and c.logprobs_sent < c.tokens):
                        lp = self._lp(parsed, chat, c)
                        content = {"content": delta} if chat else delta
                        yield chunk(_choice(chat, "delta", content, None, i, lp), None, trace, delta)
                    if why:
                        yield chunk(_choice(chat, "delta", {} if chat else "", why, i), None, trace)
            except ShuttingDown:
                yield f"data: {json.dumps(error_body(SHUTDOWN, 503, code='server_shutdown'))}\n\n"
            except EngineFailed:
                yield f"data: {json.dumps(error_body(internal_error(rid), 500))}\n\n"
            else:
                if parsed.include_usage:
                    yield chunk(None, self._usage(parsed, choices))
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


def internal_error(rid: str) -> str:
    """What a request that failed inside the server is told (the log has the traceback, once)."""
    return f"internal error (request id {rid}); the server's log holds the details"


def _choice(
    chat: bool, part: str, content: dict | str, reason: str | None, index: int = 0, logprobs: dict | None = None
) -> dict:
    """One choice: a chat message or delta (`part`), or a completion's text; with its tokens' logprobs."""
    if chat:
        return {"index": index, part: content, "logprobs": logprobs, "finish_reason": reason}
    return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": reason}


def metrics_text(engine: batching.Batcher) -> str:
    s, index = engine.stats, engine.engine.index
    tau = s.generated_tokens / s.row_cycles if s.row_cycles else 0.0
    lines = [
        "# TYPE eagle_jax_requests_total counter",
        f"eagle_jax_requests_total {s.requests}",
        "# TYPE eagle_jax_requests_finished_total counter",
        f"eagle_jax_requests_finished_total {s.finished}",
        "# TYPE eagle_jax_requests_rejected_total counter",
        f"eagle_jax_requests_rejected_total {s.rejected}",
        "# TYPE eagle_jax_requests_dropped_total counter",
        f"eagle_jax_requests_dropped_total {s.dropped}",
        "# TYPE eagle_jax_requests_failed_total counter",
        f"eagle_jax_requests_failed_total {s.failed}",
        "# TYPE eagle_jax_prompt_tokens_total counter",
        f"eagle_jax_prompt_tokens_total {s.prompt_tokens}",
        "# TYPE eagle_jax_prompt_tokens_kept_total counter",
        f"eagle_jax_prompt_tokens_kept_total {s.kept_tokens}",
        "# TYPE eagle_jax_prefix_cache_hit_tokens_total counter",
        f"eagle_jax_prefix_cache_hit_tokens_total {s.kept_tokens}",
        "# TYPE eagle_jax_prefix_cache_hit_rate gauge",
        f"eagle_jax_prefix_cache_hit_rate {s.kept_tokens / s.prompt_tokens if s.prompt_tokens else 0.0:.4f}",
        "# TYPE eagle_jax_prefix_cache_tokens gauge",
        f"eagle_jax_prefix_cache_tokens {index.tokens if index else 0}",
        "# TYPE eagle_jax_prefix_cache_capacity_tokens gauge",
        f"eagle_jax_prefix_cache_capacity_tokens {index.blocks * prefix.BLOCK if index else 0}",
        "# TYPE eagle_jax_generated_tokens_total counter",
        f"eagle_jax_generated_tokens_total {s.generated_tokens}",
        "# TYPE eagle_jax_running_rows gauge",
        f"eagle_jax_running_rows {engine.live}",
        "# TYPE eagle_jax_queued_rows gauge",
        f"eagle_jax_queued_rows {engine.waiting}",
        "# TYPE eagle_jax_tau gauge",
        f"eagle_jax_tau {tau:.4f}",
        "# TYPE eagle_jax_cycle_seconds summary",
        f"eagle_jax_cycle_seconds_sum {s.cycle_seconds:.6f}",
        f"eagle_jax_cycle_seconds_count {s.cycles}",
        "# TYPE eagle_jax_accept_length histogram",
    ]
    total = 0
    for n in range(max(s.accept_histogram, default=0) + 1):
        total += s.accept_histogram.get(n, 0)
        lines.append(f'eagle_jax_accept_length_bucket{{le="{n}"}} {total}')
    lines += [
        f'eagle_jax_accept_length_bucket{{le="+Inf"}} {s.row_cycles}',
        f"eagle_jax_accept_length_sum {sum(n * c for n, c in s.accept_histogram.items())}",
        f"eagle_jax_accept_length_count {s.row_cycles}",
    ]
    return "\n".join(lines) + "\n"


class InternalErrors:
    """ASGI middleware: an exception that escapes a route is a 500 "internal error" with a request id (also in the
    X-Request-Id header), its traceback logged once, here; the connection stays open."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            rid = uuid.uuid4().hex[:16]
            LOG.exception("request %s (%s %s) failed", rid, scope["method"], scope["path"])
            if not started:
                await error_response(internal_error(rid), 500, headers={"X-Request-Id": rid})(scope, receive, send)


def serve(app: FastAPI, host: str, port: int, grace: float) -> None:
    """Serve `app` with uvicorn until SIGINT or SIGTERM. Then it takes no new request, the running ones have `grace`
    seconds to finish, and those still running are ended (`Api.cut`); returns once all have (a second signal
    stops at once). The signal is not raised again: a process that returns from here exits 0."""
    import uvicorn

    api: Api = app.state.api

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:
                self.force_exit = True
            elif api.loop is not None:
                api.loop.call_soon_threadsafe(api.drain, grace)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace + 5)
    server = Server(config)
    api.engine.on_dead = lambda: setattr(server, "should_exit", True)  # a supervisor restarts the process
    server.run()


def create_app(
    engine: batching.Batcher,
    tokenizer,
    model: str,
    default_max_tokens: int = 256,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app; the engine thread is started and stopped with it. `app.state.api` is its `Api`."""
    api = Api(engine, tokenizer, model, default_max_tokens, max_request_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        api.loop = asyncio.get_running_loop()
        engine.start()
        yield
        engine.stop()
        api.worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="eagle-jax", lifespan=lifespan)
    app.state.api = api
    app.add_middleware(InternalErrors)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # unknown routes (404), wrong methods (405)
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return error_response(str(exc), 422)

    async def handle(request: Request, chat: bool) -> Response:
        if api.draining:
            return error_response("the server is shutting down; retry", 503, code="server_shutdown")
        try:
            return await api.respond(await api.read(request, chat), chat, request)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.param, exc.code)
        except batching.QueueFull as exc:
            return error_response(f"the server is busy ({exc}); retry shortly", 429)
        except ShuttingDown:
            return error_response(SHUTDOWN, 503, code="server_shutdown")
        except batching.EngineError as exc:  # dead: the process is ending
            return error_response(str(exc), 503)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "eagle-jax"}]}

    @app.get("/health")
    async def health():
        if engine.dead:  # the engine could not rebuild its rows after a failure: the process is ending
            return error_response("the engine failed and could not rebuild its rows", 503)
        return {"status": "ok", "running_rows": engine.live, "queued_rows": engine.waiting}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

    @app.get("/")
    async def page():
        return FileResponse(WEB / "index.html")

    app.mount("/web", StaticFiles(directory=WEB), name="web")

    return app

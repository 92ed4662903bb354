"""The OpenAI-compatible HTTP API over a `Batcher`: chat and text completions (streamed as server-sent
events or whole), models, health and Prometheus metrics.

Each request becomes a `batcher.Request`; the engine thread hands its tokens to an asyncio queue of the
request's handler, which detokenises them incrementally, applies stop strings (a met stop string cancels
the row) and writes OpenAI-format chunks. A client that disconnects cancels its row; its slot is free
before the next cycle. Errors are OpenAI-style JSON bodies: 400 for a bad request, 404 for an unknown
model, 429 with Retry-After when the waiting queue is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.errors import EagleError
from eagle_jax.io.loading import encode_chat
from eagle_jax.serving import batcher as batching

RETRY_AFTER_S = 1
MAX_STOPS = 4


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = {404: "not_found_error", 429: "rate_limit_error", 503: "server_error"}.get(status, "invalid_request_error")
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Parsed:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingConfig
    seed: int
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, kind=float, low=None, high=None, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not float(value).is_integer()):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=name)
    value = kind(value)
    if (low is not None and (value <= low if low_open else value < low)) or (high is not None and value > high):
        bounds = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high is not None else "")
        raise BadRequest(f"'{name}' must be {bounds}, got {value}", param=name)
    return value


def _seed(seed: int | None) -> int:
    """A request's 64-bit seed folded into the 32 bits a row's key takes (seeds below 2**32 unchanged); a request
    without one gets a fresh random seed, so unseeded samples differ as OpenAI's do."""
    if seed is None:
        return secrets.randbits(32)
    seed %= 2**64
    return (seed & 0xFFFFFFFF) ^ (seed >> 32)


class Api:
    """Request parsing and response writing for one model served by one batcher."""

    def __init__(self, engine: batching.Batcher, tokenizer, model: str, default_max_tokens: int = 256):
        self.engine, self.tok, self.model, self.default_max_tokens = engine, tokenizer, model, default_max_tokens

    def parse(self, body: object, chat: bool) -> Parsed:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model:
            raise BadRequest(
                f"the model '{model}' does not exist; this server serves '{self.model}'",
                404,
                "model",
                "model_not_found",
            )
        if _number(body, "n", 1, int) != 1:
            raise BadRequest("only n=1 is supported", param="n")
        if chat:
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise BadRequest("'messages' must be a non-empty list of {role, content} strings", param="messages")
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            prompt = encode_chat(self.tok, messages, self.tok.chat_template is not None)
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            if not isinstance(text, str) or not text:
                raise BadRequest("'prompt' must be a non-empty string", param="prompt")
            prompt = list(self.tok(text).input_ids)
        max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, max_name, self.default_max_tokens, int, low=1)
        try:
            sampling = SamplingConfig(
                _number(body, "temperature", 1.0, low=0, high=2),
                _number(body, "top_p", 1.0, low=0, high=1, low_open=True),
                _number(body, "top_k", 0, int, low=0),
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
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest("'stream' must be true or false", param="stream")
        options = body.get("stream_options") or {}
        include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        try:
            self.engine.check(prompt, max_tokens)
        except EagleError as exc:
            raise BadRequest(str(exc), param="messages" if chat else "prompt", code="context_length_exceeded") from None
        return Parsed(prompt, max_tokens, sampling, seed, tuple(stops or ()), stream, include_usage)

    async def complete(self, parsed: Parsed) -> AsyncIterator[tuple[str, str | None, int]]:
        """Run one request: yields (text delta, None, tokens so far) as text becomes final, then
        ("", finish reason, tokens)."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = batching.Request(
            parsed.prompt,
            parsed.max_tokens,
            parsed.sampling,
            parsed.seed,
            on_tokens=lambda ids: loop.call_soon_threadsafe(events.put_nowait, ("tokens", ids)),
            on_finish=lambda why: loop.call_soon_threadsafe(events.put_nowait, ("finish", why)),
        )
        self.engine.submit(req)
        ids: list[int] = []
        sent = 0
        hold = max((len(s) for s in parsed.stops), default=1) - 1
        try:
            while True:
                kind, value = await events.get()
                if kind == "tokens":
                    ids += value
                    text = self.tok.decode(ids, skip_special_tokens=True)
                    cut = min((i for i in (text.find(s) for s in parsed.stops) if i >= 0), default=-1)
                    if cut >= 0:
                        req.cancel()
                        yield text[sent:cut], None, len(ids)
                        yield "", "stop", len(ids)
                        return
                    ready = len(text) - hold
                    if text.endswith("\ufffd"):
                        ready = min(ready, len(text.rstrip("\ufffd")))
                    if ready > sent:
                        yield text[sent:ready], None, len(ids)
                        sent = ready
                else:
                    text = self.tok.decode(ids, skip_special_tokens=True)
                    yield text[sent:], None, len(ids)
                    yield "", "length" if value == "length" else "stop", len(ids)
                    return
        finally:
            req.cancel()  # a no-op for a finished row; frees the slot of one whose client went away

    def _body(self, rid: str, created: int, chat: bool, part: str, choices: list[dict]) -> dict:
        """A response (part "message") or stream chunk (part "delta") around its choices."""
        kind = ("chat.completion" if part == "message" else "chat.completion.chunk") if chat else "text_completion"
        return {"id": rid, "object": kind, "created": created, "model": self.model, "choices": choices}

    def _usage(self, parsed: Parsed, completion: int) -> dict:
        return {
            "prompt_tokens": len(parsed.prompt),
            "completion_tokens": completion,
            "total_tokens": len(parsed.prompt) + completion,
        }

    async def respond(self, parsed: Parsed, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not parsed.stream:
            text, reason, tokens = "", None, 0
            async for delta, why, tokens in self.complete(parsed):  # noqa: B007 (the last count is used)
                text, reason = text + delta, why or reason
            message = {"role": "assistant", "content": text} if chat else text
            body = self._body(rid, created, chat, "message", [_choice(chat, "message", message, reason)])
            return JSONResponse({**body, "usage": self._usage(parsed, tokens)})

        def chunk(delta: dict | str, reason: str | None, usage: dict | None = None, choices: bool = True) -> str:
            body = self._body(rid, created, chat, "delta", [_choice(chat, "delta", delta, reason)] if choices else [])
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            tokens = 0
            async for delta, why, tokens in self.complete(parsed):  # noqa: B007 (the last count is used)
                if delta:
                    yield chunk({"content": delta} if chat else delta, None)
                if why:
                    yield chunk({} if chat else "", why)
            if parsed.include_usage:
                yield chunk({}, None, self._usage(parsed, tokens), choices=False)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def _choice(chat: bool, part: str, content: dict | str, reason: str | None) -> dict:
    """One choice: a chat message or delta (`part`), or a completion's text."""
    if chat:
        return {"index": 0, part: content, "finish_reason": reason}
    return {"index": 0, "text": content, "logprobs": None, "finish_reason": reason}


def metrics_text(engine: batching.Batcher) -> str:
    s = engine.stats
    tau = s.generated_tokens / s.row_cycles if s.row_cycles else 0.0
    lines = [
        "# TYPE eagle_jax_requests_total counter",
        f"eagle_jax_requests_total {s.requests}",
        "# TYPE eagle_jax_requests_finished_total counter",
        f"eagle_jax_requests_finished_total {s.finished}",
        "# TYPE eagle_jax_requests_rejected_total counter",
        f"eagle_jax_requests_rejected_total {s.rejected}",
        "# TYPE eagle_jax_prompt_tokens_total counter",
        f"eagle_jax_prompt_tokens_total {s.prompt_tokens}",
        "# TYPE eagle_jax_prompt_tokens_kept_total counter",
        f"eagle_jax_prompt_tokens_kept_total {s.kept_tokens}",
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


def create_app(engine: batching.Batcher, tokenizer, model: str, default_max_tokens: int = 256) -> FastAPI:
    """The FastAPI app; the engine thread is started and stopped with it."""
    api = Api(engine, tokenizer, model, default_max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="eagle-jax", lifespan=lifespan)

    async def handle(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the request body is not valid JSON: {exc}", 400)
        try:
            return await api.respond(api.parse(body, chat), chat)
        except BadRequest as exc:
            return error_response(str(exc), exc.status, exc.param, exc.code)
        except batching.QueueFull as exc:
            return error_response(f"the server is busy ({exc}); retry shortly", 429)

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
        return {"status": "ok", "running_rows": engine.live, "queued_rows": engine.waiting}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(metrics_text(engine), media_type="text/plain; version=0.0.4")

    return app

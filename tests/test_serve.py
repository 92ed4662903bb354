"""The OpenAI-compatible server on localhost, driven by the official `openai` client: continuous batching of
speculative rows must answer every request as plain decoding of it alone would."""

import concurrent.futures
import http.client
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from test_train import cli_env  # noqa: E402
from tiny import plain_generate, target_logprobs  # noqa: E402

from eagle_jax.decoding import grammar  # noqa: E402
from eagle_jax.decoding.engine import Engine  # noqa: E402
from eagle_jax.decoding.sampling import SamplingConfig  # noqa: E402
from eagle_jax.decoding.speculative import DecodeConfig  # noqa: E402
from eagle_jax.decoding.tree import PLAIN, DynamicTree, NoDraft  # noqa: E402
from eagle_jax.io import loading  # noqa: E402
from eagle_jax.serving import api, batcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo"
GOLDEN = ROOT / "tests" / "golden"
SLOTS = 4
QUESTIONS = [
    "How do I make a cup of tea?",
    "What are some tips for writing a good resume?",
    "Tell me about the history of the bicycle in a few sentences.",
    "Why is the sky blue?",
    "Write a short poem about the sea.",
    "What is the capital of France and what is it known for?",
    "Give me three ideas for a birthday party.",
    "How does a refrigerator keep food cold?",
]


def envelope(rows: int):
    """A tree for one live row, a chain for two, plain decoding (the head following along) for three or four."""
    return {1: DynamicTree(16, 4, 4), 2: DynamicTree(5, 3, 1)}.get(rows, PLAIN)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served():
    tcfg, tparams = loading.load_target(DEMO / "target", jnp.float32)  # stored in fp16: fp32 as the demo runs
    dcfg, dparams = loading.load_draft(DEMO / "eagle3", tcfg, dtype=jnp.float32)
    tok = loading.load_tokenizer(DEMO / "target")
    cfg = DecodeConfig(tcfg, dcfg)
    engine = batcher.Batcher(tparams, dparams, cfg, envelope, SLOTS, 256, (64, 16), prefix_tokens=512)
    engine.warm_up()
    port = free_port()
    app = api.create_app(engine, tok, "demo")
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine, (tcfg, tparams, tok), app.state.api
    server.should_exit = True
    thread.join(timeout=30)


def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def plain_answer(models, question: str, max_tokens: int) -> str:
    tcfg, tparams, tok = models
    ids = loading.encode_chat(tok, [{"role": "user", "content": question}])
    return tok.decode(plain_generate(tparams, tcfg, [ids], max_tokens).tokens[0], skip_special_tokens=True)


def ask(url, question: str, max_tokens: int, stream: bool = False, model: str = "demo", **kw) -> tuple[str, str]:
    messages = [{"role": "user", "content": question}]
    c = client(url)
    if not stream:
        r = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=False, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_concurrent_clients_get_what_plain_decoding_alone_gives(served):
    """16 clients at once, mixed questions, answer lengths and streaming, over 4 slots (so rows join and leave
    a running batch and the envelope changes with the load): every answer equals plain greedy decoding."""
    url, engine, models, _ = served
    jobs = [(QUESTIONS[i % len(QUESTIONS)], 8 + 7 * (i % 5), i % 2 == 0) for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: ask(url, *job, temperature=0), jobs))
    for (question, max_tokens, _), (text, reason) in zip(jobs, answers):
        assert text == plain_answer(models, question, max_tokens)
        assert reason in ("stop", "length")
    assert engine.live == 0 and engine.stats.kept_tokens > 0  # repeated questions reuse slot caches


def test_streamed_and_whole_answers_agree_and_count_usage(served):
    url, _, models, _ = served
    whole = client(url).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=20, temperature=0
    )
    streamed = ask(url, QUESTIONS[0], 20, stream=True, temperature=0)
    assert whole.choices[0].message.content == streamed[0] and whole.choices[0].finish_reason == streamed[1]
    tok = models[2]
    prompt = loading.encode_chat(tok, [{"role": "user", "content": QUESTIONS[0]}])
    assert whole.usage.prompt_tokens == len(prompt) and 0 < whole.usage.completion_tokens <= 20
    text = client(url).completions.create(model="demo", prompt="The weather today", max_tokens=12, temperature=0)
    ids = list(tok("The weather today").input_ids)
    expected = tok.decode(plain_generate(models[1], models[0], [ids], 12).tokens[0], skip_special_tokens=True)
    assert text.choices[0].text == expected and text.usage.completion_tokens == 12


def test_a_conversation_starts_from_its_cached_prefix_and_says_so(served):
    """Each turn of a conversation (whole and streamed, with other rows taking the slots between turns) answers as
    plain decoding of the whole conversation; usage counts the prompt tokens the server had cached; /metrics has
    the hits, the hit rate and the cached tokens."""
    url, engine, models, _ = served
    tcfg, tparams, tok = models
    messages = [{"role": "system", "content": "You are a helpful assistant who answers briefly."}]
    cached = []
    for turn, question in enumerate(QUESTIONS[:3]):
        messages.append({"role": "user", "content": question})
        with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:  # the other slots are taken meanwhile
            list(pool.map(lambda q: ask(url, q, 6, temperature=0), QUESTIONS[4 : 4 + SLOTS]))
        ids = loading.encode_chat(tok, messages)
        expected = tok.decode(plain_generate(tparams, tcfg, [ids], 12).tokens[0], skip_special_tokens=True)
        kw = {"model": "demo", "messages": messages, "max_tokens": 12, "temperature": 0}
        if turn % 2 == 0:
            r = client(url).chat.completions.create(**kw)
            text, usage = r.choices[0].message.content, r.usage
        else:
            usage_too = {"stream": True, "stream_options": {"include_usage": True}}
            chunks = list(client(url).chat.completions.create(**kw, **usage_too))
            text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
        assert text == expected and usage.prompt_tokens == len(ids)
        cached.append(usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": text})
    assert cached[1] > 0 and cached[2] > cached[1], cached
    text = httpx.get(f"{url}/metrics").text
    figures = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(figures["eagle_jax_prefix_cache_hit_tokens_total"]) == engine.stats.kept_tokens >= sum(cached)
    assert 0 < float(figures["eagle_jax_prefix_cache_hit_rate"]) < 1
    assert 0 < int(figures["eagle_jax_prefix_cache_tokens"]) <= int(figures["eagle_jax_prefix_cache_capacity_tokens"])


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
STRUCTURED = [  # (request fields, the constraint they mean)
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        grammar.Constraint.json_schema(PERSON),
    ),
    (
        {"extra_body": {"structured_outputs": {"choice": ["tea", "coffee", "water"]}}},
        grammar.Constraint.choice(["tea", "coffee", "water"]),
    ),
    (
        {"extra_body": {"structured_outputs": {"regex": "[a-z]+( [a-z]+){0,4}\\."}}},
        grammar.Constraint.regex("[a-z]+( [a-z]+){0,4}\\."),
    ),
    ({"response_format": {"type": "json_object"}}, grammar.Constraint.json_object()),
    ({}, None),
]


def constrained_answer(engine, tok, grammars, question: str, max_tokens: int, constraint) -> tuple[str, str]:
    """(text, finish) of plain greedy decoding of a question alone under a constraint (a one-row engine)."""
    engine.admit(0, loading.encode_chat(tok, [{"role": "user", "content": question}]), max_tokens,
                 grammar=grammars.matcher(constraint) if constraint else None)  # fmt: skip
    tokens, finish = [], None
    while engine.live:
        for step in engine.cycle():
            tokens, finish = tokens + step.tokens, step.finish
    return tok.decode(tokens, skip_special_tokens=True), finish


def test_rows_with_different_constraints_answer_as_each_alone(served):
    """Ten requests at once, each with a JSON schema, choices, a regex, json_object or nothing, streamed and not:
    every answer equals plain greedy decoding of it alone under its constraint; the schema's answers validate."""
    url, engine, models, app_api = served
    jobs = [(QUESTIONS[i % 3], *STRUCTURED[i % len(STRUCTURED)], i % 2 == 0) for i in range(10)]
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda j: ask(url, j[0], 40, stream=j[3], temperature=0, **j[1]), jobs))
    tcfg, tparams, tok = models
    plain = Engine(tparams, None, DecodeConfig(tcfg), 1, 256)
    for (question, _, constraint, _), got in zip(jobs, answers):
        assert got == constrained_answer(plain, tok, app_api.grammars, question, 40, constraint)
        if constraint is not None and constraint.kind == "json_schema":
            assert got[1] == "stop"
            jsonschema.validate(json.loads(got[0]), PERSON)
    assert engine.live == 0


def test_a_constrained_completion_that_cannot_finish_ends_by_length(served):
    url, _, _, _ = served
    body = {"prompt": "Name:", "max_tokens": 3, "temperature": 0, "response_format": {"type": "json_object"}}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3


def test_seeded_samples_reproduce_whatever_runs_beside_them(served):
    """A sampled request with a seed gives the same answer alone and amid other rows; another seed differs."""
    url, _, _, _ = served
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    alone = ask(url, QUESTIONS[1], 16, **kw)[0]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(ask, url, QUESTIONS[i], 16, temperature=0.7, seed=i) for i in range(3)]
        amid = pool.submit(ask, url, QUESTIONS[1], 16, **kw).result()[0]
        [f.result() for f in crowd]
    assert amid == alone
    assert ask(url, QUESTIONS[1], 16, temperature=0.9, top_p=0.95, seed=8)[0] != alone
    # OpenAI's seeds are 64-bit: a large or negative one reproduces too; without a seed, samples differ
    assert ask(url, QUESTIONS[1], 16, **{**kw, "seed": 2**32 + 6})[0] == alone  # folds to 6 ^ 1 = 7
    big = [ask(url, QUESTIONS[1], 16, **{**kw, "seed": -(2**62) - 3})[0] for _ in range(2)]
    assert big[0] == big[1]
    unseeded = {ask(url, QUESTIONS[1], 16, temperature=0.9, top_p=0.95)[0] for _ in range(3)}
    assert len(unseeded) > 1


def test_stop_strings_end_the_answer(served):
    url, _, models, _ = served
    full = plain_answer(models, QUESTIONS[3], 40)
    stop = full[10:14]
    text, reason = ask(url, QUESTIONS[3], 40, temperature=0, stop=[stop])
    assert reason == "stop" and text == full[: full.find(stop)]


def test_a_client_that_goes_away_frees_its_slot(served):
    url, engine, models, _ = served
    body = {"model": "demo", "messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 200}
    body |= {"stream": True, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(ask, url, QUESTIONS[4], 30, temperature=0)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        assert other.result()[0] == plain_answer(models, QUESTIONS[4], 30)
    deadline = time.time() + 30
    while engine.live and time.time() < deadline:
        time.sleep(0.05)
    assert engine.live == 0
    assert httpx.get(f"{url}/health").json()["running_rows"] == 0


HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = {  # body, status, the field the error names (None: the body)
    "malformed JSON": (b"{not json", 400, None),
    "not an object": (b"[1, 2]", 400, None),
    "unknown model": ({"model": "gpt-5", "messages": HI}, 404, "model"),
    "model not a string": ({"model": 123, "messages": HI}, 400, "model"),
    "no messages": ({"model": "demo", "messages": []}, 400, "messages"),
    "max_tokens 0": ({"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    "401-digit max_tokens": ({"messages": HI, "max_tokens": 10**400}, 400, "max_tokens"),
    "max_tokens beyond the context": ({"messages": HI, "max_tokens": 250}, 400, "max_tokens"),
    "5000-digit integer": (b'{"messages": [], "seed": 1' + b"0" * 5000 + b"}", 400, None),
    "nested too deeply": (b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    "lone surrogate": (b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, "messages[0].content"),
    "lone surrogate stop": (b'{"messages": [{"role": "user", "content": "hi"}], "stop": "\\udfff"}', 400, "stop"),
    "negative temperature": ({"messages": HI, "temperature": -1}, 400, "temperature"),
    "NaN temperature": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "temperature"),
    "huge temperature": ({"messages": HI, "temperature": 10**400}, 400, "temperature"),
    "top_p 0": ({"messages": HI, "top_p": 0}, 400, "top_p"),
    "n 2": ({"messages": HI, "n": 2}, 400, "n"),
    "huge n": ({"messages": HI, "n": 10**400}, 400, "n"),
    "stream_options not an object": ({"messages": HI, "stream": True, "stream_options": "x"}, 400, "stream_options"),
    "prompt longer than the cache": ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    "empty content parts": ({"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages[0].content",
    ),
    "logprobs not a bool": ({"messages": HI, "logprobs": 1}, 400, "logprobs"),
    "top_logprobs beyond 20": ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "top_logprobs without logprobs": ({"messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
    "tools": ({"messages": HI, "tools": [{"type": "function"}], "tool_choice": "required"}, 400, "tools"),
    "schema with a wrong type": (
        {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
        400,
        "response_format",
    ),
    "unsupported schema keyword": (
        {"messages": HI, "structured_outputs": {"json": {"type": "array", "uniqueItems": True}}},
        400,
        "structured_outputs",
    ),
    "bad regex": ({"messages": HI, "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs"),
    "unknown response_format": ({"messages": HI, "response_format": {"type": "yaml"}}, 400, "response_format"),
    "two constraints": (
        {"messages": HI, "response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
        400,
        "structured_outputs",
    ),
}


def post_raw(conn: http.client.HTTPConnection, body: dict | bytes, path: str = "/v1/chat/completions"):
    """POST on a kept-alive connection: (status, headers, the error object or the body)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, content, {"content-type": "application/json"})
    r = conn.getresponse()
    doc = json.loads(r.read())
    return r.status, r.headers, doc.get("error", doc)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_errors(served, case):
    url, engine, _, _ = served
    body, status, param = BAD_REQUESTS[case]
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    got, _, error = post_raw(conn, body)
    assert got == status and error["param"] == param, error
    assert error["message"] and error["type"] and len(error["message"]) < 600, error
    assert httpx.get(f"{url}/health").status_code == 200 and engine.live == 0


def test_bad_input_keeps_the_connection(served):
    """Every refusal is answered on the client's kept-alive connection, which then serves a good request."""
    url, _, _, _ = served
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.connect()
    sock = conn.sock
    for body, status, _ in BAD_REQUESTS.values():
        assert post_raw(conn, body)[0] == status
    assert post_raw(conn, {"messages": HI, "max_tokens": 2, "top_k": 2**40})[0] == 200  # k beyond the vocabulary
    assert conn.sock is sock


def test_a_prompt_and_max_tokens_beyond_the_context_are_refused_not_clamped(served):
    """An explicit max_tokens that the context cannot hold beside the prompt is a 400 that says both; without one,
    the answer takes what the context leaves."""
    url, engine, models, _ = served
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=120)
    prompt = len(loading.encode_chat(models[2], HI))
    context = engine.max_prompt + 1
    status, _, error = post_raw(conn, {"messages": HI, "max_tokens": context - prompt + 1})
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert f"holds {context} tokens" in error["message"]
    assert f"({prompt} in the prompt, {context - prompt + 1} in 'max_tokens')" in error["message"]
    status, _, body = post_raw(conn, {"messages": HI, "max_tokens": context - prompt, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= context - prompt


@pytest.mark.parametrize("field", ["tools", "tool_choice", "presence_penalty", "logit_bias"])
def test_fields_the_server_does_not_implement_are_named(served, field):
    url, _, _, _ = served
    value = {"tools": [{"type": "function"}], "tool_choice": "required"}
    value |= {"presence_penalty": 0.5, "logit_bias": {"1": 5}}
    body = {"messages": [{"role": "user", "content": "hi"}], field: value[field]}
    r = httpx.post(f"{url}/v1/chat/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == field and repr(field) in error["message"]


def test_every_error_is_an_openai_error_object(served, monkeypatch, caplog):
    """A failure nobody foresaw is a 500 "internal error" with a request id: its class and message stay in the log,
    where its traceback is written once, and the connection is kept."""
    url, _, _, app_api = served
    for method, path, status in (("GET", "/v1/chat/completions", 405), ("GET", "/nowhere", 404)):
        r = httpx.request(method, f"{url}{path}")
        assert r.status_code == status and r.json()["error"]["message"], r.text

    def fails(*_):
        raise RuntimeError("planted")

    monkeypatch.setattr(app_api, "respond", fails)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR):
            conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
            status, headers, error = post_raw(conn, {"messages": HI})
            sock = conn.sock
            monkeypatch.undo()
            assert post_raw(conn, {"messages": HI, "max_tokens": 1})[0] == 200 and conn.sock is sock
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    rid = headers["X-Request-Id"]
    assert status == 500 and error["type"] == "server_error" and "planted" not in error["message"]
    assert error["message"].startswith("internal error") and rid in error["message"]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 1 and rid in tracebacks[0].getMessage() and "planted" in caplog.text


def test_what_openai_accepts_is_accepted(served):
    """Text parts, a developer message, token-id prompts and lists of prompts (one choice each, in order,
    streamed or not) answer as plain decoding of the same prompt does."""
    url, _, models, _ = served
    tcfg, tparams, tok = models
    c = client(url)
    parts = [{"type": "text", "text": QUESTIONS[3]}]
    r = c.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": parts}], max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content == plain_answer(models, QUESTIONS[3], 12)
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    r = c.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
    ids = loading.encode_chat(
        tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTIONS[0]}]
    )
    assert r.choices[0].message.content == tok.decode(
        plain_generate(tparams, tcfg, [ids], 8).tokens[0], skip_special_tokens=True
    )

    texts = ["The weather today", "Once upon a time"]
    ids = [list(tok(t).input_ids) for t in texts]
    expected = [tok.decode(t, skip_special_tokens=True) for t in plain_generate(tparams, tcfg, ids, 10).tokens]
    for prompt in (texts, ids, ids[1]):
        r = c.completions.create(model="demo", prompt=prompt, max_tokens=10, temperature=0)
        got = [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
        assert got == (expected if prompt is not ids[1] else expected[1:])
        assert r.usage.prompt_tokens == sum(map(len, ids if prompt is not ids[1] else ids[1:]))
    streamed = ["", ""]
    for chunk in c.completions.create(model="demo", prompt=texts, max_tokens=10, temperature=0, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.text
    assert streamed == expected
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, tcfg.vocab_size]})
    assert r.status_code == 400 and "outside" in r.json()["error"]["message"]


def expected_logprobs(models, prompt: list[int], max_tokens: int, k: int):
    """Plain greedy decoding's tokens of `prompt` and their logprobs from a direct forward (`tiny.target_logprobs`)."""
    tcfg, tparams, _ = models
    tokens = plain_generate(tparams, tcfg, [prompt], max_tokens).tokens[0]
    return tokens, *target_logprobs(tparams, tcfg, prompt, tokens, k)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_the_targets_for_each_token(served, stream):
    """`logprobs` + `top_logprobs` on a chat: each emitted token, its raw logprob and its top alternatives, as a
    direct target forward of the plain answer gives them; streamed, the chunks carry them as the tokens come."""
    url, _, models, _ = served
    tok = models[2]
    ids = loading.encode_chat(tok, [{"role": "user", "content": QUESTIONS[2]}])
    tokens, chosen, top_ids, top = expected_logprobs(models, ids, 24, 3)
    kw = dict(model="demo", messages=[{"role": "user", "content": QUESTIONS[2]}], max_tokens=24, temperature=0)
    c = client(url)
    if stream:
        chunks = [ch.choices[0] for ch in c.chat.completions.create(**kw, logprobs=True, top_logprobs=3, stream=True)]
        carrying = [ch.logprobs.content for ch in chunks if ch.logprobs is not None]
        assert len(carrying) > 1  # not all at the end
        content = [t for part in carrying for t in part]
    else:
        r = c.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        assert r.usage.completion_tokens == len(content)
    assert [t.token for t in content] == [tok.decode([i]) for i in tokens]
    assert all(t.bytes == list(t.token.encode()) for t in content)
    np.testing.assert_allclose([t.logprob for t in content], chosen, atol=2e-4)
    for t, expected_ids, expected in zip(content, top_ids, top):
        assert [a.token for a in t.top_logprobs] == [tok.decode([i]) for i in expected_ids]
        np.testing.assert_allclose([a.logprob for a in t.top_logprobs], expected, atol=2e-4)
    assert c.chat.completions.create(**kw).choices[0].logprobs is None  # not asked: none


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_in_the_legacy_shape(served, stream):
    """`logprobs: N` on a completion: tokens, token_logprobs, top_logprobs (the N alternatives and the token) and
    text_offset, continued across a stream's chunks."""
    url, _, models, _ = served
    tok = models[2]
    ids = list(tok("Once upon a time").input_ids)
    tokens, chosen, top_ids, top = expected_logprobs(models, ids, 16, 2)
    kw = dict(model="demo", prompt=ids, max_tokens=16, temperature=0, logprobs=2)
    c = client(url)
    if stream:
        parts = [ch.choices[0].logprobs for ch in c.completions.create(**kw, stream=True) if ch.choices]
        parts = [p for p in parts if p is not None]
        assert len(parts) > 1
        got = {f: [x for p in parts for x in getattr(p, f)] for f in ("tokens", "token_logprobs", "top_logprobs")}
        got["text_offset"] = [x for p in parts for x in p.text_offset]
    else:
        lp = c.completions.create(**kw).choices[0].logprobs
        got = {f: getattr(lp, f) for f in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    texts = [tok.decode([i]) for i in tokens]
    assert got["tokens"] == texts
    np.testing.assert_allclose(got["token_logprobs"], chosen, atol=2e-4)
    assert got["text_offset"] == [sum(map(len, texts[:j])) for j in range(len(texts))]
    for alternatives, t, lp, expected_ids, expected in zip(got["top_logprobs"], texts, chosen, top_ids, top):
        want = {tok.decode([i]): v for i, v in zip(expected_ids, expected)} | {t: lp}
        assert alternatives.keys() == want.keys()
        np.testing.assert_allclose([alternatives[key] for key in want], list(want.values()), atol=2e-4)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_completion_logprobs_are_refused(served, body, param):
    r = httpx.post(f"{served[0]}/v1/completions", json=body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error


def test_usage_stops_at_the_token_that_completes_the_stop_string(served):
    """A cycle accepts several tokens at once: usage counts up to the one that completes the stop string."""
    url, _, models, _ = served
    tcfg, tparams, tok = models
    ids = loading.encode_chat(tok, [{"role": "user", "content": QUESTIONS[3]}])
    answer = plain_generate(tparams, tcfg, [ids], 40).tokens[0]
    text = tok.decode(answer, skip_special_tokens=True)
    for stop in {text[6:9], text[15:17], text[24:27]}:
        counted = next(j for j in range(1, 41) if stop in tok.decode(answer[:j], skip_special_tokens=True))
        r = client(url).chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": QUESTIONS[3]}],
            max_tokens=40,
            temperature=0,
            stop=[stop],
        )
        assert r.choices[0].message.content == text[: text.find(stop)] and r.usage.completion_tokens == counted


def slow_cycles(monkeypatch, engine, seconds: float) -> None:
    """Every cycle of the engine takes `seconds` longer (rows stay busy long enough to watch them)."""
    cycle = engine.engine.cycle

    def slow():
        time.sleep(seconds)
        return cycle()

    monkeypatch.setattr(engine.engine, "cycle", slow)


def wait_idle(engine, seconds: float) -> bool:
    deadline = time.time() + seconds
    while (engine.live or engine.waiting) and time.time() < deadline:
        time.sleep(0.02)
    return not (engine.live or engine.waiting)


def test_admission_counts_free_slots_and_refuses_before_the_response(served, monkeypatch):
    """With no queue, an idle server takes as many requests as it has slots; the next one, streaming or not, gets
    a 429 with Retry-After before its response starts (never a 200 stream that is then cut)."""
    url, engine, models, _ = served
    assert wait_idle(engine, 30)  # idle: no row of an earlier test holds a slot
    engine.engine.compiled.wait()  # every program compiled (the tests' conftest may have let go of some since)
    monkeypatch.setattr(engine, "max_queue", 0)
    slow_cycles(monkeypatch, engine, 0.25)  # a row's 60 tokens take seconds: the four run at once on a busy machine
    long = [QUESTIONS[i] for i in (1, 2, 6, 7)]  # answers longer than 60 tokens: every row stays busy
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        jobs = [pool.submit(ask, url, q, 60, i % 2 == 0, temperature=0) for i, q in enumerate(long)]
        deadline = time.time() + 30
        while engine.live < SLOTS and time.time() < deadline:
            time.sleep(0.01)
        assert engine.live == SLOTS, "the four long answers never ran at once"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        for stream in (True, False):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": stream}) as r:
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
                assert json.loads(r.read())["error"]["type"] == "rate_limit_error"
        assert engine.live == SLOTS  # refused while every slot was taken
        answers = [j.result() for j in jobs]
    assert [a[0] for a in answers] == [plain_answer(models, q, 60) for q in long]
    assert wait_idle(engine, 10)


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_row(served, monkeypatch):
    """A non-streaming request whose client times out stops decoding at once instead of running to max_tokens."""
    url, engine, _, _ = served
    slow_cycles(monkeypatch, engine, 0.2)  # 200 tokens would take over 10 s
    body = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 200, "temperature": 0}
    before = engine.stats.generated_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1.0)
    assert wait_idle(engine, 3.0)
    assert engine.stats.generated_tokens - before < 100


class SpyTokenizer:
    """The server's tokenizer, noting the threads that encode with it."""

    def __init__(self, tok):
        self.tok, self.threads = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kw):
        self.threads.append(threading.current_thread().name)
        return self.tok(*args, **kw)


def test_big_requests_stall_nothing(served, monkeypatch):
    """A body above the byte limit gets 413 at once; a prompt whose characters already need more tokens than a
    row holds gets 400 without being tokenised; prompts are tokenised off the event loop."""
    url, engine, models, app_api = served
    spy = SpyTokenizer(models[2])
    monkeypatch.setattr(app_api, "tok", spy)
    big = json.dumps({"messages": [{"role": "user", "content": "word " * 4_000_000}]}).encode()  # 20 MB
    assert len(big) > app_api.max_request_bytes
    r = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]
    chars = engine.max_prompt * app_api.max_token_chars + 1
    long = {"messages": [{"role": "user", "content": "a" * chars}]}
    assert len(json.dumps(long)) < app_api.max_request_bytes
    r = httpx.post(f"{url}/v1/chat/completions", json=long)
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "context_length_exceeded" and spy.threads == []
    assert ask(url, QUESTIONS[0], 4, temperature=0)[0] == plain_answer(models, QUESTIONS[0], 4)
    assert spy.threads and all(name.startswith("eagle-jax-tokenizer") for name in spy.threads)


def test_models_health_metrics(served):
    url, engine, _, _ = served
    assert [m.id for m in client(url).models.list().data] == ["demo"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics").text
    figures = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(figures["eagle_jax_requests_total"]) == engine.stats.requests > 0
    assert float(figures["eagle_jax_tau"]) >= 1.0
    assert int(figures['eagle_jax_accept_length_bucket{le="+Inf"}']) == int(figures["eagle_jax_accept_length_count"])


def test_rows_sampling_matches_the_static_rule():
    """Per-row processed distributions equal `sampling.processed_logits` for each row's own settings."""
    import jax.numpy as jnp

    from eagle_jax.decoding import rows, sampling

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 3, 50)).round(1), jnp.float32)  # rounded: ties at the top-k edge
    settings = [
        sampling.SamplingConfig(0.7, 1.0, 0),
        sampling.SamplingConfig(1.3, 0.8, 0),
        sampling.SamplingConfig(1.0, 1.0, 5),
        sampling.SamplingConfig(0.5, 0.6, 7),
    ]
    got = rows.processed_logits(logits, rows.RowControls.of(settings, [0, 1, 2, 3]))
    for r, sc in enumerate(settings):
        np.testing.assert_array_equal(np.asarray(got[r]), np.asarray(sampling.processed_logits(logits[r], sc)))


def test_a_seeded_sample_is_the_same_drafted_or_not(golden_target, golden_dir):
    """Keys follow sequence positions, so a seeded sampled row gives the same tokens with a tree, a chain, context
    candidates with no head, or plain decoding (`NoDraft`): speculation leaves each row's sampling law as its own
    settings make it."""

    tcfg, tparams = golden_target
    dcfg, dparams = loading.load_draft(golden_dir / "eagle3", tcfg)
    prompt = list(range(20, 60)) * 2  # repeats itself: context candidates are taken
    answers = []
    for tree in (DynamicTree(16, 4, 4), DynamicTree(5, 4, 1), NoDraft(context=5, min_match=1), PLAIN):
        head = (dparams, dcfg) if tree == PLAIN or tree.needs_head else (None, None)
        cfg = DecodeConfig(tcfg, head[1])
        engine = batcher.Batcher(tparams, head[0], cfg, lambda n, t=tree: t, slots=2, capacity=256, chunks=(32,))
        assert (engine.engine.dparams is None) == (not tree.needs_head)  # no tree grows from the head
        for seed, sc in ((3, SamplingConfig(0.8, 0.9, 0)), (4, SamplingConfig(1.0, 1.0, 20))):
            out: list[int] = []
            engine.submit(batcher.Request(prompt, 40, sc, seed, out.extend, lambda why: None))
            answers.append(out)
        while engine.step():
            pass
    assert answers[0] == answers[2] == answers[4] == answers[6] and answers[1] == answers[3] == answers[5] == answers[7]
    assert answers[0] != answers[1] and len(answers[0]) == 40


def test_cycles_compute_the_live_rows_and_compile_nothing_after_warm_up(golden_target, golden_dir, compiles):
    """Cycles run on the live rows padded with idle ones to a bucket (1, 2, 4 or 8 of 8 slots), each bucket with
    its own envelope; rows joining and leaving run only warmed programs and answer as plain decoding."""
    tcfg, tparams = golden_target
    dcfg, dparams = loading.load_draft(golden_dir / "eagle3", tcfg)
    engine = batcher.Batcher(tparams, dparams, DecodeConfig(tcfg, dcfg), envelope, slots=8, capacity=128)
    assert sorted(engine.engine.envelope) == [1, 2, 4, 8]
    assert [engine.engine.bucket(n) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]
    engine.warm_up()
    warm = len(compiles)
    prompts = [list(range(5, 40)), list(range(100, 112)), list(range(300, 360)), [7, 8, 9] * 5]
    outs = [[] for _ in prompts]
    budgets = [60, 45, 30, 15]
    for group in ((0,), (1, 2, 3)):  # 1 live row, then 4, 3, 2 and 1 as they finish
        for i in group:
            engine.submit(batcher.Request(prompts[i], budgets[i], SamplingConfig(), 0, outs[i].extend, print))
        engine.step()
    while engine.step():
        pass
    assert len(compiles) == warm, compiles[warm:]
    for prompt, budget, out in zip(prompts, budgets, outs):
        assert out == plain_generate(tparams, tcfg, [prompt], budget).tokens[0]


def test_loadtest_reports_model_paths_without_the_machines_folders(tmp_path):
    from instruments import loadtest

    run, shown = loadtest.server_flags(str(tmp_path / "smollm2"), "demo/eagle3", "fp32", 8, 1024)
    assert run == [f"--target={tmp_path / 'smollm2'}", "--draft=demo/eagle3", "--dtype=fp32", *shown[3:]]
    assert shown == ["--target=smollm2", "--draft=demo/eagle3", "--dtype=fp32", "--max-batch", "8", "--max-len", "1024"]
    assert loadtest.server_flags(None, None, None, 4, 512)[1] == ["--max-batch", "4", "--max-len", "512"]


def test_loadtest_measures_a_running_server(served, tmp_path, capsys):
    from instruments import loadtest

    url, _, _, _ = served
    out = tmp_path / "load.json"
    args = ["--url", url, "--concurrency", "1,3", "--requests", "3", "--max-tokens", "8", "--json", str(out)]
    assert loadtest.main(args) == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["spec"]] == [1, 3]
    for r in report["spec"]:
        assert r["requests"] == 3 and 0 < r["tokens"] <= 24 and r["tokens_per_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tpot_ms_p50"] >= 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "spec" in capsys.readouterr().out
    assert loadtest.main(args) == 0, "a rerun replaces its own report"
    multi = [*args[:3], "2", "--requests", "2", "--max-tokens", "8", "--turns", "3", "--json", str(out)]
    assert loadtest.main(multi) == 0
    (turns,) = json.loads(out.read_text())["spec"]
    assert len(turns["ttft_ms_p50_by_turn"]) == 3 and turns["requests"] == 6 and turns["cached_share"] > 0

    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": 1}')
    assert loadtest.main([*args[:-1], str(foreign)]) == 2
    assert "was not written by this command" in capsys.readouterr().err
    assert foreign.read_text() == '{"mine": 1}'


def test_loadtest_fault_mode_finds_nothing_wrong(served, monkeypatch, tmp_path, capsys):
    """A burst beyond the slots (no queue), clients that go away, a 32 MB body, malformed requests: each
    request completes, is refused correctly or is abandoned; none is wrong."""
    from instruments import loadtest

    url, engine, _, _ = served
    monkeypatch.setattr(engine, "max_queue", 0)
    slow_cycles(monkeypatch, engine, 0.05)
    out = tmp_path / "faults.json"
    args = ["--url", url, "--faults", "--burst", "12", "--max-tokens", "24", "--json", str(out)]
    assert loadtest.main(args) == 0, capsys.readouterr()
    f = json.loads(out.read_text())["faults"]
    assert f["wrong"] == 0 and f["sent"] == f["completed"] + f["refused"] + f["abandoned"]
    assert f["completed"] >= SLOTS and f["refused"] >= 2 + len(loadtest.MALFORMED) and f["abandoned"] >= 1
    assert f["freed_after_abandon_s"] is not None and "wrong 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--port", "70000"], "--port 70000"),
        (["--max-len", "100000"], "--max-len"),
        (["--target", "/no/such/model"], "/no/such/model: directory not found"),
        (["--target", str(GOLDEN / "target")], "no draft head"),
        (["--max-logprobs", "-1"], "--max-logprobs must be >= 0"),
        (["--max-logprobs", "5000"], "--max-logprobs 5000 exceeds the target's 4096 tokens"),
        (["--prefix-cache-tokens", str(10**13)], "--prefix-cache-tokens: 10000000000000 cached tokens need"),
        (["--prefix-cache-tokens", "-1"], "--prefix-cache-tokens: -1 must be >= 0"),
    ],
    ids=[
        "max-batch 0",
        "port out of range",
        "max-len above the positions",
        "missing target",
        "target without head",
        "max-logprobs below 0",
        "max-logprobs above the vocabulary",
        "prefix cache beyond memory",
        "negative prefix cache",
    ],
)
def test_serve_refuses_bad_flags_in_one_line(args, expected, capsys, tmp_path, monkeypatch):
    from infer import serve

    monkeypatch.setenv("EAGLE_JAX_CACHE", str(tmp_path))
    assert serve.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err


def test_rows_on_a_mesh_answer_as_on_one_device(golden_target, golden_dir):
    """Parameters and the rows' caches split over data=2, tensor=2: the batched answers equal plain decoding."""
    import jax

    from eagle_jax.parallel import sharding

    tcfg, tparams = golden_target
    dcfg, dparams = loading.load_draft(golden_dir / "eagle3", tcfg)
    mesh = sharding.make_mesh("data=2,tensor=2", jax.devices()[:4])
    placed_t = sharding.place(tparams, sharding.target_shardings(tcfg, mesh))
    placed_d = sharding.place(dparams, sharding.draft_shardings(dcfg, mesh))
    tree = DynamicTree(16, 4, 4)
    engine = batcher.Batcher(
        placed_t, placed_d, DecodeConfig(tcfg, dcfg), lambda n: tree, slots=2, capacity=256, chunks=(32,), mesh=mesh
    )
    prompts = [list(range(5, 40)), list(range(100, 112)), list(range(300, 360))]
    outs = [[] for _ in prompts]
    for prompt, out in zip(prompts, outs):
        engine.submit(batcher.Request(prompt, 24, SamplingConfig(), 0, out.extend, lambda why: None))
    while engine.step():
        pass
    for prompt, out in zip(prompts, outs):
        assert out == plain_generate(tparams, tcfg, [prompt], 24).tokens[0]


def start_server(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """`infer.serve args` (the demo pair) in its own process, once every program is compiled: (process, url, log)."""
    port, log = free_port(), tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer.serve", "--port", str(port), *args],
        env=cli_env(tmp_path),
        cwd=ROOT,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 300
    while "programs compiled" not in log.read_text() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    ready = proc.poll() is None and "programs compiled" in log.read_text()
    # the structured-output programs compile after the others (`Engine(structured=True)`)
    structured = re.search(r"then [1-9]\d* for requests that follow grammars", log.read_text())
    if not (ready and structured):
        proc.kill()  # a failed start leaves no server behind
    assert ready and structured, log.read_text()
    return proc, f"http://127.0.0.1:{port}", log


def stream_events(url: str, body: dict, events: list) -> None:
    """The data of each server-sent event of a streamed completion, appended as it arrives."""
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=120) as r:
        events.extend(line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: "))


def test_sigterm_drains_the_streams_within_the_grace_and_exits_0(tmp_path):
    """SIGTERM with two streams running: the short one finishes as it would have, the long one ends at the grace
    period with an error event and [DONE], and the server exits 0 soon after."""
    grace = 1.0
    proc, url, log = start_server(["--max-batch", "2", "--max-len", "2048", "--shutdown-grace", str(grace)], tmp_path)
    try:
        # 6 tokens, and 2000: about 7 s greedy on two cores (several times the grace on any machine); greedy, so
        # that neither ends early by drawing an end of sequence
        short, long = [], []
        body = {"prompt": "Once upon a time", "temperature": 0}
        streams = [
            threading.Thread(target=stream_events, args=(url, body | {"max_tokens": n}, out))
            for n, out in ((6, short), (2000, long))
        ]
        for t in streams:
            t.start()
        deadline = time.time() + 60
        while not (short and long) and time.time() < deadline:
            time.sleep(0.01)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        took = time.time() - signalled
        for t in streams:
            t.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0 and grace <= took < grace + 10, (code, took, log.read_text())
    assert short[-1] == long[-1] == "[DONE]" and "Traceback" not in log.read_text()
    assert json.loads(short[-2])["choices"][0]["finish_reason"] == "length"
    error = json.loads(long[-2])["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "server_error"
    assert all(json.loads(e)["choices"][0]["finish_reason"] is None for e in long[:-2])


def two_hosts(args: list[str], tmp_path: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    """`infer.serve args` started as a two-process job on this machine (two CPU devices each)."""
    env = cli_env(tmp_path, devices=2) | {
        "COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}",
        "NUM_PROCESSES": "2",
    }
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "infer.serve", *args],
            env=env | {"PROCESS_ID": str(i)},
            cwd=ROOT,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for i, log in enumerate(logs)
    ]
    return procs, logs


@pytest.mark.parametrize("case", ["no mesh", "no measured budget"])
def test_two_processes_refuse_what_they_cannot_serve_in_one_line(case, tmp_path):
    """Both processes stop with the same one-line error (the budget is read on process 0 and sent to all)."""
    if case == "no mesh":
        args, expected = ["--max-batch", "2"], "--mesh: a server on 2 processes needs one mesh over all their 4 devices"
    else:
        head = tmp_path / "head"
        head.mkdir()
        for name in ("config.json", "model.safetensors"):  # the demo head without its budget.json
            (head / name).write_bytes((DEMO / "eagle3" / name).read_bytes())
        args, expected = ["--draft", str(head), "--mesh", "data=2,fsdp=2", "--max-batch", "4"], "no measured draft-tree"
    procs, logs = two_hosts(args, tmp_path)
    assert [p.wait(timeout=120) for p in procs] == [2, 2]
    for log in logs:
        errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].startswith(f"error: {expected}"), errors


def test_two_processes_serve_as_one(served, tmp_path):
    """`infer.serve` as a two-host job (two processes of two CPU devices, one data=2,fsdp=2 mesh): process 0
    answers, process 1 decodes in step. Concurrent greedy answers (some with logprobs) equal plain decoding, a client
    that goes away frees its slot, a seeded sample equals the one-process server's, and stopping process 0 stops both
    cleanly."""
    port = free_port()
    # every row here fits 128 slots: one attention span (and fewer plan sizes) for both processes to compile
    procs, logs = two_hosts(
        ["--mesh", "data=2,fsdp=2", "--max-batch", "4", "--max-len", "128", "--port", str(port)], tmp_path
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while time.time() < deadline and all(p.poll() is None for p in procs):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-2000:] for log in logs)
        models = served[2]
        jobs = [(QUESTIONS[i], 6 + 5 * i, i % 2 == 0) for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            # the streamed ones ask for logprobs too (every process reads their rows' buffers in step)
            answers = list(pool.map(lambda job: ask(url, *job, model="target", temperature=0, logprobs=job[2]), jobs))
        for (question, max_tokens, _), (text, _) in zip(jobs, answers):
            assert text == plain_answer(models, question, max_tokens)
        body = {"messages": [{"role": "user", "content": QUESTIONS[2]}], "max_tokens": 90, "stream": True}  # 128 cached
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
            assert next(r.iter_lines()).startswith("data: ")
        kw = dict(temperature=0.9, top_p=0.95, seed=11)
        assert ask(url, QUESTIONS[1], 24, model="target", **kw) == ask(served[0], QUESTIONS[1], 24, **kw)
        assert httpx.get(f"{url}/health").json()["running_rows"] == 0
        metrics = dict(line.split() for line in httpx.get(f"{url}/metrics").text.splitlines() if line[0] != "#")
        procs[0].send_signal(signal.SIGTERM)  # process 0 drains and exits 0, and so does process 1
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
        assert "following process 0's engine" in logs[1].read_text()
        cycles, row_cycles, tokens = (
            metrics[f"eagle_jax_{name}"]
            for name in ("cycle_seconds_count", "accept_length_count", "generated_tokens_total")
        )
        assert f"followed {cycles} cycles: {row_cycles} row cycles, {tokens} tokens" in logs[1].read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()

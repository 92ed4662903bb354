"""Load test of the OpenAI-compatible server: throughput, time to first token and time per output token at
several concurrency levels, with speculation and with --no-spec, in one run.

    python -m instruments.loadtest [--target DIR --draft DIR] [--concurrency 1,2,4,8,16] [--max-batch 16]
        [--questions data/eval/mt_bench.jsonl] [--requests 16] [--max-tokens 128] [--json OUT]
    python -m instruments.loadtest --url http://127.0.0.1:8000 ...          # a server already running (one mode)
    python -m instruments.loadtest --faults [--burst 48] [--max-queue 4] ...  # the server under faults
    python -m instruments.loadtest --turns 5 [--prefix-cache-tokens N] ...     # multi-turn conversations

Without --url it starts `python -m infer.serve` twice on a free local port (speculative, then --no-spec,
same models and settings), waits for its warm-up, and sends greedy streamed chat requests (MT-bench first
turns, cycling) from C concurrent clients. Prints and writes (JSON + PNG next to it) per mode and level:
output tokens/s, time to first token and time per output token (p50/p99), and the speedup of speculation.
With --turns N each client holds conversations of N turns instead (the question's turns, then follow-ups),
sending the whole conversation each turn as an OpenAI client does: the report adds each turn's time to first
token (p50) and the share of prompt tokens the server had cached (`usage.prompt_tokens_details`).

With --faults it runs one server (started with --max-queue, or --url) through faults instead: a burst of
streamed and whole requests beyond its slots and queue, clients that go away (streams closed after their
first chunk, whole answers given up after half a second), a body far above its byte limit while /health is
polled, and malformed requests. Every request counts as completed (a whole answer, a stream ending in
[DONE]), refused correctly (429 with Retry-After, 413, 400 or 404 as an OpenAI error object, before any
byte of a stream), abandoned (by the client) or wrong (anything else: a stream cut after its 200, an error
without an error object, abandoned rows still decoding after FREED_WITHIN_S).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cli import command, models
from eagle_jax.errors import EagleError
from eagle_jax.io import files

READY_TIMEOUT_S = 1800
FREED_WITHIN_S = 5.0  # abandoned rows must be gone by then
BIG_BODY_BYTES = 32 << 20
PNG_TITLE = "eagle-jax load test"  # in the plot's metadata: how a rerun recognises its own PNG
FOLLOW_UPS = ("Go on.", "Say more about the last point.", "Summarise that in one sentence.", "Why?")


def server_flags(
    target: str | None, draft: str | None, dtype: str | None, max_batch: int, max_len: int
) -> tuple[list[str], list[str]]:
    """The flags of the servers started here, and the same flags as the report records them (model paths as
    `command.shown_path`: no machine's folders in a shared report)."""
    models = {"target": target, "draft": draft}
    given = [(k, v) for k, v in (*models.items(), ("dtype", dtype)) if v]
    sizes = ["--max-batch", str(max_batch), "--max-len", str(max_len)]
    shown = [f"--{k}={command.shown_path(v) if k in models else v}" for k, v in given]
    return [f"--{k}={v}" for k, v in given] + sizes, shown + sizes


def conversations(path: Path, n: int, turns: int = 1) -> list[list[str]]:
    """n conversations of `turns` user turns: a question's turns, then follow-ups (cycling over the questions)."""
    asked = [json.loads(line)["turns"] for line in Path(path).read_text().splitlines() if line.strip()]
    if not asked:
        raise EagleError(f"--questions {path}: no questions found")
    return [(asked[i % len(asked)] + list(FOLLOW_UPS) * turns)[:turns] for i in range(n)]


def first_turns(path: Path, n: int) -> list[str]:
    return [c[0] for c in conversations(path, n)]


async def one_request(client, url: str, question: str | list[dict], max_tokens: int) -> dict:
    """A streamed greedy chat request (a question, or a conversation's messages): time to first token, time per
    output token, tokens, the answer's text, the prompt's tokens and those the server had cached."""
    messages = [{"role": "user", "content": question}] if isinstance(question, str) else question
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    tokens, text, usage = 0, "", {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise EagleError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
                tokens = usage["completion_tokens"]
            delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if first is None and delta:
                first = time.perf_counter()
            text += delta or ""
    end = time.perf_counter()
    first = first or end
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "ttft_s": first - t0,
        "tpot_s": (end - first) / max(1, tokens - 1),
        "tokens": tokens,
        "end": end,
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "cached_tokens": cached,
    }


async def conversation(client, url: str, turns: list[str], max_tokens: int) -> list[dict]:
    """One client's conversation: each turn sends every earlier turn and answer with the new question."""
    messages: list[dict] = []
    results = []
    for i, question in enumerate(turns):
        messages.append({"role": "user", "content": question})
        results.append(await one_request(client, url, list(messages), max_tokens) | {"turn": i})
        messages.append({"role": "assistant", "content": results[-1]["text"]})
    return results


async def level(url: str, questions: list[str] | list[list[str]], concurrency: int, max_tokens: int) -> dict:
    """All `questions` (or conversations: lists of turns) sent by `concurrency` clients, each taking the next one
    when done."""
    import httpx

    todo = list(questions)
    results: list[dict] = []
    async with httpx.AsyncClient() as client:

        async def worker():
            while todo:
                q = todo.pop(0)
                if isinstance(q, str):
                    results.append(await one_request(client, url, q, max_tokens))
                else:
                    results.extend(await conversation(client, url, q, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ttft = np.array([r["ttft_s"] for r in results])
    tpot = np.array([r["tpot_s"] for r in results])
    tokens = sum(r["tokens"] for r in results)
    turns = sorted({r["turn"] for r in results if "turn" in r})
    by_turn = [1000 * float(np.percentile([r["ttft_s"] for r in results if r.get("turn") == t], 50)) for t in turns]
    prompt = sum(r["prompt_tokens"] for r in results)
    return {
        **({"ttft_ms_p50_by_turn": by_turn} if turns else {}),
        "cached_share": sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0,
        "concurrency": concurrency,
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_ms_p50": 1000 * float(np.percentile(ttft, 50)),
        "ttft_ms_p99": 1000 * float(np.percentile(ttft, 99)),
        "tpot_ms_p50": 1000 * float(np.percentile(tpot, 50)),
        "tpot_ms_p99": 1000 * float(np.percentile(tpot, 99)),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(args: list[str]) -> Iterator[str]:
    """`python -m infer.serve ARGS` on a free port (its log in a temporary file): its URL once /health answers;
    the server is stopped on the way out."""
    import httpx

    port = free_port()
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as the server process)
    cmd = [sys.executable, "-m", "infer.serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stderr=log, stdout=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise EagleError(f"the server exited ({proc.returncode}): {log.read().strip()[-300:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise EagleError(f"the server did not answer within {READY_TIMEOUT_S} s")
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def measure(url: str, questions: list, levels: Sequence[int], max_tokens: int, label: str) -> list[dict]:
    rows = []
    for c in tqdm(levels, desc=f"{label} concurrency", file=sys.stderr):
        asyncio.run(level(url, questions[: max(c, 1)], c, max_tokens))  # warm the path at this load
        rows.append(asyncio.run(level(url, questions, c, max_tokens)))
    return rows


def _refusal(r, status: int) -> bool:
    """A correct refusal: the status, an OpenAI error object, Retry-After on a 429."""
    try:
        error = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    ok = r.status_code == status and bool(error.get("message")) and bool(error.get("type"))
    return ok and (status != 429 or int(r.headers.get("retry-after", "0")) >= 1)


async def _request(client, url: str, body: dict) -> str:
    """Send one request and say how it went: "completed", "refused" or "wrong: why"."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        if r.status_code == 200:
            return "completed" if r.json()["choices"][0]["finish_reason"] else "wrong: no finish reason"
        return "refused" if _refusal(r, 429) else f"wrong: HTTP {r.status_code} {r.text[:80]}"
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            await r.aread()
            return "refused" if _refusal(r, 429) else f"wrong: HTTP {r.status_code} {r.text[:80]}"
        try:
            lines = [line async for line in r.aiter_lines()]
        except Exception as exc:  # noqa: BLE001 (a cut stream shows as any transport error)
            return f"wrong: stream cut ({type(exc).__name__})"
    return "completed" if "data: [DONE]" in lines else "wrong: stream ended without [DONE]"


async def _abandon(client, url: str, body: dict) -> str:
    """A client that goes away: a stream closed after its first chunk, a whole answer given up after 0.5 s."""
    if body.get("stream"):
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                await r.aread()
                return "refused" if _refusal(r, 429) else f"wrong: HTTP {r.status_code}"
            async for _ in r.aiter_lines():
                break
        return "abandoned"
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
    except Exception:  # noqa: BLE001 (the timeout this client gives up at)
        return "abandoned"
    return "completed" if r.status_code == 200 else "refused" if _refusal(r, 429) else f"wrong: HTTP {r.status_code}"


async def _idle_after(client, url: str) -> float | None:
    """Seconds until the server has no running or queued rows (None: not within FREED_WITHIN_S)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < FREED_WITHIN_S:
        health = (await client.get(f"{url}/health", timeout=10)).json()
        if health["running_rows"] == 0 and health["queued_rows"] == 0:
            return time.perf_counter() - t0
        await asyncio.sleep(0.02)
    return None


async def _big_body(client, url: str) -> tuple[str, float, float]:
    """A body of BIG_BODY_BYTES while /health is polled: (outcome, seconds to the answer, slowest /health)."""
    body = json.dumps({"messages": [{"role": "user", "content": "word " * (BIG_BODY_BYTES // 5)}]}).encode()
    slowest = 0.0
    done = asyncio.Event()

    async def poll():
        nonlocal slowest
        while not done.is_set():
            t = time.perf_counter()
            await client.get(f"{url}/health", timeout=60)
            slowest = max(slowest, time.perf_counter() - t)
            await asyncio.sleep(0.05)

    poller = asyncio.create_task(poll())
    t0 = time.perf_counter()
    r = await client.post(
        f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=600
    )
    seconds = time.perf_counter() - t0
    done.set()
    await poller
    outcome = "refused" if _refusal(r, 413) else f"wrong: HTTP {r.status_code} {r.text[:80]}"
    return outcome, seconds, slowest


MALFORMED = (  # (path, body, status)
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 21}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', 400),  # lone surrogate
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),  # nested too deeply
    ("/v1/completions", b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400),  # beyond Python's digits
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", 400),  # beyond the context
    ("/v1/nowhere", b"{}", 404),
)


async def fault_run(url: str, questions: list[str], burst: int, max_tokens: int) -> dict:
    """Every fault in turn against one server; counts of what each request got, and the timings."""
    import httpx

    outcomes: list[str] = []

    def body(i: int, tokens: int) -> dict:
        return {
            "messages": [{"role": "user", "content": questions[i % len(questions)]}],
            "max_tokens": tokens,
            "temperature": 0,
            "stream": i % 2 == 0,
        }

    limits = httpx.Limits(max_connections=burst + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        outcomes += await asyncio.gather(*(_request(client, url, body(i, max_tokens)) for i in range(burst)))
        freed = await _idle_after(client, url)
        n_abandon = max(2, burst // 4)
        abandoned = await asyncio.gather(*(_abandon(client, url, body(i, 4 * max_tokens)) for i in range(n_abandon)))
        freed_abandoned = await _idle_after(client, url)
        if freed_abandoned is None:
            abandoned = [
                f"wrong: rows still decoding {FREED_WITHIN_S} s after their clients went away"
                if a == "abandoned"
                else a
                for a in abandoned
            ]
        outcomes += abandoned
        big, big_s, health_s = await _big_body(client, url)
        outcomes.append(big)
        for path, content, status in MALFORMED:
            r = await client.post(f"{url}{path}", content=content, headers={"content-type": "application/json"})
            outcomes.append("refused" if _refusal(r, status) else f"wrong: {path} HTTP {r.status_code} {r.text[:80]}")
    counts = {k: sum(o == k for o in outcomes) for k in ("completed", "refused", "abandoned")}
    wrong = [o for o in outcomes if o.startswith("wrong")]
    return {
        "sent": len(outcomes),
        **counts,
        "wrong": len(wrong),
        "wrong_examples": sorted(set(wrong))[:5],
        "idle_after_burst_s": freed,
        "freed_after_abandon_s": freed_abandoned,
        "big_body_s": big_s,
        "slowest_health_s": health_s,
    }


def render_faults(f: dict) -> str:
    freed = "never" if f["freed_after_abandon_s"] is None else f"{f['freed_after_abandon_s']:.2f} s"
    lines = [
        f"sent {f['sent']}: completed {f['completed']}, refused correctly {f['refused']}, abandoned "
        f"{f['abandoned']}, wrong {f['wrong']}",
        f"abandoned rows freed after {freed}; a {BIG_BODY_BYTES >> 20} MB body refused after "
        f"{f['big_body_s']:.2f} s, slowest /health meanwhile {1000 * f['slowest_health_s']:.0f} ms",
    ]
    return "\n".join(lines + [f"  {w}" for w in f["wrong_examples"]])


def render(report: dict) -> str:
    lines = ["mode     conc  tok/s  ttft p50/p99 ms   tpot p50/p99 ms   speedup  cached  ttft p50 ms by turn"]
    plain = {r["concurrency"]: r for r in report.get("plain", [])}
    for mode in ("spec", "plain"):
        for r in report.get(mode, []):
            base = plain.get(r["concurrency"])
            speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if mode == "spec" and base else ""
            lines.append(
                f"{mode:7s} {r['concurrency']:5d} {r['tokens_per_s']:6.1f} "
                f"{r['ttft_ms_p50']:8.0f}/{r['ttft_ms_p99']:<7.0f} "
                f"{r['tpot_ms_p50']:8.1f}/{r['tpot_ms_p99']:<7.1f} {speed:>8s} {r.get('cached_share', 0):6.0%}  "
                + " ".join(f"{t:.0f}" for t in r.get("ttft_ms_p50_by_turn", []))
            )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in ("spec", "plain"):
        rows = report.get(mode, [])
        if rows:
            c = [r["concurrency"] for r in rows]
            axes[0].plot(c, [r["tokens_per_s"] for r in rows], marker="o", label=mode)
            axes[1].plot(c, [r["tpot_ms_p50"] for r in rows], marker="o", label=mode)
    for ax, name in zip(axes, ("output tokens/s", "time per output token p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(name)
        ax.legend()
    fig.suptitle("eagle-jax server load test")
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Title": PNG_TITLE})
    plt.close(fig)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (measured as one mode); default: start one per mode")
    models.add_flags(p, config=False, mesh=False, quantize=False)  # for the servers started here
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--questions", default="data/eval/mt_bench.jsonl")
    p.add_argument("--requests", type=int, default=16, help="requests per level (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="write the figures here (and a PNG next to it)")
    p.add_argument("--faults", action="store_true", help="run the server through faults instead (see above)")
    p.add_argument("--burst", type=int, default=48, help="--faults: requests sent at once")
    p.add_argument("--max-queue", type=int, default=4, help="--faults: the started server's queue")
    p.add_argument("--turns", type=int, default=1, help="turns of each client's conversations (1: single questions)")
    p.add_argument("--prefix-cache-tokens", type=int, help="the started servers' prefix cache (default: theirs)")
    a = p.parse_args(argv)
    try:
        levels = sorted({int(x) for x in a.concurrency.split(",") if x.strip()})
    except ValueError:
        raise EagleError(f"--concurrency {a.concurrency!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if min(levels, default=0) < 1 or min(a.requests, a.max_tokens, a.burst, a.turns) < 1 or a.max_queue < 0:
        raise EagleError(
            "--concurrency levels, --requests, --max-tokens, --burst and --turns must be >= 1, --max-queue >= 0"
        )
    if a.json:  # a new file or this command's earlier report (JSON and the PNG next to it)
        if Path(a.json).suffix != ".json":
            raise EagleError(f"--json {a.json}: name a .json file (the .png plot is written next to it)")
        files.check_output_file(a.json, "json", [a.questions], files.json_with("settings"))
        png = Path(a.json).with_suffix(".png")
        files.check_output_file(png, "json", [a.questions], files.holds_bytes(PNG_TITLE.encode()))
    questions = first_turns(Path(a.questions), max(a.requests, max(levels)))
    if a.faults:
        return faults(a, questions)
    work = questions if a.turns == 1 else conversations(Path(a.questions), len(questions), a.turns)
    settings = {"concurrency": levels, "requests": len(questions), "max_tokens": a.max_tokens, "turns": a.turns}
    report: dict = {"settings": settings}
    if a.url:
        report["spec"] = measure(a.url.rstrip("/"), work, levels, a.max_tokens, "server")
    else:
        common, shown = server_flags(a.target, a.draft, a.dtype, a.max_batch, a.max_len)
        if a.prefix_cache_tokens is not None:
            common, shown = (x + ["--prefix-cache-tokens", str(a.prefix_cache_tokens)] for x in (common, shown))
        report["settings"] |= {"server_args": shown, "target": command.shown_path(a.target)}
        for mode, extra in (("spec", []), ("plain", ["--no-spec"])):
            with started_server(common + extra) as url:
                report[mode] = measure(url, work, levels, a.max_tokens, mode)
    print(render(report))
    if a.json:
        files.write_json_atomic(a.json, report)
        plot(report, png)
    return 0


def faults(a, questions: list[str]) -> int:
    """--faults: one server (started here with --max-queue, or --url) through every fault; prints and writes
    the counts."""
    report: dict = {"settings": {"burst": a.burst, "max_tokens": a.max_tokens}}
    if a.url:
        server = contextlib.nullcontext(a.url.rstrip("/"))
    else:
        common, shown = server_flags(a.target, a.draft, a.dtype, a.max_batch, a.max_len)
        report["settings"]["server_args"] = [*shown, "--max-queue", str(a.max_queue)]
        server = started_server([*common, "--max-queue", str(a.max_queue)])
    with server as url:
        report["faults"] = asyncio.run(fault_run(url, questions, a.burst, a.max_tokens))
    print(render_faults(report["faults"]))
    if a.json:
        files.write_json_atomic(a.json, report)
    return 0 if report["faults"]["wrong"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The prefix cache on the speculative server: with the cache against `--prefix-cache-tokens 0`, in one run.

    python -m instruments.prefix_bench [--target DIR --draft DIR] [--max-batch 8] [--max-len 2048]
        [--prefix-cache-tokens N] [--json OUT]

Two servers in this process, on the same models, rows and compiled programs (one with the prefix cache, one
without), answer over HTTP on local ports, one at a time, in three workloads:
(a) a five-turn conversation (MT-bench turns, then follow-ups; answers up to 100 tokens, greedy, streamed): the
    fifth turn's time to first token, the uncached server sent the same fifth request (median of three);
(b) eight concurrent requests that share a ~1000-token system prompt: their total prefill time (the engine's
    admissions, timed to the device's end, the cache's copies included);
(c) 16 completions with no shared prefix from 8 clients: output tokens/s.
Then what a hit costs next to the prefill it saves (a ~1000-token prompt admitted with nothing cached, and from
the cache), what copying a retiring row's blocks out costs (what rows that never hit pay), and the memory per
cached token. Prints the table; --json writes the figures and a .md table next to them. Without --target: the
demo pair (SmolLM2-135M-Instruct and its EAGLE-3 head once converted), with envelopes from the head's budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import numpy as np

from cli import command, envelope, models
from eagle_jax.decoding import budget as budgets
from eagle_jax.decoding import prefix
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading
from eagle_jax.serving import api, batcher
from instruments.loadtest import conversations, free_port, level, one_request

QUESTIONS = Path("data/eval/mt_bench.jsonl")
TURNS, ANSWER_TOKENS = 5, 100
SHARED, SYSTEM_WORDS = 8, 700  # (b): requests at once, words of their system prompt (~1000 tokens)
UNSHARED, UNSHARED_CLIENTS, UNSHARED_TOKENS = 16, 8, 64  # (c)
REPEATS = 3  # (c)'s alternating runs
GOALS = {"ttft": 0.20, "prefill": 0.30, "throughput": 0.05}


@contextlib.contextmanager
def serving(engine: batcher.Batcher, tok) -> Iterator[str]:
    """`engine` behind the API on a free local port: its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(api.create_app(engine, tok, "bench"), port=free_port(), log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@contextlib.contextmanager
def timed_admissions(engine: batcher.Batcher) -> Iterator[list[float]]:
    """Seconds of each admission inside (to the device's end: the prefill and the cache's copies)."""
    spent: list[float] = []
    admit = engine.engine.admit

    def timed(*args, **kw):
        t0 = time.perf_counter()
        kept = admit(*args, **kw)
        jax.block_until_ready(engine.engine.state)
        spent.append(time.perf_counter() - t0)
        return kept

    engine.engine.admit = timed
    try:
        yield spent
    finally:
        del engine.engine.admit


async def _conversation(url: str, turns: list[str], fifth_on: str, repeats: int = 3) -> tuple[float, list[float]]:
    """(a): the conversation on `url`, each turn's time to first token; then its last request on `fifth_on` (the
    median of `repeats`)."""
    import httpx

    messages: list[dict] = []
    ttft = []
    async with httpx.AsyncClient() as client:
        for question in turns:
            messages.append({"role": "user", "content": question})
            r = await one_request(client, url, list(messages), ANSWER_TOKENS)
            ttft.append(r["ttft_s"])
            messages.append({"role": "assistant", "content": r["text"]})
        last = messages[:-1]
        again = [(await one_request(client, fifth_on, last, ANSWER_TOKENS))["ttft_s"] for _ in range(repeats)]
    return statistics.median(again), ttft


async def _shared(url: str, system: str, questions: list[str]) -> list[dict]:
    """(b): the requests at once, each with the system prompt."""
    import httpx

    async with httpx.AsyncClient() as client:
        calls = [
            one_request(client, url, [{"role": "system", "content": system}, {"role": "user", "content": q}], 8)
            for q in questions
        ]
        return list(await asyncio.gather(*calls))


def system_prompt(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    vocab = [
        "model",
        "server",
        "cache",
        "prefix",
        "token",
        "answer",
        "request",
        "user",
        "system",
        "row",
        "block",
        "memory",
        "copy",
        "reuse",
        "time",
    ]
    return "You follow these rules. " + " ".join(rng.choice(vocab, words))


def hit_costs(cached: batcher.Batcher, whole: batcher.Batcher, prompt: list[int]) -> dict:
    """Seconds of admitting `prompt` with no reuse (the uncached engine) and from the pool alone (the cached
    engine, its rows' own caches set aside), of copying the hit's blocks in, and of copying them out (what a row
    pays that never hits): each the median of three after one untimed run."""
    eng = cached.engine

    def admit(engine, slot: int) -> float:
        t0 = time.perf_counter()
        engine.admit(slot, prompt, 1, owner=slot)
        jax.block_until_ready(engine.state)
        spent = time.perf_counter() - t0
        engine.cancel([slot])
        return spent

    def copy_in() -> float:
        args = eng._copy_in_args(1, prompt, eng.index.lookup(prompt))
        t0 = time.perf_counter()
        eng.state = eng.compiled("copy in", prefix.copy_in, *args)
        jax.block_until_ready(eng.state)
        return time.perf_counter() - t0

    def copy_out() -> float:
        eng.index.clear()
        eng.unoffered.append((0, prompt))
        t0 = time.perf_counter()
        eng._offer()
        jax.block_until_ready(eng.pool)
        return time.perf_counter() - t0

    def median(run) -> float:
        run()
        return statistics.median(run() for _ in range(3))

    cold = median(lambda: admit(whole.engine, 0))
    admit(eng, 0)  # the pool holds the prompt
    eng.keep_rows = False  # what a row keeps comes from the pool only
    hit = median(lambda: admit(eng, 1))
    eng.keep_rows = True
    blocks = len(eng.index.lookup(prompt))
    return {
        "prompt_tokens": len(prompt),
        "hit_blocks": blocks,
        "cold_s": cold,
        "hit_s": hit,
        "copy_in_s": median(copy_in),
        "copy_out_s": median(copy_out),
    }


def render(r: dict) -> str:
    a, b, c, h = r["conversation"], r["shared"], r["unshared"], r["hit"]
    ok = lambda x: "yes" if x else "NO"  # noqa: E731
    lines = [
        f"prefix cache: {r['prefix_tokens']} tokens, {r['bytes_per_token']} bytes per cached token "
        f"({r['bytes_per_token'] * r['prefix_tokens'] / 2**20:.0f} MiB)",
        "workload                                   with cache   without   ratio   goal   met",
        f"(a) turn {TURNS} time to first token (ms)          {1000 * a['with_s']:8.0f}  {1000 * a['without_s']:8.0f}"
        f"  {a['ratio']:6.1%}  <= {GOALS['ttft']:.0%}  {ok(a['ratio'] <= GOALS['ttft'])}",
        f"(b) {SHARED} requests, shared system: prefill (ms) {1000 * b['with_s']:8.0f}  {1000 * b['without_s']:8.0f}"
        f"  {b['ratio']:6.1%}  <= {GOALS['prefill']:.0%}  {ok(b['ratio'] <= GOALS['prefill'])}",
        f"(c) no shared prefix: output tokens/s       {c['with']:8.1f}  {c['without']:8.1f}"
        f"  {c['ratio']:6.1%}  >= {1 - GOALS['throughput']:.0%}  {ok(c['ratio'] >= 1 - GOALS['throughput'])}",
        f"turn times to first token with the cache (ms): {' '.join(f'{1000 * t:.0f}' for t in a['ttft_by_turn_s'])}; "
        f"cached share of (b)'s prompt tokens {b['cached_share']:.0%}",
        f"a hit: a {h['prompt_tokens']}-token prompt admitted with nothing cached {1000 * h['cold_s']:.0f} ms, from "
        f"{h['hit_blocks']} cached blocks {1000 * h['hit_s']:.0f} ms ({h['hit_s'] / h['cold_s']:.1%}), of which "
        f"copying them in {1000 * h['copy_in_s']:.1f} ms; copying them out (what a row that never hits pays) "
        f"{1000 * h['copy_out_s']:.1f} ms",
    ]
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m instruments.prefix_bench", description=__doc__.split("\n\n")[0])
    models.add_flags(p, config=False, mesh=False, quantize=False)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prefix-cache-tokens", type=int, help="the cache's budget (default: the server's)")
    p.add_argument("--json", help="write the figures here (and a .md table next to it)")
    a = p.parse_args(argv)
    if a.json:
        if Path(a.json).suffix != ".json":
            raise EagleError(f"--json {a.json}: name a .json file (the .md table is written next to it)")
        files.check_output_file(a.json, "json", [], files.json_with("prefix_tokens"))
    m = models.load(models.choose(a))
    tok = loading.load_tokenizer(m.target_dir)
    pair = (m.tcfg, m.tparams, m.dcfg, m.dparams)
    trees = {
        n: envelope.default_tree(pair, (m.target_dir, m.draft_dir), n, list, measure=False)
        for n in sorted({1, 4, 8, 16} & set(range(1, a.max_batch + 1)) | {1})
    }
    measured = budgets.Budget(budgets.device_kind(), trees)
    budget = a.max_batch * a.max_len if a.prefix_cache_tokens is None else a.prefix_cache_tokens
    cfg = DecodeConfig(m.tcfg, m.dcfg)
    made = {
        name: batcher.Batcher(m.tparams, m.dparams, cfg, measured.for_batch, a.max_batch, a.max_len, prefix_tokens=n)
        for name, n in (("with", budget), ("without", 0))
    }
    for engine in made.values():
        engine.warm_up()
    with serving(made["with"], tok) as cached, serving(made["without"], tok) as whole:
        turns = conversations(QUESTIONS, 1, TURNS)[0]
        print(f"(a) a {TURNS}-turn conversation", file=sys.stderr)
        for url in (cached, whole):
            asyncio.run(level(url, ["Hello there."], 1, 8))  # the HTTP path warm
        without, by_turn = asyncio.run(_conversation(cached, turns, whole))
        conversation = {
            "with_s": by_turn[-1],
            "without_s": without,
            "ratio": by_turn[-1] / without,
            "ttft_by_turn_s": by_turn,
        }

        print(f"(b) {SHARED} requests sharing a system prompt", file=sys.stderr)
        questions = conversations(QUESTIONS, SHARED)
        shared = {}
        for seed, (name, url) in enumerate((("with", cached), ("without", whole))):
            with timed_admissions(made[name]) as spent:
                answers = asyncio.run(_shared(url, system_prompt(SYSTEM_WORDS, seed), [q[0] for q in questions]))
            shared[f"{name}_s"] = sum(spent)
            if name == "with":
                prompt = sum(r["prompt_tokens"] for r in answers)
                shared["cached_share"] = sum(r["cached_tokens"] for r in answers) / prompt
                shared["prompt_tokens"] = prompt / len(answers)
        shared["ratio"] = shared["with_s"] / shared["without_s"]

        print("(c) completions with no shared prefix", file=sys.stderr)
        rng = np.random.default_rng(7)
        words = [
            "alpha",
            "beta",
            "gamma",
            "delta",
            "river",
            "stone",
            "cloud",
            "paper",
            "light",
            "music",
            "number",
            "garden",
            "window",
        ]
        prompts = [f"{i} " + " ".join(rng.choice(words, 30)) for i in range(UNSHARED * (1 + 2 * REPEATS))]
        for url in (cached, whole):  # warm, on prompts of their own
            asyncio.run(_completions(url, prompts[:UNSHARED_CLIENTS]))
        speed: dict[str, list[float]] = {"with": [], "without": []}
        for r in range(REPEATS):  # alternately, each on new prompts: a machine's noise falls on both
            for i, (name, url) in enumerate((("with", cached), ("without", whole))):
                first = UNSHARED * (1 + 2 * r + i)
                speed[name].append(asyncio.run(_completions(url, prompts[first : first + UNSHARED])))
        unshared = {name: statistics.mean(v) for name, v in speed.items()}
        unshared["ratio"] = unshared["with"] / unshared["without"]
    eng = made["with"].engine
    long = loading.encode_chat(tok, [{"role": "system", "content": system_prompt(SYSTEM_WORDS, 99)}])
    report = {
        "settings": {"max_batch": a.max_batch, "max_len": a.max_len, "target": command.shown_path(m.target_dir)},
        "prefix_tokens": budget,
        "bytes_per_token": prefix.bytes_per_token(m.tcfg, m.dcfg, m.tparams["embed"].dtype),
        "conversation": conversation,
        "shared": shared,
        "unshared": unshared,
        "hit": hit_costs(made["with"], made["without"], long[: eng.max_prompt]),
    }
    text = render(report)
    print(text)
    if a.json:
        files.write_json_atomic(a.json, report)
        shown = " ".join(["python -m instruments.prefix_bench", *(argv if argv is not None else sys.argv[1:])])
        Path(a.json).with_suffix(".md").write_text(f"```\n{shown}\n```\n\n```\n{text}\n```\n")
    return 0


async def _completions(url: str, prompts: list[str]) -> float:
    """(c): the completions from UNSHARED_CLIENTS clients: output tokens/s."""
    import httpx

    todo, tokens = list(prompts), []
    async with httpx.AsyncClient() as client:

        async def worker():
            while todo:
                body = {"prompt": todo.pop(0), "max_tokens": UNSHARED_TOKENS, "temperature": 0}
                r = await client.post(f"{url}/v1/completions", json=body, timeout=600)
                tokens.append(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(UNSHARED_CLIENTS)))
        return sum(tokens) / (time.perf_counter() - t0)


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""First start against second start of the commands that compile, on an empty persistent compilation cache.

    python -m instruments.startup [--smollm2 DIR] [--only chat,serve_demo,...] [--json results/startup/startup.json]

Each command runs twice with its own empty `$EAGLE_JAX_CACHE` (so its compilation cache, `cli.compile_cache`, starts
empty and the second start finds what the first stored), one after the other, and the seconds from launch to what a
user waits for are printed and written (JSON, and Markdown next to it):
- `chat`: `infer.generate` on the demo pair, one message on stdin: launch to the end of the first answer;
- `serve_demo`, `serve_smollm2`: `infer.serve` (the demo pair; SmolLM2 with its head, when --smollm2 is given):
  launch to the first completion of a 16-token chat request, and the warm-up its log reports (all its programs
  compiled, in the background);
- `benchmark`: `infer.benchmark --limit 1` on the demo pair: launch to exit;
- `train`: one `train.eagle3` step on the demo target: launch to exit.

Each start also reports its compile work: the seconds of tracing, lowering and compiling (or loading) that JAX logs
(`JAX_LOG_COMPILES=1`), summed over programs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import files
from instruments.loadtest import READY_TIMEOUT_S, free_port

PY = [sys.executable, "-m"]
DEMO = ["--target", "demo/target", "--draft", "demo/eagle3"]


COMPILE_LINE = re.compile(
    r"Finished (?:tracing|jaxpr to MLIR module conversion|XLA compilation) .*? in ([0-9.e+-]+) sec"
)


def _compile_s(log: str) -> float:
    """Seconds of tracing, lowering and compiling (or loading from a cache) that JAX logged (JAX_LOG_COMPILES=1),
    summed over programs (those compiled at once on worker threads add up)."""
    return sum(float(m.group(1)) for m in COMPILE_LINE.finditer(log))


def _until_line(cmd: list[str], env: dict, prefix: str, stdin: str = "") -> dict:
    """Seconds from launching `cmd` until it writes a stderr line starting with `prefix` (then it is left to exit),
    and its compile work to its exit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    proc.stdin.write(stdin.encode())
    proc.stdin.close()
    seen = []
    for line in proc.stderr:
        seen.append(line.decode(errors="replace"))
        if seen[-1].startswith(prefix):
            elapsed = time.perf_counter() - t0
            rest = proc.stderr.read().decode(errors="replace")
            proc.wait(timeout=READY_TIMEOUT_S)
            return {"s": elapsed, "compile_s": _compile_s("".join(seen) + rest)}
    proc.wait()
    raise EagleError(f"{' '.join(cmd[2:4])} exited ({proc.returncode}) before '{prefix}': {''.join(seen)[-300:]}")


def _to_exit(cmd: list[str], env: dict) -> dict:
    """Seconds from launch to exit, and the compile work."""
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise EagleError(f"{' '.join(cmd[2:4])} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return {"s": time.perf_counter() - t0, "compile_s": _compile_s(done.stderr)}


def _warm_up(log, proc: subprocess.Popen) -> dict:
    """The seconds of the server's 'warm-up: N programs compiled in S s' line, once it is in its log, and the
    compile work logged until then."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < READY_TIMEOUT_S and proc.poll() is None:
        log.seek(0)
        text = log.read()
        found = re.search(r"programs compiled in ([0-9.]+) s", text)
        if found:
            return {"warm_up_s": float(found.group(1)), "compile_s": _compile_s(text)}
        time.sleep(0.2)
    raise EagleError("the server did not report its warm-up")


def _first_completion(args: list[str], env: dict) -> dict:
    """Seconds from launching `infer.serve ARGS` to the end of its first (16-token) chat completion, the warm-up
    its log reports, and the compile work until then."""
    import httpx

    port = free_port()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([*PY, "infer.serve", *args, "--port", str(port)], env=env, stderr=log)
        messages = [{"role": "user", "content": "Hello!"}]
        try:
            while time.perf_counter() - t0 < READY_TIMEOUT_S:
                if proc.poll() is not None:
                    log.seek(0)
                    raise EagleError(f"the server exited ({proc.returncode}): {log.read().strip()[-300:]}")
                try:
                    url = f"http://127.0.0.1:{port}/v1"
                    model = httpx.get(f"{url}/models", timeout=5).json()["data"][0]["id"]
                except httpx.TransportError:
                    time.sleep(0.2)
                    continue
                request = {"model": model, "messages": messages, "max_tokens": 16}
                r = httpx.post(f"{url}/chat/completions", json=request, timeout=READY_TIMEOUT_S)
                if r.status_code != 200:
                    raise EagleError(f"the server answered {r.status_code}: {r.text[:300]}")
                return {"s": time.perf_counter() - t0, **_warm_up(log, proc)}
            raise EagleError(f"the server did not answer within {READY_TIMEOUT_S} s")
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def commands(smollm2: str | None) -> dict[str, tuple[str, Callable[[dict], dict]]]:
    """name -> (the command as shown, env -> {"s": seconds, "compile_s": compile work[, "warm_up_s": warm-up]})."""
    chat = [*PY, "infer.generate", *DEMO]
    bench = [*PY, "infer.benchmark", "--questions", "data/eval/mt_bench.jsonl", "--limit", "1", *DEMO]
    train = [*PY, "train.eagle3", "--target", "demo/target", "--data", "data/smollm2/answers.jsonl", "--steps", "1"]
    train += ["--batch-size", "4", "--max-length", "256", "--ttt-steps", "3", "--draft-vocab-size", "1024"]
    out = {
        "chat": (" ".join(chat[2:]), lambda env: _until_line(chat, env, "[prefill", "Hello, who are you?\n")),
        "serve_demo": ("infer.serve " + " ".join(DEMO), lambda env: _first_completion(DEMO, env)),
        "benchmark": (" ".join(bench[2:]), lambda env: _to_exit(bench, env)),
        "train": (" ".join(train[2:]) + " --out RUN", lambda env: _to_exit([*train, "--out", env["RUN"]], env)),
    }
    if smollm2:
        serve = ["--target", smollm2, "--draft", "demo/smollm2-eagle3", "--dtype", "fp32", "--max-batch", "8"]
        serve += ["--max-len", "1024"]
        shown = " ".join(serve).replace(smollm2, command.shown_path(smollm2))
        out["serve_smollm2"] = ("infer.serve " + shown, lambda env: _first_completion(serve, env))
    return out


def report(rows: dict[str, dict]) -> str:
    lines = [
        "| command | first start (s) | second start (s) | second / first | compile work (s) | warm-up (s) |",
        "|---|---|---|---|---|---|",
    ]
    pair = lambda r, k: f"{r['first_' + k]:.1f} / {r['second_' + k]:.1f} ({r['second_' + k] / r['first_' + k]:.0%})"  # noqa: E731
    for r in rows.values():
        warm = pair(r, "warm_up_s") if "first_warm_up_s" in r else "-"
        lines.append(
            f"| `{r['command']}` | {r['first_s']:.1f} | {r['second_s']:.1f} | {r['second_s'] / r['first_s']:.0%} "
            f"| {pair(r, 'compile_s')} | {warm} |"
        )
    return "\n".join(lines)


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="instruments.startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--smollm2", default=None, help="SmolLM2-135M-Instruct's folder (`python -m cli.smollm2`)")
    p.add_argument(
        "--only", default=None, help="comma-separated names: chat, serve_demo, serve_smollm2, benchmark, train"
    )
    p.add_argument("--json", default=None, help="write the figures here (and Markdown next to it)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        todo = commands(a.smollm2)
        if a.only:
            unknown = set(a.only.split(",")) - set(todo)
            if unknown:
                raise EagleError(f"--only: unknown {', '.join(sorted(unknown))}; choose from {', '.join(todo)}")
            todo = {k: v for k, v in todo.items() if k in a.only.split(",")}
        rows = {}
        for name, (shown, run) in tqdm(todo.items(), desc="commands", file=sys.stderr):
            cache = Path(tmp) / name
            env = os.environ | {"EAGLE_JAX_CACHE": str(cache), "JAX_LOG_COMPILES": "1"}
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            row = {"command": shown}
            for start in ("first", "second"):
                got = run(env | {"RUN": str(cache / f"run_{start}")})
                row |= {f"{start}_{k}": v for k, v in got.items()}
            rows[name] = row
    print(report(rows))
    if a.json:
        files.write_json_atomic(a.json, {"commands": rows})
        files.write_text_atomic(Path(a.json).with_suffix(".md"), report(rows) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

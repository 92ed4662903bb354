"""Regenerate the assistant turns of a conversation dataset with the target itself.

    python -m train.regenerate --target DIR --data FILE [FILE...] --out FILE.jsonl [--max-new-tokens N]
        [--batch-size B] [--limit N] [--temperature T] [--top-p P] [--top-k K] [--seed S]

Each assistant turn is replaced by the target's own answer to the conversation so far (user turns
kept, earlier assistant turns already regenerated), since EAGLE-3 heads gain from learning the
target's own distribution. Conversations are processed in chunks, turn by turn, with the prompts
of a turn batched; the output is ShareGPT-format JSON Lines, appended chunk by chunk, so a rerun
with the same --out continues after the conversations already written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import jax
from tqdm import tqdm

from cli import command
from eagle_jax.decoding.plain import generate
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.errors import EagleError
from eagle_jax.models import target
from eagle_jax.parallel import sharding
from eagle_jax.training import data
from train import eagle3

SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = command.ArgumentParser(prog="python -m train.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target: Hugging Face directory or eagle-jax store")
    p.add_argument("--data", required=True, nargs="+", help="ShareGPT / UltraChat files")
    p.add_argument("--out", required=True, help="output JSONL (ShareGPT format); an existing file is continued")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per assistant turn")
    p.add_argument("--max-length", type=int, default=2048, help="a conversation stops before a turn whose prompt + answer would exceed this")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation call")
    p.add_argument("--limit", type=int, default=None, help="only the first N usable conversations")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T to shard the target (default: one device)")
    p.add_argument("--chat-template", default=None, help="jinja chat template file (if the tokenizer has none)")
    a = p.parse_args(argv)
    for name in ("max_new_tokens", "max_length", "batch_size"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.limit is not None and a.limit < 0:
        raise EagleError(f"--limit must be >= 0, got {a.limit}")
    return a


def prompt_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """The conversation so far, templated with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate_chunk(params, cfg, tokenizer, convs: list[list[dict[str, str]]], a: argparse.Namespace,
                     sampling: SamplingConfig, seed: int) -> tuple[list[list[dict[str, str]]], dict[str, int]]:
    """Regenerate every assistant turn of `convs`, one turn index at a time -> (new conversations, counts).

    A conversation stops before a turn whose prompt + --max-new-tokens exceeds --max-length; those
    left without an assistant turn come back empty.
    """
    done: list[list[dict[str, str]]] = [[] for _ in convs]
    live = list(range(len(convs)))
    counts = {"answers": 0, "cut_at_max_new_tokens": 0, "stopped_at_max_length": 0}
    turn = 0
    while live:
        prompts, rows = [], []
        for c in live:
            turns, i = convs[c], len(done[c])
            while i < len(turns) and turns[i]["role"] != "assistant":  # system / user turns are kept
                done[c].append(turns[i])
                i += 1
            if i == len(turns):
                continue
            ids = prompt_ids(tokenizer, done[c])
            if len(ids) + a.max_new_tokens > a.max_length:
                counts["stopped_at_max_length"] += 1
                continue
            prompts.append(ids)
            rows.append(c)
        order = sorted(range(len(prompts)), key=lambda r: len(prompts[r]))  # similar lengths share a bucket
        for n, s in enumerate(range(0, len(order), a.batch_size)):
            part = order[s : s + a.batch_size]
            result = generate(params, cfg, [prompts[r] for r in part], a.max_new_tokens, sampling,
                              seed=seed + 1009 * turn + n)
            for r, tokens, reason in zip(part, result.tokens, result.stop_reasons):
                if reason == "eos":
                    tokens = tokens[:-1]
                else:
                    counts["cut_at_max_new_tokens"] += 1
                text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
                done[rows[r]].append({"role": "assistant", "content": text})
                counts["answers"] += 1
        live = rows
        turn += 1
    for conv in done:
        while conv and conv[-1]["role"] != "assistant":
            conv.pop()
        if not any(m["role"] == "assistant" for m in conv):
            conv.clear()
    return done, counts


def to_sharegpt(turns: list[dict[str, str]], ident: str) -> dict:
    return {"id": ident, "conversations": [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in turns]}


def count_lines(path: Path) -> int:
    """Complete JSON lines already written (a cut-off last line is removed)."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    good = []
    for line in lines:
        try:
            json.loads(line)
        except json.JSONDecodeError:
            break
        if not line.endswith("\n"):
            break
        good.append(line)
    if len(good) != len(lines):
        path.write_text("".join(good))
    return len(good)


def run(a: argparse.Namespace) -> dict[str, int]:
    out = Path(a.out)
    cfg = eagle3.target_config(a.target)
    tokenizer = eagle3.target_tokenizer(a.target, a.chat_template)
    sampling = SamplingConfig(a.temperature, a.top_p, a.top_k)
    mesh = sharding.make_mesh(a.mesh) if a.mesh else sharding.make_mesh(None, jax.devices()[:1])
    shardings = sharding.param_shardings(target.param_specs(cfg), mesh, sharding.rules_for(cfg.num_kv_heads, mesh))

    convs: list[tuple[str, list[dict[str, str]]]] = []
    for where, turns, _ in data.iter_conversations(a.data):
        if turns is not None:
            convs.append((where, turns))
            if a.limit is not None and len(convs) == a.limit:
                break
    params = eagle3.target_params(a.target, None, shardings, mesh)
    out.parent.mkdir(parents=True, exist_ok=True)
    skip = count_lines(out)
    if skip:
        print(f"{out}: continuing after {skip} conversations already written", file=sys.stderr)
    chunk = a.batch_size * 8
    totals = {"conversations": 0}
    with tqdm(total=len(convs), initial=skip, desc="regenerate", unit="conv") as bar:
        for start in range(skip, len(convs), chunk):
            part = convs[start : start + chunk]
            new, counts = regenerate_chunk(params, cfg, tokenizer, [t for _, t in part], a, sampling, a.seed + start)
            with out.open("a") as f:
                for (where, _), turns in zip(part, new):
                    f.write(json.dumps(to_sharegpt(turns, where)) + "\n")
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            totals["conversations"] += sum(bool(t) for t in new)
            bar.update(len(part))
    return totals


def _main(argv: Sequence[str] | None) -> int:
    print(json.dumps(run(parse_args(argv))), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the assistant turns of a conversation dataset with the target itself.

Each assistant turn is replaced by the target's own answer to the conversation so far (user turns
kept, earlier assistant turns already regenerated), since EAGLE-3 heads gain from learning the
target's own distribution. Conversations are processed in chunks, turn by turn, with the prompts of a
turn batched; the output is ShareGPT-format JSON Lines, appended chunk by chunk, so a rerun with the
same output continues after the conversations already written (a line cut off by a crash is dropped;
a file that is not this command's output for the same conversations is refused, never rewritten).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from jax.sharding import Mesh
from tqdm import tqdm

from eagle_jax.decoding import generation
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig, SpecResult
from eagle_jax.decoding.tree import PLAIN
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading
from eagle_jax.models.config import TargetConfig
from eagle_jax.training import data

SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}


@dataclasses.dataclass(frozen=True)
class RegenerateConfig:
    target: str  # store, HF folder or GGUF file
    data: tuple[str, ...]  # conversation files
    out: str  # output JSON Lines
    max_new_tokens: int = 512  # per assistant turn
    max_length: int = 2048  # a conversation stops before a turn whose prompt + answer would exceed this
    batch_size: int = 16  # prompts per generation call
    limit: int | None = None  # only the first N >= 1 usable conversations (None: all)
    sampling: SamplingConfig = SamplingConfig()
    seed: int = 0
    chat_template: str | None = None  # jinja file, for a tokenizer without a chat template


def _generate(
    params, cfg: TargetConfig, prompts: list[list[int]], rc: RegenerateConfig, seed: int, mesh: Mesh | None = None
) -> SpecResult:
    return generation.generate(
        params, None, prompts, rc.max_new_tokens, DecodeConfig(cfg, None, PLAIN, rc.sampling), seed=seed, mesh=mesh
    )


def prompt_ids(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """The conversation so far, templated with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def regenerate_chunk(
    params, cfg, tokenizer, convs: list[list[dict[str, str]]], rc: RegenerateConfig, seed: int, mesh: Mesh | None = None
) -> tuple[list[list[dict[str, str]]], dict[str, int]]:
    """Regenerate every assistant turn of `convs`, one turn index at a time -> (new conversations, counts).

    A conversation stops before a turn whose prompt + max_new_tokens exceeds max_length; those left
    without an assistant turn come back empty.
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
            if len(ids) + rc.max_new_tokens > rc.max_length:
                counts["stopped_at_max_length"] += 1
                continue
            prompts.append(ids)
            rows.append(c)
        order = sorted(range(len(prompts)), key=lambda r: len(prompts[r]))  # similar lengths share a bucket
        for n, s in enumerate(range(0, len(order), rc.batch_size)):
            part = order[s : s + rc.batch_size]
            result = _generate(params, cfg, [prompts[r] for r in part], rc, seed + 1009 * turn + n, mesh)
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


def _record_key(ident: object) -> tuple[str, str] | None:
    """(file name, record index) of a conversation's id `FILE: record N`; None for anything else."""
    if not isinstance(ident, str) or ": record " not in ident:
        return None
    file, index = ident.rsplit(": record ", 1)
    return Path(file).name, index


def _is_output_for(line: bytes, ident: str) -> bool:
    """Is `line` what this command writes for the conversation `ident` (same file name and record)?"""
    try:
        row = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(row, dict)
        and set(row) == {"id", "conversations"}
        and isinstance(row["conversations"], list)
        and _record_key(row["id"]) == _record_key(ident)
    )


def written_lines(path: Path, idents: list[str]) -> int:
    """How many conversations of `idents` an earlier run already wrote to `path` (0 when it is absent).

    Every complete line must be this command's output for the conversation at its position; a cut-off
    last line (a crash mid-write) that begins like one of them is removed. Anything else is refused and
    the file is left as it is.
    """
    if not path.exists():
        return 0
    raw = path.read_bytes()
    *lines, tail = raw.split(b"\n")
    for n, line in enumerate(lines):
        if n >= len(idents):
            raise EagleError(
                f"{path}: holds {len(lines)} conversations, more than the {len(idents)} that the data and limit "
                "select; use the same data and limit, or another output file",
                "out",
            )
        if not _is_output_for(line, idents[n]):
            raise EagleError(
                f"{path}: line {n + 1} is not this command's output for {idents[n]}; the file is left as "
                "it is: choose another output file (or repair or remove that line)",
                "out",
            )
    if tail:
        if len(lines) == len(idents) or not tail.startswith(b'{"id": "'):
            raise EagleError(
                f"{path}: its last line is neither complete nor the start of this command's next line; "
                "choose another output file",
                "out",
            )
        os.truncate(path, len(raw) - len(tail))  # the line a crash cut off
    return len(lines)


def regenerate(rc: RegenerateConfig, mesh: Mesh | None = None) -> dict[str, int]:
    """Regenerate (or continue regenerating) `rc.data` into `rc.out`; returns counts of what was written.

    Before the target loads, `rc.out` is checked: writable, not an input, and absent or an earlier
    output of this command for the same conversations (which is continued)."""
    if rc.limit is not None and rc.limit < 1:
        raise EagleError(f"must be >= 1, got {rc.limit}; leave it out to regenerate every conversation", "limit")
    inputs = [*rc.data, rc.target, *([rc.chat_template] if rc.chat_template else [])]
    out = files.check_output_file(rc.out, "out", inputs, ours=lambda _: True)  # recognised line by line below
    cfg = loading.target_config(rc.target)
    tokenizer = data.chat_tokenizer(rc.target, rc.chat_template)
    convs: list[tuple[str, list[dict[str, str]]]] = []
    for where, turns, _ in data.iter_conversations(rc.data):
        if turns is not None:
            convs.append((where, turns))
            if rc.limit is not None and len(convs) == rc.limit:
                break
    skip = written_lines(out, [where for where, _ in convs])
    params = loading.load_target(rc.target, mesh=mesh, progress=True)[1]
    if skip:
        print(f"{out}: continuing after {skip} conversations already written", file=sys.stderr)
    chunk = rc.batch_size * 8
    totals = {"conversations": 0}
    with tqdm(total=len(convs), initial=skip, desc="regenerate", unit="conv") as bar:
        for start in range(skip, len(convs), chunk):
            part = convs[start : start + chunk]
            new, counts = regenerate_chunk(params, cfg, tokenizer, [t for _, t in part], rc, rc.seed + start, mesh)
            with out.open("a") as f:
                for (where, _), turns in zip(part, new):
                    f.write(json.dumps(to_sharegpt(turns, where)) + "\n")
            for k, v in counts.items():
                totals[k] = totals.get(k, 0) + v
            totals["conversations"] += sum(bool(t) for t in new)
            bar.update(len(part))
    return totals

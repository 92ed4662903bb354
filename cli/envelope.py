"""The draft-tree envelope the commands use when the user names none: measured, per batch size, for this machine.

A head folder may ship `budget.json` (an `eagle_jax.decoding.budget.Budget` measured by
`python -m infer.benchmark --auto-budget ... --save-budget DIR/budget.json`); it is used when it was
measured on the same kind of device. Otherwise the envelopes are timed here on MT-bench first turns
(about a minute for small models) and the result is cached under $EAGLE_JAX_CACHE (default
~/.cache/eagle-jax), keyed by the models and the device.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from cli import demo
from eagle_jax.decoding import budget
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.errors import EagleError
from eagle_jax.io import files

BUDGET_FILE = "budget.json"
QUESTIONS = demo.REPO / "data" / "eval" / "mt_bench.jsonl"
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 64


cache_dir = demo.cache_dir


def calibration_prompts(tokenizer, n: int = CALIBRATION_PROMPTS) -> list[list[int]]:
    """The first turns of the first n MT-bench questions, as chat prompts of `tokenizer`."""
    questions = [json.loads(line) for line in QUESTIONS.read_text().splitlines()[:n]]
    prompts = []
    for q in questions:
        messages = [{"role": "user", "content": q["turns"][0]}]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            prompts.append(tokenizer(q["turns"][0])["input_ids"])
    return prompts


def _read(path: Path) -> budget.Budget | None:
    """The budget at `path` if it exists and was measured on this kind of device."""
    if not path.is_file():
        return None
    found = budget.Budget.from_json(files.read_json(path))
    return found if found.device == budget.device_kind() else None


def _cache_key(models, paths: tuple[Path, Path | None]) -> str:
    tcfg, _, dcfg, _ = models
    head = str(paths[1].absolute()) if paths[1] is not None else "context"
    text = repr((str(paths[0].absolute()), head, tcfg, dcfg, budget.device_kind()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def default_tree(
    models,
    paths: tuple[Path, Path | None],
    batch: int,
    calibration: Callable[[], list[list[int]]],
    recalibrate: bool = False,
    log: Callable[[str], None] = print,
    measure: bool = True,
) -> budget.Envelope:
    """The envelope for `batch` rows (`PLAIN`: plain decoding wins here), from the head's budget.json, the cache,
    or measured now on the prompts `calibration()` returns and cached (unless not `measure`). models: (tcfg, tparams,
    dcfg, dparams); paths: (target, draft; None without a head, whose budget lives in the cache only)."""
    cached = cache_dir() / "budget" / f"{_cache_key(models, paths)}.json"
    shipped = () if paths[1] is None else (Path(paths[1]) / BUDGET_FILE,)
    for path in () if recalibrate else (*shipped, cached):
        found = _read(path)
        if found is not None and batch in found.choices:
            return found.choices[batch]
    if not measure:
        where = shipped[0] if shipped else cached
        raise EagleError(
            f"no measured draft-tree envelope for batch {batch} in {' or '.join(map(str, (*shipped, cached)))}; "
            f"measure one on a single host (python -m infer.benchmark --auto-budget --save-budget "
            f"{where} --budget-batches {batch}) or decode plainly"
        )
    log(f"measuring draft-tree envelopes for batch {batch} on this machine (once; cached in {cached.parent})")
    tcfg, tparams, dcfg, dparams = models
    measured = budget.calibrate(
        tparams, dparams, DecodeConfig(tcfg, dcfg), calibration(), [batch], CALIBRATION_TOKENS, log=log
    )
    previous = _read(cached)
    merged = budget.Budget(
        measured.device,
        {**(previous.choices if previous else {}), **measured.choices},
        {**(previous.measured if previous else {}), **measured.measured},
    )
    cached.parent.mkdir(parents=True, exist_ok=True)
    files.write_json_atomic(cached, merged.to_json())
    return measured.choices[batch]

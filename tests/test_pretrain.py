"""train.pretrain on a tiny model: it learns, saves a loadable target, and, run by the one training loop, stops on
Ctrl-C and resumes to the same model as an uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
from tiny import plain_generate

from eagle_jax.io import hf
from eagle_jax.training import loop, pretrain
from eagle_jax.training.pretrain import PretrainConfig

DEMO = Path(__file__).resolve().parent.parent / "demo"


def test_pretrain_learns_saves_and_repeats(tmp_path):
    rng = np.random.default_rng(0)
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "mat",
        "and",
        "the",
        "dog",
        "ran",
        "to",
        "the",
        "park",
        "with",
        "a",
        "red",
        "ball",
    ]
    records = [
        {
            "conversations": [
                {"from": "human", "value": " ".join(rng.choice(words, 6))},
                {"from": "gpt", "value": " ".join(words) + " " + " ".join(words[: int(rng.integers(4, 12))])},
            ]
        }
        for _ in range(60)
    ]
    (tmp_path / "chats.json").write_text(json.dumps(records))
    pc = PretrainConfig(
        tokenizer=str(DEMO / "target"),
        out=str(tmp_path / "a"),
        data=str(tmp_path / "chats.json"),
        hidden=32,
        layers=2,
        heads=2,
        kv_heads=2,
        intermediate=64,
        seq_len=32,
        batch=4,
        lr=1e-2,
        steps=60,
    )
    log = pretrain.pretrain(pc)
    assert log["steps"] == 60 and log["tokens"] == 60 * 4 * 32
    assert log["final_loss"] < 0.5 * math.log(4096), log["final_loss"]  # a uniform guess costs ln(vocab)
    cfg, params = hf.load_target(tmp_path / "a")
    assert cfg.num_layers == 2 and cfg.hidden_size == 32
    assert json.loads((tmp_path / "a" / "training_log.json").read_text())["steps"] == 60
    assert len(plain_generate(params, cfg, [[1, 5, 9]], 4).tokens[0]) == 4
    assert (tmp_path / "a.run" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Ctrl-C at step 25 (SIGINT handled as in a terminal): a checkpoint and the model of step 25, then the same
    # settings continue to the model and losses of the uninterrupted run (same seed: same batches)
    stopped = dataclasses.replace(pc, out=str(tmp_path / "b"))
    feed = pretrain.Feed.__call__

    def interrupted(self, index: int):
        if index == 24:
            signal.raise_signal(signal.SIGINT)
        return feed(self, index)

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pretrain.Feed, "__call__", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pretrain.pretrain(stopped)
    finally:
        signal.signal(signal.SIGINT, before)
    assert json.loads((tmp_path / "b" / "training_log.json").read_text())["steps"] == 25
    assert sorted(p.name for p in (tmp_path / "b.run" / "ckpt").iterdir() if p.name.isdigit()) == ["25"]
    again = pretrain.pretrain(stopped)
    assert again["steps"] == 60 and again["final_loss"] == log["final_loss"]
    timing = ("seconds", "tokens_per_s")  # the only fields that may differ
    rows = [loop.read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("a.run", "b.run")]
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows[1]] == [
        {k: v for k, v in r.items() if k not in timing} for r in rows[0]
    ]
    assert (tmp_path / "b" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()

"""train.pretrain's loop on a tiny model: it learns, saves a loadable target, and repeats itself from a seed."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from tiny import plain_generate

from eagle_jax.io import hf
from eagle_jax.training.pretrain import PretrainConfig, pretrain

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
    log = pretrain(pc)
    assert log["steps"] == 60 and log["tokens"] == 60 * 4 * 32
    assert log["final_loss"] < 0.5 * math.log(4096), log["final_loss"]  # a uniform guess costs ln(vocab)
    again = pretrain(dataclasses.replace(pc, out=str(tmp_path / "b")))
    assert again["final_loss"] == log["final_loss"]  # same seed: same batches, same trajectory
    cfg, params = hf.load_target(tmp_path / "a")
    assert cfg.num_layers == 2 and cfg.hidden_size == 32
    assert json.loads((tmp_path / "a" / "training_log.json").read_text())["steps"] == 60
    assert len(plain_generate(params, cfg, [[1, 5, 9]], 4).tokens[0]) == 4

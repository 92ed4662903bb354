"""Conversation fixtures for data and training tests: a chat template for the golden tokenizer and
conversations whose answers follow the golden target's own next-token distribution."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.models import target

# Role header tokens t3 (user) / t4 (assistant) / t5 (system), end of turn t6; bos <s>.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}t3 {% elif m['role'] == 'assistant' %}t4 "
    "{% else %}t5 {% endif %}{{ m['content'] }} t6 {% endfor %}{% if add_generation_prompt %}t4 {% endif %}"
)
ASSISTANT_HEADER = 4  # id of t4


def templated_tokenizer_dir(golden: Path, dest: Path, template: str = TEMPLATE) -> Path:
    """A copy of the golden WordLevel tokenizer with a chat template."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(golden / "target" / name, dest / name)
    config = json.loads((golden / "target" / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def templated_target_dir(golden: Path, dest: Path) -> Path:
    """The golden target (weights linked) with the templated tokenizer: a `--target` for the CLIs."""
    templated_tokenizer_dir(golden, dest)
    for src in (golden / "target").iterdir():
        if not (dest / src.name).exists():
            (dest / src.name).symlink_to(src.absolute())
    return dest


def next_token_table(tcfg, tparams) -> np.ndarray:
    """[V, V] target next-token probabilities after (BOS, v): the golden target is a first-order chain."""
    v = tcfg.vocab_size
    tokens = jnp.stack([jnp.full((v,), 1, jnp.int32), jnp.arange(v, dtype=jnp.int32)], axis=1)
    out = target.forward(tparams, tcfg, tokens, jnp.broadcast_to(jnp.arange(2), (v, 2)), target.init_cache(tcfg, v, 2))
    return np.asarray(jax.nn.softmax(out.logits[:, 1], axis=-1), np.float64)


def chain_conversations(table: np.ndarray, n: int, answer_len: int, seed: int, greedy: bool = False) -> list[dict]:
    """ShareGPT records: 4 random user tokens, then an answer sampled from the target after the assistant
    header; greedy: the target's argmax chain from a random token (like the golden heads' training data)."""
    rng = np.random.default_rng(seed)
    cum = np.cumsum(table, axis=1)
    records = []
    for i in range(n):
        user = rng.integers(7, table.shape[0], 4)
        answer, tok = [], int(rng.integers(7, table.shape[0])) if greedy else ASSISTANT_HEADER
        for _ in range(answer_len):
            if greedy:
                tok = int(np.argmax(table[tok]))
            else:
                tok = int(min(np.searchsorted(cum[tok], rng.random() * cum[tok, -1]), table.shape[0] - 1))
            answer.append(tok)
        records.append(
            {
                "id": str(i),
                "conversations": [
                    {"from": "human", "value": " ".join(f"t{t}" for t in user)},
                    {"from": "gpt", "value": " ".join(f"t{t}" for t in answer)},
                ],
            }
        )
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path

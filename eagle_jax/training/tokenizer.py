"""The demo's byte-level BPE tokenizer: trained on conversations, saved in Hugging Face format.

The chat template renders `<|role|>\ncontent<|end|>\n` per message; `<|end|>` is the end-of-turn
token and the eos.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from eagle_jax.errors import EagleError

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


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
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
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
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS, "additional_special_tokens": SPECIAL_TOKENS[3:]},
            indent=2,
        )
        + "\n"
    )
    (out / "chat_template.jinja").unlink(missing_ok=True)


def check_round_trip(folder: str | Path) -> str:
    """Load the saved tokenizer back and check that its chat template and encoding round-trip; a summary line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    msgs = [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi, how can I help?"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if text != render(msgs) or tok.decode(ids) != text:
        raise EagleError(f"{folder}: the saved tokenizer does not round-trip its chat template")
    return f"vocab {len(tok)}, eos {tok.eos_token}={tok.eos_token_id}; sample {len(ids)} tokens"

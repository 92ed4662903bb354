"""Structured output: greedy answers under a grammar are the target's masked argmax, speculation changes none of
them, sampled answers keep the target's law restricted to the grammar, JSON answers validate, bad constraints are
refused by name. On the demo pair (its tokenizer: llguidance needs one)."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from test_engine import _draft_test, _rank_test

from eagle_jax.decoding import grammar
from eagle_jax.decoding.engine import Engine
from eagle_jax.decoding.sampling import SamplingConfig, processed_probs
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree, NoDraft, StaticTree
from eagle_jax.io import loading
from eagle_jax.models import draft, target

DEMO = Path(__file__).resolve().parents[1] / "demo"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
    "required": ["name", "age", "tags", "home"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": grammar.Constraint.json_schema(SCHEMA),
    "json_object": grammar.Constraint.json_object(),
    "regex": grammar.Constraint.regex(r"(the|a) [a-z]+( [a-z]+){0,6}\."),
    "choice": grammar.Constraint.choice(["yes please", "no thanks", "maybe later"]),
}
ENVELOPES = {
    "dynamic": DynamicTree(16, 4, 4),
    "dynamic+context": DynamicTree(12, 3, 3, context=6),
    "context": NoDraft(context=7),
    "static": StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
}
CAPACITY = 128
PROMPTS = ["Describe a person as JSON:", "Write one sentence about the sea.", "Do you want tea?"]


@pytest.fixture(scope="module")
def demo():
    tcfg, tparams = loading.load_target(DEMO / "target", np.float32)
    dcfg, dparams = loading.load_draft(DEMO / "eagle3", tcfg, dtype=np.float32)
    tok = loading.load_tokenizer(DEMO / "target")
    return tcfg, tparams, dcfg, dparams, tok, grammar.Grammars(tok, tcfg.vocab_size, tcfg.eos_token_ids)


def _answers(demo, tree, rows, max_tokens=48) -> list[tuple[list[int], str]]:
    """rows: (prompt ids, constraint or None) -> per row (tokens, finish), greedy, together on one engine."""
    tcfg, tparams, dcfg, dparams, _, grammars = demo
    engine = Engine(tparams, dparams, DecodeConfig(tcfg, dcfg, tree), len(rows), CAPACITY)
    out = {}
    for slot, (prompt, constraint) in enumerate(rows):
        engine.admit(slot, prompt, max_tokens, owner=slot, grammar=grammars.matcher(constraint) if constraint else None)
        out[slot] = ([], None)
    while engine.live:
        for step in engine.cycle():
            out[step.owner] = (out[step.owner][0] + step.tokens, step.finish)
    _last_accepts[:] = engine.accept_lengths(0)
    return [out[s] for s in range(len(rows))]


_last_accepts: list[int] = []  # the first row's accept lengths in the last `_answers`


def _masked_reference(demo, prompt, constraint, max_tokens=48) -> list[int]:
    """Greedy decoding written out: the target's full forward over the answer so far, argmax over the tokens the
    grammar allows (its own matcher, advanced token by token)."""
    tcfg, tparams, *_, grammars = demo
    matcher, seq, width = grammars.matcher(constraint), list(prompt), len(prompt) + max_tokens
    for _ in range(max_tokens):
        ids = jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32)  # one shape: one program (causal)
        out = target.forward(tparams, tcfg, ids, jnp.arange(width)[None], target.init_cache(tcfg, 1, width))
        logits = np.asarray(out.logits[0, len(seq) - 1], np.float64)
        allowed = np.asarray(grammar.allowed(jnp.asarray(matcher.mask()), tcfg.vocab_size))
        token = int(np.argmax(np.where(allowed, logits, -np.inf)))
        seq.append(token)
        if token in tcfg.eos_token_ids:
            break
        matcher.advance([token])
    return seq[len(prompt) :]


def _ids(demo, text: str) -> list[int]:
    return demo[4].encode(text)


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_constrained_plain_is_the_masked_argmax(demo, name):
    prompt = _ids(demo, PROMPTS[sorted(CONSTRAINTS).index(name) % len(PROMPTS)])
    [(tokens, finish)] = _answers(demo, PLAIN, [(prompt, CONSTRAINTS[name])])
    assert tokens == _masked_reference(demo, prompt, CONSTRAINTS[name])
    assert finish == ("stop" if tokens[-1] in demo[0].eos_token_ids else "length")


@pytest.mark.parametrize("envelope", sorted(ENVELOPES))
def test_constrained_speculation_equals_constrained_plain(demo, envelope):
    """Every constraint, and a row with none, greedy in one batch: speculative tokens equal plain ones."""
    rows = [(_ids(demo, PROMPTS[i % len(PROMPTS)]), c) for i, c in enumerate([*CONSTRAINTS.values(), None])]
    spec = _answers(demo, ENVELOPES[envelope], rows)
    plain = _answers(demo, PLAIN, rows)
    assert spec == plain
    assert sum(f == "stop" for _, f in plain) >= 3  # answers that end by their grammar


def test_forced_chains_are_drafted_and_accepted(demo):
    """With context candidates, the grammar's forced text (a schema's keys) is drafted: a schema answer takes
    several tokens in some cycles even without a head."""
    tcfg, tparams, _, _, _, grammars = demo
    engine = Engine(tparams, None, DecodeConfig(tcfg, None, NoDraft(context=7)), 1, CAPACITY)
    engine.admit(0, _ids(demo, PROMPTS[0]), 48, grammar=grammars.matcher(CONSTRAINTS["schema"]))
    while engine.live:
        engine.cycle()
    assert max(engine.accept_lengths(0)) >= 3


def test_forced_text_is_drafted_as_the_tokenizer_spells_it(demo):
    """The forced chain runs past the point where the grammar's own forced tokens stop (a key's `":"`, which more
    than one split of the text could spell), and falls back to those tokens when the spelling is not allowed."""
    tok, grammars = demo[4], demo[5]
    keys = grammar.Constraint.json_schema(
        {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
         "required": ["name", "age"], "additionalProperties": False}
    )  # fmt: skip
    m = grammars.matcher(keys)
    assert tok.decode(m.forced(8)) == '{"name":"' and tok.decode(m.m.compute_ff_tokens()) == '{"name'
    assert len(m.forced(2)) == 2
    m.advance(m.forced(8) + tok.encode('Bo"', add_special_tokens=False))
    assert tok.decode(m.forced(8)) == ',"age":'
    spaced = grammars.matcher(keys)
    spaced.encode = lambda text: tok.encode(" " + text, add_special_tokens=False)  # a prefixed space: not allowed
    assert tok.decode(spaced.forced(8)) == '{"name'


def test_the_forced_text_after_the_heads_path_is_grafted(demo, monkeypatch):
    """`path_chain`: the head's likeliest path as far as the grammar allows it, then the text forced after it (the
    matcher left as it was); in an engine those chains are verified in cycles whose root forced nothing, and the
    answer (the same tokens) takes fewer cycles than without them."""
    tok, grammars = demo[4], demo[5]
    m = grammars.matcher(CONSTRAINTS["schema"])
    m.advance(m.forced(8))  # inside the name's string
    b, ob, end, x = (tok.convert_tokens_to_ids(t) for t in ("B", "ob", '",', "X"))
    tokens, parents = np.array([0, b, x, ob, end]), np.array([0, 0, 0, 1, 3])  # the first path: B ob ",
    before = m.mask()
    chain = m.path_chain(tokens, parents, 5, 8)
    assert chain[:3] == [b, ob, end] and tok.decode(chain) == 'Bob","age":'
    assert (m.mask() == before).all() and m.forced(8) == []  # rolled back
    assert m.path_chain(tokens, parents, 4, 8) == []  # a path ending inside the string forces nothing
    assert m.path_chain(np.array([0, b, tok.eos_token_id]), np.array([0, 0, 1]), 3, 8) == []  # an eos ends it
    rows = [(_ids(demo, PROMPTS[0]), CONSTRAINTS["schema"])]
    grafted = _answers(demo, ENVELOPES["dynamic+context"], rows, 64)
    cycles = len(_last_accepts)
    monkeypatch.setattr(grammar.Matcher, "path_chain", lambda *a: [])
    assert _answers(demo, ENVELOPES["dynamic+context"], rows, 64) == grafted
    assert cycles < len(_last_accepts), (cycles, len(_last_accepts))


@pytest.mark.parametrize("tree", [ENVELOPES["dynamic+context"], PLAIN], ids=["dynamic+context", "plain"])
def test_a_structured_engines_warm_up_compiles_what_constrained_answers_run(demo, compiles, tree):
    """With `structured`, the warm-up compiles the programs of rows that follow grammars (masked extends; the masked
    plain step, or draft, regraft and verify) at every span: constrained answers beside a free one, crossing from
    the first span into the second, compile nothing."""
    tcfg, tparams, dcfg, dparams, _, grammars = demo
    engine = Engine(tparams, dparams, DecodeConfig(tcfg, dcfg, tree), 2, 256, structured=True)
    engine.warm_up()
    warm = len(compiles)
    long = _ids(demo, " ".join(PROMPTS * 6))[:100] + _ids(demo, PROMPTS[0])
    for constraint in ("schema", "regex"):
        engine.admit(0, long, 40, grammar=grammars.matcher(CONSTRAINTS[constraint]))
        engine.admit(1, _ids(demo, PROMPTS[1]), 40)
        while engine.live:
            engine.cycle()
    assert len(compiles) == warm, compiles[warm:]


def test_json_answers_validate(demo):
    """Schema answers end by stop, parse and validate (json_object answers are objects where they end)."""
    tok = demo[4]
    rows = [(_ids(demo, p), CONSTRAINTS[c]) for p, c in zip(PROMPTS, ("schema", "json_object", "schema"))]
    for (tokens, finish), (_, constraint) in zip(_answers(demo, DynamicTree(16, 4, 4), rows, 96), rows):
        if constraint.kind == "json_schema":
            assert finish == "stop", tok.decode(tokens)
            jsonschema.validate(json.loads(tok.decode(tokens[:-1])), SCHEMA)
        elif finish == "stop":
            assert isinstance(json.loads(tok.decode(tokens[:-1])), dict)


def test_a_grammar_that_cannot_finish_ends_by_length(demo):
    [(tokens, finish)] = _answers(demo, DynamicTree(16, 4, 4), [(_ids(demo, "Hi"), CONSTRAINTS["schema"])], 5)
    assert finish == "length" and len(tokens) == 5


@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: grammar.Constraint.json_schema({"type": "strin"}), "strin"),
        (lambda: grammar.Constraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (lambda: grammar.Constraint.json_schema({"type": "string", "format": "weird"}), "weird"),
        (lambda: grammar.Constraint.json_schema([1]), "must be an object"),
        (lambda: grammar.Constraint.regex("a(b"), "a(b"),
        (lambda: grammar.Constraint.choice([]), "non-empty"),
        (lambda: grammar.Constraint.grammar("start: foo"), "foo"),
    ],
)
def test_bad_constraints_are_refused_by_name(demo, make, words):
    with pytest.raises(grammar.GrammarError, match=words.replace("(", r"\(")):
        demo[5].check(make())


def test_compiled_grammars_are_cached(demo):
    grammars = demo[5]
    c = grammar.Constraint.json_schema({"type": "object", "properties": {"zz": {"type": "integer"}}})
    grammars.check(c)
    before = grammars._compiled.cache_info().hits
    grammars.matcher(grammar.Constraint.json_schema({"type": "object", "properties": {"zz": {"type": "integer"}}}))
    assert grammars._compiled.cache_info().hits == before + 1


SAMPLED = grammar.Constraint.regex(r"(the [a-z]{2,6} ){30}")  # forced words; it cannot end within NEW tokens
SLOTS, BATCHES, NEW = 64, 3, 8


def _constrained_laws(demo, prompt, tokens: np.ndarray, sc: SamplingConfig) -> np.ndarray:
    """laws[r, i]: the target's processed law of token i of row r, restricted to the grammar after the tokens
    before it and renormalised [R, n, V]."""
    tcfg, tparams, *_, grammars = demo
    seqs = np.asarray([list(prompt) + list(t) for t in tokens], np.int32)
    width = seqs.shape[1]
    out = target.forward(
        tparams, tcfg, jnp.asarray(seqs), jnp.broadcast_to(jnp.arange(width), seqs.shape),
        target.init_cache(tcfg, len(seqs), width),
    )  # fmt: skip
    logits = np.asarray(out.logits[:, len(prompt) - 1 : len(prompt) - 1 + tokens.shape[1]], np.float32)
    masks = np.zeros((*tokens.shape, (tcfg.vocab_size + 31) // 32), np.int32)
    for r, row in enumerate(tokens):
        m = grammars.matcher(SAMPLED)
        for i, t in enumerate(row):
            masks[r, i] = m.mask()
            m.advance([int(t)])
    restricted = grammar.restrict(jnp.asarray(logits), jnp.asarray(masks))
    return np.asarray(processed_probs(restricted, sc), np.float64)


def _constrained_sample(demo, prompt, sc: SamplingConfig, monkeypatch):
    """(tokens [R, NEW], per cycle (tree tokens [R, N], parents [R, N], tokens emitted before [R])) of
    SLOTS * BATCHES rows sampled under SAMPLED, the trees as the engine masked them."""
    tcfg, tparams, dcfg, dparams, _, grammars = demo
    tree = DynamicTree(8, 3, 3, context=3)
    engine = Engine(tparams, dparams, DecodeConfig(tcfg, dcfg, tree, sc), SLOTS, 64)
    seen, masks = [], grammar.Matcher.tree_masks
    monkeypatch.setattr(grammar.Matcher, "tree_masks", lambda m, t, p: seen.append((m, t, p)) or masks(m, t, p))
    total, width = SLOTS * BATCHES, tree.num_nodes
    tokens, cycles = [[] for _ in range(total)], []
    for batch in range(BATCHES):
        row_of = {}
        for slot in range(SLOTS):
            r = batch * SLOTS + slot
            row_of[id(m := grammars.matcher(SAMPLED))] = r
            engine.admit(slot, prompt, NEW, seed=batch, owner=r, grammar=m)
        while engine.live:
            seen.clear()
            before = np.asarray([len(t) for t in tokens])
            steps = engine.cycle()
            tree_tokens, parents = np.full((total, width), -1, np.int32), np.zeros((total, width), np.int32)
            for m, t, p in seen:
                tree_tokens[row_of[id(m)]], parents[row_of[id(m)]] = t, p
            cycles.append((tree_tokens, parents, before))
            for step in steps:
                tokens[step.owner] += step.tokens
    return np.asarray(tokens), cycles


def test_constrained_sampling_keeps_the_restricted_law(demo, monkeypatch):
    """192 rows of 8 tokens sampled under a regex with forced words, a dynamic tree and forced chains as context
    candidates: every token follows the target's law restricted to the grammar (`_rank_test`) and drafts are
    accepted as often as that law says (`_draft_test`); the same tokens reject the law at temperature 0.7 (the
    control)."""
    sc, prompt = SamplingConfig(1.0), _ids(demo, PROMPTS[1])
    tokens, cycles = _constrained_sample(demo, prompt, sc, monkeypatch)
    assert tokens.shape == (SLOTS * BATCHES, NEW)
    laws = _constrained_laws(demo, prompt, tokens, sc)
    p_rank, p_draft = _rank_test(laws, tokens), _draft_test(laws, tokens, cycles)
    p_control = _rank_test(_constrained_laws(demo, prompt, tokens, SamplingConfig(0.7)), tokens)
    assert p_rank > 1e-3 and p_draft > 1e-3 and p_control < 1e-5, (p_rank, p_draft, p_control)


def _generate_cli(args: list[str], capsys) -> tuple[int, str, str]:
    from infer import generate as cli_generate

    code = cli_generate.main(["--target", str(DEMO / "target"), "--draft", str(DEMO / "eagle3"), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_follows_a_json_schema_file(tmp_path, capsys):
    """infer.generate --json-schema FILE --compare: the speculative answer equals the plain one and validates."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "out.json"
    args = ["--prompt", PROMPTS[0], "--json-schema", str(schema), "--max-new-tokens", "96", "--dtype", "fp32"]
    code, stdout, err = _generate_cli([*args, "--context", "6", "--compare", "--json", str(out)], capsys)
    assert code == 0, err
    doc = json.loads(out.read_text())
    assert doc["compare"]["identical"] and doc["rows"][0]["stop_reason"] == "eos"
    jsonschema.validate(json.loads(stdout.strip().splitlines()[0]), SCHEMA)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--regex", "a(b"], "--regex: invalid regex"),
        (["--choice", "a,b", "--regex", "a"], "only one of --json-schema, --regex, --choice"),
        (["--json-schema", "/no/such/file.json"], "--json-schema: /no/such/file.json"),
    ],
)
def test_generate_refuses_bad_constraints_in_one_line(args, expected, capsys):
    code, _, err = _generate_cli(["--prompt", "hi", *args], capsys)
    assert code != 0 and expected in err and len(err.strip().splitlines()) == 1, err


def test_the_heads_first_level_drafts_only_allowed_tokens(demo, monkeypatch):
    """Every first-level head node is a token the grammar allows after the root, wherever the head's draft
    vocabulary holds at least top_k of them."""
    tcfg, tparams, dcfg, dparams, _, grammars = demo
    tree = DynamicTree(16, 4, 4)
    trees, masks = [], grammar.Matcher.tree_masks

    def recorded(m, tokens, parents):
        trees.append((tokens, parents, out := masks(m, tokens, parents)))
        return out

    monkeypatch.setattr(grammar.Matcher, "tree_masks", recorded)
    engine = Engine(tparams, dparams, DecodeConfig(tcfg, dcfg, tree), 1, CAPACITY)
    for prompt, name in ((PROMPTS[0], "schema"), (PROMPTS[1], "regex"), (PROMPTS[2], "json_object")):
        engine.admit(0, _ids(demo, prompt), 48, grammar=grammars.matcher(CONSTRAINTS[name]))
        while engine.live:
            engine.cycle()
    draft_targets = np.asarray(draft.to_target_ids(dparams, dcfg, jnp.arange(dcfg.draft_vocab_size)))
    checked = 0
    for tokens, parents, node_masks in trees:
        ok = np.asarray(grammar.allowed(jnp.asarray(node_masks[0]), tcfg.vocab_size))
        if ok[draft_targets].sum() < tree.top_k:
            continue
        first = [j for j in range(1, tree.head_nodes) if parents[j] == 0]
        assert first and all(ok[tokens[j]] for j in first), (tokens, parents)
        checked += 1
    assert checked >= 10, checked

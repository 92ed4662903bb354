"""Drafts from the context: the on-device prompt lookup, its graft onto trees, and lossless decoding with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import plain_generate

from cli import demo
from eagle_jax.decoding import context, generation, programs, session, speculative
from eagle_jax.decoding import tree as trees
from eagle_jax.decoding.context import NO_TOKEN
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import DynamicTree, NoDraft, StaticTree
from eagle_jax.errors import EagleError
from eagle_jax.io import loading


def _propose_reference(row: list[int], length: int, k: int, min_match: int) -> list[int]:
    """The longest suffix (<= MAX_NGRAM, >= min_match) of row[: length + 1] found earlier, latest first; the
    tokens after it up to the root's position."""
    best_n, best_j = 0, -1
    for j in range(length):
        n = 0
        while n < context.MAX_NGRAM and j - n >= 0 and row[j - n] == row[length - n]:
            n += 1
        if n >= min_match and n >= best_n:
            best_n, best_j = n, j
    if best_j < 0:
        return []
    return row[best_j + 1 : min(best_j + 1 + k, length + 1)]


@pytest.mark.parametrize("k,min_match", [(1, 1), (5, 1), (7, 2), (4, 3), (6, 4)])
def test_propose_equals_a_plain_search(k, min_match):
    """Random rows over a small vocabulary (many repeats) at random lengths, and a row with no earlier match."""
    rng = np.random.default_rng(k * 10 + min_match)
    history = rng.integers(0, 5, size=(64, 40)).astype(np.int32)
    history[0, :10] = np.arange(10)  # nothing recurs
    lengths = rng.integers(0, 40, size=64).astype(np.int32)
    lengths[0] = 9
    tokens, valid = jax.device_get(context.propose(jnp.asarray(history), jnp.asarray(lengths), k, min_match))
    for r in range(64):
        want = _propose_reference(history[r].tolist(), int(lengths[r]), k, min_match)
        assert tokens[r, : len(want)].tolist() == want and valid[r].tolist() == [i < len(want) for i in range(k)]
        assert np.all(tokens[r, len(want) :] == NO_TOKEN)
    assert not valid[0].any()


def _children(tokens: np.ndarray, parents: np.ndarray, node: int) -> list[int]:
    return [int(tokens[j]) for j in range(1, len(tokens)) if parents[j] == node and tokens[j] != NO_TOKEN]


def test_graft_merges_shared_prefixes_and_hangs_the_rest_off_the_deepest_shared_node():
    # head tree: root(0) -> 5(1), 6(2); 5(1) -> 7(3); 7(3) -> 8(4)
    tokens = jnp.array([[9, 5, 6, 7, 8]] * 4)
    parents = jnp.array([[0, 0, 0, 1, 3]] * 4)
    candidates = jnp.array([[5, 7, 3, 4], [6, 1, 2, NO_TOKEN], [2, 5, 7, 8], [5, 7, 8, 8]])
    valid = candidates != NO_TOKEN
    t, p = jax.device_get(context.graft(tokens, parents, candidates, valid))
    # row 0: 5 and 7 merge into nodes 1 and 3; 3 hangs off node 3, 4 off the new 3
    assert t[0, 5:].tolist() == [NO_TOKEN, NO_TOKEN, 3, 4] and p[0, 7:].tolist() == [3, 7]
    # row 1: 6 merges into node 2; 1 and 2 chain below it; the missing fourth candidate stays unused
    assert t[1, 5:].tolist() == [NO_TOKEN, 1, 2, NO_TOKEN] and p[1, 6:8].tolist() == [2, 6]
    # row 2: nothing shared: a chain from the root (5 and 7 under it are new nodes, not the head's)
    assert t[2, 5:].tolist() == [2, 5, 7, 8] and p[2, 5:].tolist() == [0, 5, 6, 7]
    # row 3: the whole head path 5 -> 7 -> 8 is shared; the last 8 hangs off node 4
    assert t[3, 5:].tolist() == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 8] and p[3, 8] == 4
    for r in range(4):  # siblings stay distinct everywhere
        for node in range(t.shape[1]):
            kids = _children(t[r], p[r], node)
            assert len(kids) == len(set(kids)), (r, node, kids)


def test_a_candidate_equal_to_the_roots_token_is_a_new_child_of_the_root():
    """The root is not its own child: a first candidate with the root's token hangs under the root as a new node
    (merged with the root, the branch would start one level too shallow)."""
    tokens = jnp.array([[9, 5, 6], [9, 9, 6]])  # row 1: the head also drafted the root's token under it
    parents = jnp.array([[0, 0, 0], [0, 0, 0]])
    candidates = jnp.array([[9, 4], [9, 4]])
    t, p = jax.device_get(context.graft(tokens, parents, candidates, candidates != NO_TOKEN))
    assert t[0, 3:].tolist() == [9, 4] and p[0, 3:].tolist() == [0, 3]  # a chain from the root: 9 -> 4
    assert t[1, 3:].tolist() == [NO_TOKEN, 4] and p[1, 4] == 1  # 9 merges with the head's node 1, not the root


def test_context_envelopes_size_their_cycles():
    chain = DynamicTree(5, 4, 1, context=7)
    assert (chain.num_nodes, chain.max_depth, chain.path_len, chain.is_chain) == (12, 7, 8, False)
    alone = NoDraft(context=7)
    assert (alone.num_nodes, alone.is_chain, alone.needs_head) == (8, True, False)
    assert StaticTree(((0,), (0, 0)), context=3).max_accept == 3
    assert DynamicTree(5, 4, 1).is_chain and not NoDraft().drafts
    for bad in (dict(context=-1), dict(context=99), dict(context=3, min_match=0), dict(context=3, min_match=9)):
        with pytest.raises(EagleError):
            NoDraft(**bad)
    parsed = trees.parse_envelopes("5/4/1+ctx7,ctx5m3")
    assert parsed == [DynamicTree(5, 4, 1, context=7), NoDraft(context=5, min_match=3)]
    assert [trees.envelope_name(t) for t in parsed] == ["5/4/1+ctx7", "ctx5m3"]
    assert all(trees.envelope_from_json(trees.envelope_json(t)) == t for t in parsed)


@pytest.fixture(scope="module")
def pair():
    """The shipped demo pair in float32 (so that verifying 1 or N tokens rounds alike): a small trained target,
    which copies what it has read as language models do."""
    tcfg, tparams = loading.load_target(demo.TARGET, np.float32)
    dcfg, dparams = loading.load_draft(demo.DRAFT, tcfg, dtype=np.float32)
    return tcfg, tparams, dcfg, dparams


def _prompts(batch: int, vocab: int) -> list[list[int]]:
    """Rows that repeat a random phrase (the context branch is taken) and rows that do not."""
    rng = np.random.default_rng(batch)
    phrases = [rng.integers(5, vocab, size=n).tolist() for n in (6, 9, 4, 11)]
    return [phrases[i % 4] * (2 + i % 3) if i % 4 != 3 else phrases[3] for i in range(batch)]


@pytest.mark.parametrize(
    "tree,head,batch",
    [
        (NoDraft(context=5, min_match=1), False, 1),
        (DynamicTree(12, 3, 3, context=4), True, 8),
        (StaticTree(((0,), (1,), (0, 0)), context=3, min_match=1), True, 4),
        (NoDraft(context=7), True, 8),  # the head only follows along
    ],
)
def test_greedy_with_context_drafts_equals_plain(tree, head, batch, pair):
    """Greedy output equals plain greedy decoding, with and without a head, prompts that repeat themselves
    (the context branch is taken) and prompts that do not; context candidates are accepted."""
    tcfg, tparams, dcfg, dparams = pair
    if not head:
        dcfg = dparams = None
    prompts = _prompts(batch, tcfg.vocab_size)
    res = generation.generate(tparams, dparams, prompts, 32, speculative.DecodeConfig(tcfg, dcfg, tree))
    assert res.tokens == plain_generate(tparams, tcfg, prompts, 32).tokens
    assert res.tau > 1.2, res.tau
    assert all(0 <= a <= tree.max_accept for row in res.accept_lengths for a in row)


def test_a_context_cycle_has_a_narrow_branch_for_rows_without_candidates(monkeypatch, pair):
    """The cycle verifies the whole tree only when a running row has context candidates; otherwise the head's
    part alone (the root alone without a head's part): both widths are in the program, outputs stay plain's."""
    tcfg, tparams, dcfg, dparams = pair
    prompts = [[11, 14, 17, 20, 23, 26, 29, 32]]  # nothing recurs in the prompt
    widths = []
    real = speculative._forward

    def spy(*args, **kw):
        widths.append(args[2].tokens.shape[1])  # the tree a branch verifies
        return real(*args, **kw)

    monkeypatch.setattr(speculative, "_forward", spy)
    programs.forget()  # traced afresh, spied
    ref = plain_generate(tparams, tcfg, prompts, 6).tokens
    for tree, head in ((NoDraft(context=5, min_match=4), False), (DynamicTree(5, 4, 1, context=5), True)):
        widths.clear()
        models = (dparams, dcfg) if head else (None, None)
        streamed = generation.stream(tparams, models[0], prompts, 6, speculative.DecodeConfig(tcfg, models[1], tree))
        assert [t for new, _, _ in streamed for t in new[0]] == ref[0]
        assert sorted(set(widths)) == [tree.head_nodes, tree.num_nodes]
    jax.clear_caches()  # no spied program outlives this test
    programs.forget()


def test_a_context_loop_runs_the_whole_tree_only_when_a_candidate_exists(monkeypatch, pair):
    """In on-device loops a cycle in which no running row has a context candidate runs the tree without its
    context branch (here the root alone: a plain step), the whole tree only when one has; the tokens and accept
    lengths are those of the streamed cycles, which verify the whole tree's program every time."""
    tcfg, tparams, _, _ = pair
    ran = []  # per cycle run: whether its tree had the context branch
    real = speculative.one_cycle

    def counted(tparams, dparams, s, cfg, span, masks=None):
        state, tr = real(tparams, dparams, s, cfg, span, masks)
        jax.debug.callback(lambda _: ran.append(bool(cfg.tree.context)), state.cycle)
        return state, tr

    monkeypatch.setattr(speculative, "one_cycle", counted)
    programs.forget()  # traced afresh, counted
    tree = NoDraft(context=5, min_match=2)
    cfg = speculative.DecodeConfig(tcfg, None, tree)
    try:
        for prompt in ([11, 14, 17, 20, 23, 26, 29, 32], _prompts(1, tcfg.vocab_size)[0]):  # fresh, repeating
            tokens, accepts, found = [], [], []  # of the streamed cycles (each state is donated to the next)
            for c, (new, tr, state) in enumerate(generation.stream(tparams, None, [prompt], 24, cfg)):
                tokens += new[0]
                accepts.append(int(state.accept_lengths[c, 0]))
                found.append(bool(np.any(np.asarray(tr.tokens)[0, 1:] != NO_TOKEN)))
            jax.effects_barrier()
            ran.clear()
            looped = generation.generate(tparams, None, [prompt], 24, cfg)
            jax.effects_barrier()
            assert ran == found, (ran, found)
            assert looped.tokens[0] == tokens and looped.accept_lengths[0] == accepts
        assert any(found) and not all(found)  # the repeating prompt has cycles of both kinds
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # no counted program outlives this test
        programs.forget()


@pytest.mark.parametrize(
    "tree,head", [(NoDraft(context=5, min_match=1), False), (DynamicTree(5, 4, 1, context=5, min_match=1), True)]
)
def test_context_loops_draw_what_streamed_cycles_draw(tree, head, pair):
    """Sampled with a seed, the on-device loops (cycles without a candidate run the tree without its context
    branch) give the streamed cycles' tokens and accept lengths, rows with and without candidates in one batch."""
    tcfg, tparams, dcfg, dparams = pair
    if not head:
        dcfg = dparams = None
    cfg = speculative.DecodeConfig(tcfg, dcfg, tree, SamplingConfig(0.3))  # low: the target copies
    prompts = _prompts(4, tcfg.vocab_size)
    looped = generation.generate(tparams, dparams, prompts, 24, cfg, seed=3)
    tokens, accepts = [[] for _ in prompts], [[] for _ in prompts]
    for c, (new, _, state) in enumerate(generation.stream(tparams, dparams, prompts, 24, cfg, seed=3)):
        for r, more in enumerate(new):
            tokens[r] += more
            accepts[r] += [int(state.accept_lengths[c, r])] if more else []
    assert looped.tokens == tokens and looped.accept_lengths == accepts
    assert sum(map(sum, accepts)) > 0  # candidates were accepted


def test_chat_turns_with_context_drafts_equal_plain_turns(pair):
    """A session speculating with context candidates alone (no head), and one with a head and candidates,
    answer three turns as a plain session does; the second turn copies from the first."""
    tcfg, tparams, dcfg, dparams = pair
    sessions = {
        "plain": session.Session(tparams, None, speculative.DecodeConfig(tcfg), capacity=256),
        "context": session.Session(
            tparams, None, speculative.DecodeConfig(tcfg, None, NoDraft(context=6, min_match=1)), capacity=256
        ),
        "both": session.Session(
            tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, DynamicTree(4, 3, 1, context=5)), capacity=256
        ),
    }
    answers = {name: [] for name in sessions}
    taus = []
    for name, talk in sessions.items():
        convo: list[int] = []
        for turn in ([30, 81, 19, 94, 43, 30, 81], [56, 63, 30, 81, 19], [22, 29, 94, 43, 30, 81, 19, 94]):
            convo = convo + turn
            answer = [t for new in talk.reply(convo, 24) for t in new]
            answers[name].append(answer)
            convo = convo + answer
            if name != "plain":
                taus.append(len(answer) / max(1, len(talk.last.accept_lengths)))
    assert answers["context"] == answers["plain"] == answers["both"]
    assert max(taus) > 1.5, taus


def test_a_session_refuses_a_head_tree_without_a_head(pair):
    tcfg, tparams, _, _ = pair
    with pytest.raises(EagleError, match="draft head"):
        session.Session(tparams, None, speculative.DecodeConfig(tcfg, None, DynamicTree(5, 4, 1)), capacity=64)

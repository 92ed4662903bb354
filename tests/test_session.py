"""Conversations kept on device: chunked prefill, caches across turns, no compilation after warm-up."""

import itertools
import threading

import jax
import numpy as np
import pytest

from eagle_jax.decoding import engine as engines
from eagle_jax.decoding import generation, programs, session, speculative
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.tree import PLAIN, DynamicTree, StaticTree
from eagle_jax.errors import EagleError

TREE = DynamicTree(total_tokens=16, depth=4, top_k=4)
CAPACITY = 512  # of the sessions and of the from-scratch references alike: each shape compiles once


@pytest.fixture(scope="module")
def pair(golden_target, golden_dir):
    from eagle_jax.io.loading import load_draft

    tcfg, tparams = golden_target
    dcfg, dparams = load_draft(golden_dir / "eagle3", tcfg)
    return tparams, tcfg, dparams, dcfg


def test_chunk_plan():
    assert engines.chunk_plan(1, (256, 32)) == [32]
    assert engines.chunk_plan(32, (256, 32)) == [32]
    assert engines.chunk_plan(300, (256, 32)) == [256, 32, 32]
    assert engines.chunk_plan(600, (256, 32)) == [256, 256, 32, 32, 32]
    assert engines.chunk_plan(200, (256,)) == [256]
    assert sum(engines.chunk_plan(1000, (64, 8))) >= 1000
    # a call costs CALL_COST (32) positions: a middle size spares calls where the small one would need several
    assert engines.chunk_plan(40, (256, 128, 32)) == [32, 32]  # 128 + 64 against 160 for one 128
    assert engines.chunk_plan(100, (256, 128, 32)) == [128]  # 160 against 256 for four 32s
    assert engines.chunk_plan(600, (256, 128, 32)) == [256, 256, 128]
    counts = list(itertools.product(range(4), range(7), range(24)))  # of 256, 128 and 32: every plan up to 768
    for n in range(1, 700):  # no plan covers n for less
        plan = engines.chunk_plan(n, (256, 128, 32))
        least = min(
            (a + b + c) * engines.CALL_COST + 256 * a + 128 * b + 32 * c
            for a, b, c in counts
            if 256 * a + 128 * b + 32 * c >= n
        )
        assert sum(plan) >= n and len(plan) * engines.CALL_COST + sum(plan) == least, n


def test_no_chunk_is_longer_than_the_cache(pair):
    """An engine compiles prefill chunks up to its capacity (the smallest chunk where every one is longer)."""
    tparams, tcfg, dparams, dcfg = pair
    cfg = speculative.DecodeConfig(tcfg, dcfg, TREE)
    assert engines.Engine(tparams, dparams, cfg, 1, 200).chunks == (128, 32)
    assert engines.Engine(tparams, dparams, cfg, 1, 16, (64, 32)).chunks == (32,)


def test_common_prefix():
    assert engines.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert engines.common_prefix([1, 2], [1, 2, 3]) == 2
    assert engines.common_prefix([], [1]) == 0
    assert engines.common_prefix([7], [1]) == 0


def _conversation(talk, first_len, turns, new, rng, seed_base=0):
    """Run `turns` turns (each prompt = the previous prompt + answer + a few new tokens); return the prompts,
    answers, reused counts and accept lengths."""
    convo = rng.integers(3, 250, first_len).tolist()
    prompts, answers, kept, accepts = [], [], [], []
    for turn in range(turns):
        answer = [t for piece in talk.reply(convo, new, seed=seed_base + turn) for t in piece]
        assert answer == talk.last.tokens
        _check_cache_lengths(talk, len(convo), answer, talk.last.accept_lengths)
        prompts.append(convo)
        answers.append(answer)
        kept.append(talk.last.reused_tokens)
        accepts.append(talk.last.accept_lengths)
        convo = convo + answer + rng.integers(3, 250, 3 + 41 * turn).tolist()
    return prompts, answers, kept, accepts


def _check_cache_lengths(talk: session.Session, prompt: int, answer: list[int], accepts: list[int]) -> None:
    """What the caches hold after a turn: plain decoding the prompt and every answer token but the last (the next
    one to feed); a speculative row the prompt and every committed cycle (root + accepted drafts; the last cycle
    may commit past the budget), in the target's cache and the head's alike."""
    state = talk.state
    committed = sum(a + 1 for a in accepts)
    assert committed >= len(answer)
    lengths = [state.target_cache.lengths] + ([state.draft_cache.lengths] if state.draft_cache is not None else [])
    assert [int(n[0]) for n in lengths] == [prompt + committed] * len(lengths)


@pytest.mark.parametrize(
    "tree, stream",
    [(TREE, True), (StaticTree(((0,), (1,), (0, 0), (0, 0, 0))), True), (PLAIN, True), (TREE, False)],
    ids=str,
)
def test_turns_equal_decoding_from_scratch(pair, tree, stream):
    """Each turn's answer equals generating the whole conversation from scratch, while the caches keep all
    but the last token of what they already held (the earlier prompts and answers); streamed cycle by cycle or
    decoded in on-device loops alike."""
    tparams, tcfg, dparams, dcfg = pair
    talk = session.Session(
        tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, tree), CAPACITY, (64, 16), stream=stream
    )
    assert talk.programs()[-2].startswith("cycle" if stream and tree.drafts else "decode loop")  # then "retire"
    prompts, answers, kept, accepts = _conversation(talk, 45, 4, 20, np.random.default_rng(1))
    for prompt, answer, accepted in zip(prompts, answers, accepts):
        # the head drafts from the same context too: the same cycles accept the same drafts
        expected = generation.generate(
            tparams, dparams, [prompt], 20, speculative.DecodeConfig(tcfg, dcfg, tree), capacity=CAPACITY
        )
        assert answer == expected.tokens[0] and accepted == expected.accept_lengths[0]
    assert kept[0] == 0
    for before, answer, now in zip(prompts, answers, kept[1:]):
        assert now == len(before) + len(answer) - 1


def test_a_changed_conversation_drops_what_differs(pair):
    """A prompt that shares only part of what the caches hold (an edited earlier turn) keeps that part."""
    tparams, tcfg, dparams, dcfg = pair
    talk = session.Session(
        tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, TREE), capacity=CAPACITY, chunks=(32,)
    )
    first = list(range(10, 70))
    list(talk.reply(first, 8))
    edited = first[:25] + [3, 4, 5] + first[25:]
    answer = [t for piece in talk.reply(edited, 12) for t in piece]
    assert talk.last.reused_tokens == 24
    assert (
        answer
        == generation.generate(tparams, dparams, [edited], 12, speculative.DecodeConfig(tcfg, dcfg, TREE)).tokens[0]
    )


def test_sampled_turns_equal_sampling_from_scratch(pair):
    """With the same seed a sampled turn draws exactly what `generation.generate` draws from scratch."""
    tparams, tcfg, dparams, dcfg = pair
    sc = SamplingConfig(temperature=0.9, top_p=0.95)
    talk = session.Session(
        tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, TREE, sc), capacity=CAPACITY, chunks=(32,)
    )
    prompts, answers, _, _ = _conversation(talk, 20, 3, 16, np.random.default_rng(2), seed_base=5)
    for turn, (prompt, answer) in enumerate(zip(prompts, answers)):
        expected = generation.generate(
            tparams,
            dparams,
            [prompt],
            16,
            speculative.DecodeConfig(tcfg, dcfg, TREE, sc),
            seed=5 + turn,
            capacity=CAPACITY,
        )
        assert answer == expected.tokens[0]


@pytest.mark.parametrize("tree", [TREE, PLAIN], ids=["speculative", "plain"])
def test_nothing_compiles_after_warm_up(pair, compiles, tree):
    """Prompts from 10 to 1900 tokens and several turns each run only the warmed programs."""
    tparams, tcfg, dparams, dcfg = pair
    talk = session.Session(tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, tree), capacity=2048)
    assert len(talk.programs()) == len(session.CHUNKS) + len(talk.spans) + 1 == 3 + 5 + 1  # and retire
    talk.warm_up()
    before = len(compiles)
    jax.jit(lambda x: x * 3 + 1)(np.float32(2))  # a new program: the listener sees compilations
    assert len(compiles) == before + 1
    warm = len(compiles)
    rng = np.random.default_rng(3)
    for length in (10, 170, 900, 1900):
        _conversation(talk, length, 2, 24, rng)
    assert len(compiles) == warm, compiles[warm:]


def test_the_first_turn_waits_only_for_its_own_programs(pair, compiles):
    """Compiling in the background (`warm_up(wait=False)`), a turn starts at once and runs its programs as they are
    compiled: the answer is the same, and each program compiles exactly once however the turn and the workers
    race (a distinct capacity: programs no other test compiled)."""
    tparams, tcfg, dparams, dcfg = pair
    cfg = speculative.DecodeConfig(tcfg, dcfg, TREE)
    talk = session.Session(tparams, dparams, cfg, capacity=384, chunks=(48, 8))
    before = len(compiles)
    talk.warm_up(wait=False)
    prompt = list(range(20, 90))
    answer = [t for piece in talk.reply(prompt, 16) for t in piece]
    talk.compiled.wait()
    assert len(compiles) - before == len(talk.programs()) == 2 + 3 + 1, compiles[before:]
    assert answer == generation.generate(tparams, dparams, [prompt], 16, cfg, capacity=384).tokens[0]


class Gated:
    """A stand-in for a jitted function whose compilation waits for a gate; calling it directly is an error."""

    def __init__(self):
        self.gate, self.compiled = threading.Event(), 0

    def lower(self, *shapes, **static):
        return self

    def compile(self):
        self.gate.wait(timeout=30)
        self.compiled += 1
        return lambda *args: ("compiled", len(args))

    def __call__(self, *args, **static):
        raise AssertionError("compiled again on the caller's thread")


def test_a_call_waits_for_its_program_and_nothing_compiles_twice():
    """A program under compilation on a worker is waited for, not compiled again by its caller; asked again, the
    same compilation; `cancel` drops the compilations not yet begun, which start again when asked for."""
    fn, ahead, got = Gated(), programs.Precompiled(), []
    ahead.submit("p", fn, np.ones(3))
    caller = threading.Thread(target=lambda: got.append(ahead("p", fn, np.ones(3))))
    caller.start()
    caller.join(timeout=0.3)
    assert caller.is_alive() and not got  # waiting for the worker
    fn.gate.set()
    caller.join(timeout=30)
    assert got == [("compiled", 1)] and fn.compiled == 1
    assert programs.Precompiled()("q", fn, np.ones(3)) == ("compiled", 1) and fn.compiled == 1  # the same shapes
    blocked, many = Gated(), programs.Precompiled()
    for n in range(8):
        many.submit(f"p{n}", blocked, np.ones(n + 10))
    assert many.cancel() >= 8 - programs.COMPILE_WORKERS  # those under way go on
    blocked.gate.set()
    assert many("p7", blocked, np.ones(17)) == ("compiled", 1)  # a cancelled program asked for starts again
    many.wait()


def test_a_program_nobody_started_compiles_on_its_callers_thread():
    """A caller that would only wait compiles its program itself (warm-up's submissions go to the workers)."""
    where = []

    class Recorded(Gated):
        def compile(self):
            where.append(threading.current_thread())
            return super().compile()

    fn = Recorded()
    fn.gate.set()
    assert programs.Precompiled()("r", fn, np.ones(21)) == ("compiled", 1) and where == [threading.current_thread()]
    programs.Precompiled().submit("s", fn, np.ones(22)).result()
    assert where[-1] is not threading.current_thread()


def test_bad_sessions(pair):
    tparams, tcfg, dparams, dcfg = pair
    with pytest.raises(EagleError, match="positions"):
        session.Session(
            tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, TREE), capacity=tcfg.rope.max_position_embeddings + 1
        )
    with pytest.raises(EagleError, match="draft head"):
        session.Session(tparams, None, speculative.DecodeConfig(tcfg, None, TREE))
    talk = session.Session(tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, TREE), capacity=128, chunks=(32,))
    with pytest.raises(EagleError, match="does not fit"):
        list(talk.reply(list(range(5, 125)), 8))


def test_sessions_on_a_mesh_equal_one_device(pair):
    """A conversation with parameters and caches split over `tensor` answers as on one device."""
    from eagle_jax.parallel import sharding

    tparams, tcfg, dparams, dcfg = pair
    mesh = sharding.make_mesh("tensor=2", jax.devices()[:2])
    placed_t = sharding.place(tparams, sharding.target_shardings(tcfg, mesh))
    placed_d = sharding.place(dparams, sharding.draft_shardings(dcfg, mesh))
    one = session.Session(tparams, dparams, speculative.DecodeConfig(tcfg, dcfg, TREE), capacity=256, chunks=(32,))
    split = session.Session(
        placed_t, placed_d, speculative.DecodeConfig(tcfg, dcfg, TREE), capacity=256, chunks=(32,), mesh=mesh
    )
    rng = np.random.default_rng(4)
    assert _conversation(one, 30, 2, 12, rng)[1] == _conversation(split, 30, 2, 12, np.random.default_rng(4))[1]
    assert jax.device_count() >= 2


class FailsOnce(Gated):
    """A compilation that fails the first time (a compiler error, memory), then succeeds."""

    def compile(self):
        self.compiled += 1
        if self.compiled == 1:
            raise RuntimeError("compiler failed")
        return lambda *args: ("compiled", len(args))


def test_a_failed_compilation_is_tried_again_when_asked_again():
    fn, ahead = FailsOnce(), programs.Precompiled()
    with pytest.raises(RuntimeError, match="compiler failed"):
        ahead("p", fn, np.ones(5))
    assert ahead("p", fn, np.ones(5)) == ("compiled", 1) and fn.compiled == 2

"""The engine's rows under its clients: admission at the queue's limit, waiting requests that are cancelled, and
failures inside compiled programs (a host callback that raises, traced into the cycle here) that end the rows they
touched with an error the caller sees, after which the engine takes new work on rebuilt rows."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest
from tiny import plain_generate

from eagle_jax.decoding import speculative
from eagle_jax.decoding.engine import EngineError
from eagle_jax.decoding.sampling import SamplingConfig
from eagle_jax.decoding.speculative import DecodeConfig
from eagle_jax.serving import batcher

DEMO = Path(__file__).resolve().parents[1] / "demo"
PROMPTS = [list(range(5, 30)), list(range(40, 52)), [7, 8, 9] * 5]


class Failing:
    """Cycles traced from now on run a host callback that raises on their n-th run (counted over every such program)
    for n in `runs`. A test that uses it compiles its own programs: a capacity no other test uses."""

    def __init__(self, monkeypatch, runs: set[int]):
        self.runs, self.seen = set(runs), 0
        verify = speculative._verify

        def verify_then_check(*args, **kw):
            state = verify(*args, **kw)
            jax.debug.callback(self.check, state.cycle)
            return state

        monkeypatch.setattr(speculative, "_verify", verify_then_check)

    def check(self, _) -> None:
        self.seen += 1
        if self.seen in self.runs:
            raise RuntimeError("injected device failure")

    def next_run(self) -> None:
        self.runs.add(self.seen + 1)


def cannot_rebuild() -> None:
    raise MemoryError("no room for fresh rows")


class Answer:
    def __init__(self):
        self.tokens: list[int] = []
        self.finish: list[str] = []

    def request(self, prompt: list[int], max_tokens: int) -> batcher.Request:
        return batcher.Request(prompt, max_tokens, SamplingConfig(), 0, self.tokens.extend, self.finish.append)


def plain_batcher(golden_target, slots: int, capacity: int, max_queue: int) -> batcher.Batcher:
    tcfg, tparams = golden_target
    return batcher.Batcher(tparams, None, DecodeConfig(tcfg), slots=slots, capacity=capacity, max_queue=max_queue)


def test_admission_refuses_exactly_at_the_free_slots_and_the_queues_room(golden_target):
    """Two slots and a queue of one take three requests, the fourth gets QueueFull; with both rows running and one
    request waiting, still none; a cancelled waiting request leaves the queue at once (never counted as finished)
    and its place is taken."""
    engine = plain_batcher(golden_target, slots=2, capacity=128, max_queue=1)
    answers = [Answer() for _ in range(5)]
    for a, prompt in zip(answers, PROMPTS):
        engine.submit(a.request(prompt, 30))
    with pytest.raises(batcher.QueueFull):
        engine.submit(answers[3].request(PROMPTS[0], 30))
    assert engine.step() and engine.live == 2 and engine.waiting == 1
    with pytest.raises(batcher.QueueFull):
        engine.submit(answers[3].request(PROMPTS[0], 30))
    waiting = engine.queue[0]
    waiting.cancel()
    assert engine.waiting == 0 and answers[2].finish == ["cancelled"] and engine.stats.dropped == 1
    engine.submit(answers[3].request(PROMPTS[0], 30))
    with pytest.raises(batcher.QueueFull):
        engine.submit(answers[4].request(PROMPTS[0], 30))
    while engine.step():
        pass
    assert engine.stats.finished == 3 and engine.stats.rejected == 3
    assert answers[3].tokens == answers[0].tokens and answers[3].finish == ["length"]


def test_a_failing_admission_gives_its_slot_back(golden_target, monkeypatch):
    """A request whose admission fails ends with an error and no longer holds a slot: with no queue, both slots take
    new requests (a claim it kept would refuse one of them for good)."""
    engine = plain_batcher(golden_target, slots=2, capacity=128, max_queue=0)
    failed = Answer()
    engine.submit(failed.request(PROMPTS[0], 10))
    admit = engine.engine.admit

    def failing(slot, prompt, *args, owner=None, **kw):
        raise EngineError("the engine failed (RuntimeError: injected)", [owner])

    monkeypatch.setattr(engine.engine, "admit", failing)
    engine.step()
    assert failed.finish == ["error"] and engine.live == 0 and engine.claimed == 0
    monkeypatch.setattr(engine.engine, "admit", admit)
    answers = [Answer(), Answer()]
    for a, prompt in zip(answers, PROMPTS):
        engine.submit(a.request(prompt, 10))  # QueueFull for the second with a kept claim
    while engine.step():
        pass
    assert [a.finish for a in answers] == [["length"], ["length"]]


def test_a_failing_cycle_ends_its_rows_with_an_error_and_the_queue_runs_on_rebuilt_rows(golden_target, monkeypatch):
    tcfg, tparams = golden_target
    Failing(monkeypatch, {2})
    engine = plain_batcher(golden_target, slots=2, capacity=192, max_queue=2)
    answers = [Answer() for _ in PROMPTS]
    for a, prompt in zip(answers, PROMPTS):
        engine.submit(a.request(prompt, 20))
    assert engine.step() and engine.step()  # the second cycle fails
    assert [a.finish for a in answers] == [["error"], ["error"], []] and engine.stats.failed == 2
    assert engine.live == 0 and engine.waiting == 1 and not engine.dead
    assert all(r.cached == [] for r in engine.engine.rows)  # fresh rows: nothing of the lost caches is kept
    while engine.step():
        pass
    assert answers[2].finish == ["length"]
    assert answers[2].tokens == plain_generate(tparams, tcfg, [PROMPTS[2]], 20).tokens[0]


def test_an_engine_that_cannot_rebuild_is_dead(golden_target, monkeypatch):
    Failing(monkeypatch, {1})
    engine = plain_batcher(golden_target, slots=1, capacity=320, max_queue=2)
    died = []
    engine.on_dead = lambda: died.append(True)
    answers = [Answer() for _ in PROMPTS[:2]]
    for a, prompt in zip(answers, PROMPTS):
        engine.submit(a.request(prompt, 20))

    monkeypatch.setattr(engine.engine, "_empty", cannot_rebuild)
    engine.running = True
    engine.step()
    assert engine.dead and not engine.running and died == [True]
    assert [a.finish for a in answers] == [["error"], ["error"]]  # the running row and the waiting request
    with pytest.raises(EngineError, match="could not rebuild"):
        engine.submit(Answer().request(PROMPTS[0], 5))


def test_a_failing_turn_raises_and_the_next_turn_starts_from_fresh_caches(golden_target, monkeypatch):
    from eagle_jax.decoding import session

    tcfg, tparams = golden_target
    Failing(monkeypatch, {3})
    talk = session.Session(tparams, None, DecodeConfig(tcfg), capacity=448, chunks=(32,))
    shown = []
    with pytest.raises(EngineError, match="the engine failed"):
        for new in talk.reply(PROMPTS[0], 10):
            shown += new
    assert shown == [] and talk.cached == []  # the third cycle of the answer's on-device loop failed
    answer = [t for new in talk.reply(PROMPTS[0], 10) for t in new]
    assert answer == plain_generate(tparams, tcfg, [PROMPTS[0]], 10).tokens[0] and talk.last.reused_tokens == 0


def test_the_server_answers_a_lost_request_with_a_500_a_stream_with_an_error_event_then_503_when_dead(
    golden_target, monkeypatch
):
    from fastapi.testclient import TestClient

    from eagle_jax.io import loading
    from eagle_jax.serving import api

    tcfg, tparams = golden_target
    failing = Failing(monkeypatch, {1, 2})
    engine = plain_batcher(golden_target, slots=2, capacity=384, max_queue=4)
    tok = loading.load_tokenizer(DEMO / "target")
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    with TestClient(api.create_app(engine, tok, "golden")) as client:
        r = client.post("/v1/completions", json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and message.startswith("internal error (request id cmpl-"), r.text
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            events = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and events[-1] == "data: [DONE]", events
        assert json.loads(events[-2].removeprefix("data: "))["error"]["message"].startswith("internal error"), events
        r = client.post("/v1/completions", json=body)  # rebuilt rows take new work
        expected = plain_generate(tparams, tcfg, [PROMPTS[0]], 8).tokens[0]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == tok.decode(expected, skip_special_tokens=True)
        assert client.get("/health").status_code == 200

        failing.next_run()
        monkeypatch.setattr(engine.engine, "_empty", cannot_rebuild)
        assert client.post("/v1/completions", json=body).status_code == 500
        assert engine.dead and client.get("/health").status_code == 503
        assert client.post("/v1/completions", json=body).status_code == 503
        metrics = client.get("/metrics").text
        assert "eagle_jax_requests_failed_total 3" in metrics and "eagle_jax_requests_finished_total 1" in metrics


def test_a_failing_generation_exits_with_one_line(monkeypatch, capsys):
    from infer import generate

    Failing(monkeypatch, {2})
    target = str(Path(__file__).parent / "golden" / "target")
    args = ["--target", target, "--no-spec", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--max-len", "576"]
    code = generate.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err[-1].startswith("error: the engine failed ("), err


def test_rows_under_the_static_rule_cycle_together_and_per_row_ones_by_bucket(golden_target):
    """The static sampling rule draws over the whole batch with one key, so gathering some rows would change what
    the others draw: such an engine compiles its cycles for every row only."""
    from eagle_jax.decoding.engine import Engine

    tcfg, tparams = golden_target
    assert list(Engine(tparams, None, DecodeConfig(tcfg), slots=4, capacity=128).envelope) == [4]
    assert list(Engine(tparams, None, DecodeConfig(tcfg), slots=4, capacity=128, per_row=True).envelope) == [1, 2, 4]


def test_a_failed_chat_turn_prints_one_line_and_the_chat_goes_on(monkeypatch, capsys):
    """The chat's side of a failed turn (the session raising `EngineError`, as a failing cycle makes it): one error
    line, the turn dropped from the history, the next turn answered."""
    import io
    import types

    from cli import chat
    from eagle_jax.decoding import session
    from eagle_jax.decoding.tree import PLAIN
    from eagle_jax.io import loading

    tok = loading.load_tokenizer(DEMO / "target")
    answer = tok("fine", add_special_tokens=False).input_ids

    class Failing:
        capacity, turns, prompts = 512, 0, []

        def reply(self, ids, max_new_tokens, seed):
            self.prompts.append(ids)
            if len(self.prompts) == 1:
                raise EngineError("the engine failed (RuntimeError: injected); its rows were rebuilt")
            self.turns += 1
            self.last = session.TurnStats(len(ids), 0, 0.01, 0.01, answer, [])
            yield answer

    talk = Failing()
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    settings = types.SimpleNamespace(decode=types.SimpleNamespace(tree=PLAIN), max_new_tokens=4, seed=0)
    chat.converse(talk, tok, settings, False, None)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == ["error: the engine failed (RuntimeError: injected); its rows were rebuilt"] and "fine" in out
    assert talk.prompts[1] == tok("second").input_ids  # the failed turn left the history


def test_an_engine_keeps_host_parameters_on_the_device(golden_dir):
    """A loader's numpy parameters are put on the device once, not copied there by every program call."""
    import numpy as np

    from eagle_jax.decoding.engine import Engine
    from eagle_jax.decoding.tree import DynamicTree
    from eagle_jax.io import loading

    tcfg, tparams = loading.load_target(golden_dir / "target")
    dcfg, dparams = loading.load_draft(golden_dir / "eagle3", tcfg)
    numpy = jax.tree.map(np.asarray, (tparams, dparams))  # as a loader gives them
    engine = Engine(*numpy, DecodeConfig(tcfg, dcfg, DynamicTree(5, 3, 1)), 1, 64)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves((engine.tparams, engine.dparams)))

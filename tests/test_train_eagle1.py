"""EAGLE-1 head training (`train.eagle1`): v1's batch layout, noise and optimiser, runs that learn, resume, train
from stored features and export a head the engine runs losslessly."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from convdata import chain_conversations, next_token_table, write_jsonl
from tiny import plain_generate

from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.tree import parse_envelopes
from eagle_jax.io import official
from eagle_jax.training import features, loop, objective, step, trainer
from train import eagle1, eagle3

SETTINGS = dict(kind="eagle1", batch_size=8, max_length=64, lr=1e-2, warmup=2, log_every=1)


@pytest.fixture(scope="module")
def conversations(golden_target, workdir) -> Path:
    return write_jsonl(workdir / "train.jsonl", chain_conversations(next_token_table(*golden_target), 64, 40, seed=0))


def run(target_dir: Path, data: Path, out: Path, steps: int, **kw) -> list[dict]:
    rc = trainer.RunConfig(str(target_dir), (str(data),), str(out), steps=steps, **{**SETTINGS, **kw})
    trainer.train(rc)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_batch_is_laid_out_as_v1s_pipeline_lays_it(golden_dir):
    """From unshifted tokens and masks, `eagle1_batch` gives the golden v1 batch (made by v1's dataset and
    collator): ids and target features shifted one step left and zero-padded, the loss mask zero at each
    sequence's last token."""
    golden = dict(np.load(golden_dir / "eagle1_loss.npz"))
    attn = golden["attention_mask"]
    lengths = attn.sum(1)
    ids = np.zeros_like(golden["input_ids"])
    loss_mask = golden["loss_mask"].copy()
    for b, n in enumerate(lengths):
        ids[b, 0], ids[b, 1:n] = 5, golden["input_ids"][b, : n - 1]  # the first token is not in the v1 batch
        ids[b, n:] = 3  # our pad id, not v1's 0
        loss_mask[b, n - 1] = 1  # the answer's last token: v1 zeroes it
    hidden = golden["hidden_states"].copy()
    hidden[attn == 0] = 7.0  # what the target computes at padding: never read
    got = objective.eagle1_batch(*(jnp.asarray(x) for x in (hidden, ids, attn, loss_mask)))
    for name, x in zip(("hidden_states", "input_ids", "target", "attention_mask", "loss_mask"), got):
        want = golden[name]
        if name == "hidden_states":
            want = hidden
        np.testing.assert_array_equal(np.asarray(x), want, err_msg=name)


def test_noise_is_v1s_uniform_noise():
    """(U - 0.5) * 0.2 * 512 / L per sequence of length L: bounded by 51.2 / L, spread like a uniform variable."""
    hidden = jnp.zeros((2, 64, 256))
    attn = jnp.asarray(np.arange(64)[None, :] < np.array([[64], [16]])).astype(jnp.int32)
    noise = np.asarray(objective.uniform_noise(jax.random.key(0), hidden, attn))
    for b, n in enumerate((64, 16)):
        bound = 0.1 * 512 / n
        assert np.abs(noise[b]).max() <= bound and np.abs(noise[b]).max() > 0.99 * bound
        assert abs(noise[b].mean()) < 0.01 * bound
        np.testing.assert_allclose(noise[b].std(), 2 * bound / np.sqrt(12), rtol=0.02)


def test_the_optimiser_is_v1s(torch_or_skip):
    """Five updates equal torch's AdamW (betas (0.9, 0.95), its default weight decay) after clip_grad_value_(0.5)
    under transformers' linear warm-up schedule, as v1's main.py runs them."""
    torch = torch_or_skip
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(scale=2.0, size=(4, 3)).astype(np.float32) for _ in range(5)]  # many beyond +-0.5
    peak, warmup, steps = 1e-2, 2, 6

    w = torch.nn.Parameter(torch.tensor(w0))
    opt = torch.optim.AdamW([w], lr=peak, betas=(0.9, 0.95))

    def linear(count: int) -> float:  # transformers.get_linear_schedule_with_warmup
        if count < warmup:
            return count / max(1, warmup)
        return max(0.0, (steps - count) / max(1, steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
    for g in grads:
        opt.zero_grad()
        w.grad = torch.tensor(g)
        torch.nn.utils.clip_grad_value_([w], 0.5)
        opt.step()
        sched.step()

    optimizer = step.make_optimizer(peak, warmup, steps, recipe=step.EAGLE1_RECIPE)
    params = {"w": jnp.asarray(w0)}
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update({"w": jnp.asarray(g)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_allclose(np.asarray(params["w"]), w.detach().numpy(), rtol=1e-5, atol=1e-7)


@pytest.fixture
def torch_or_skip():
    return pytest.importorskip("torch")


def test_a_run_learns_resumes_and_exports_a_lossless_head(target_dir, conversations, golden_target, tmp_path):
    """Forty steps: the losses fall and the top-1 accuracy rises; a run cut after its step-20 checkpoint
    continues to the same losses (noise included); the export is an official EAGLE-1 folder that drafts for the
    target with greedy output equal to plain decoding's and more than one token per cycle."""
    out = tmp_path / "run"
    rows = run(target_dir, conversations, out, 40, save_every=20)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(len(r["acc"]) == 3 and r["acc"][0] <= r["acc"][1] <= r["acc"][2] for r in rows)
    loss = np.array([r["loss"] for r in rows])
    top1 = np.array([r["acc"][0] for r in rows])
    # observed: loss 1.37 -> 0.95, top-1 0.02 -> 0.42 (averages of the first / last 5 steps)
    assert loss[-5:].mean() < 0.8 * loss[:5].mean(), loss
    assert top1[-5:].mean() > top1[:5].mean() + 0.25, top1
    assert rows[0]["lr"] == 0.0  # v1's schedule: the first update at lr 0

    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    shutil.rmtree(cut / "ckpt" / "40")  # killed before the step-40 checkpoint was written
    rc = trainer.RunConfig(str(target_dir), (str(conversations),), str(cut), steps=40, save_every=20, **SETTINGS)
    trainer.train(rc)
    resumed = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == list(range(1, 41))
    for a, b in zip(rows[20:], resumed[20:]):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)

    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["bias"] is True
    assert "draft_vocab_size" not in config
    tcfg, tparams = golden_target
    dcfg, dparams = official.load_head(out / "export", tcfg, kind="eagle1")
    prompts = [[1, 17, 40, 9], [1, 300, 12]]
    tree = parse_envelopes("5/4/1")[0]
    result = generation.generate(tparams, dparams, prompts, 24, speculative.DecodeConfig(tcfg, dcfg, tree))
    assert result.tokens == plain_generate(tparams, tcfg, prompts, 24).tokens
    assert result.tau > 1.2  # observed 1.45: drafts accepted


def test_training_from_stored_features_equals_training_with_the_target(target_dir, conversations, tmp_path):
    """Four steps from a float32 store (on another mesh) give the online run's losses and accuracies, noise on."""
    store = tmp_path / "feats"
    features.extract(features.FeaturesConfig(str(target_dir), (str(conversations),), str(store), 64, dtype="fp32"))
    online = run(target_dir, conversations, tmp_path / "online", 4)
    offline = run(target_dir, conversations, tmp_path / "offline", 4, features=str(store), mesh="data=2,fsdp=4")
    for a, b in zip(online, offline):
        for name in ("loss", "vloss", "ploss", "grad_norm"):
            np.testing.assert_allclose(b[name], a[name], rtol=1e-5, err_msg=name)
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-9)


def test_bad_flags_and_another_kinds_run_are_one_line(target_dir, conversations, tmp_path, capsys):
    base = ["--target", str(target_dir), "--data", str(conversations), "--out", str(tmp_path / "o")]

    def last_error(main, *args) -> tuple[int, str]:
        code = main([*base, *map(str, args)])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "\r" not in line]
        return code, lines[-1]

    code, line = last_error(eagle1.main, "--ttt-steps", 3)
    assert code == 2 and line.startswith("error:") and "--ttt-steps" in line
    code, line = last_error(eagle1.main, "--draft-vocab-size", 64)
    assert code == 2 and "--draft-vocab-size" in line
    (tmp_path / "o").mkdir()
    started = eagle3.parse_args(base)
    (tmp_path / "o" / "run.json").write_text(json.dumps(dataclasses.asdict(started)))
    code, line = last_error(eagle1.main)
    assert code == 2 and "python -m train.eagle3 (this is train.eagle1)" in line and "use a new --out" in line
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["run.json"]


def test_a_run_from_before_the_head_kind_was_recorded_resumes_as_eagle3(target_dir, conversations, tmp_path):
    """run.json files written before `kind` and `noise` existed hold neither: they are EAGLE-3 runs and resume."""
    rc = eagle3.parse_args(["--target", str(target_dir), "--data", str(conversations), "--out", str(tmp_path)])
    saved = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(rc))).items() if k not in ("kind", "noise")}
    (tmp_path / "run.json").write_text(json.dumps(saved))
    loop.check_resume(rc, tmp_path, trainer.RESUME_KEYS)
    with pytest.raises(loop.RunMismatch, match="kind='eagle3' \\(now 'eagle1'\\)"):
        loop.check_resume(dataclasses.replace(rc, kind="eagle1"), tmp_path, trainer.RESUME_KEYS)

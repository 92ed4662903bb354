"""Plain generation: parity with transformers, eos stopping, sampling distribution, compile counts."""

import dataclasses
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import plain_generate

from eagle_jax.decoding import schedule
from eagle_jax.decoding.sampling import SamplingConfig, argmax, processed_probs, sample
from eagle_jax.errors import EagleError
from eagle_jax.io import hf

N_GREEDY = 80
CAPACITY = 128  # one capacity for all golden tests: fewer distinct compiles


@pytest.fixture(scope="module")
def golden_prompts(reference):
    return [reference[f"p{i}.input_ids"].tolist() for i in range(4)]


def golden_continuation(reference, i: int) -> list[int]:
    ids = reference[f"p{i}.greedy_ids"].tolist()
    return ids[len(reference[f"p{i}.input_ids"]) :]


# --- greedy parity ---------------------------------------------------------------------------


def test_golden_greedy_matches_hf(golden_target, golden_prompts, reference):
    cfg, params = golden_target
    for i, prompt in enumerate(golden_prompts):
        res = plain_generate(params, cfg, [prompt], N_GREEDY, capacity=CAPACITY)
        assert res.tokens[0] == golden_continuation(reference, i), f"prompt {i}"
        assert res.stop_reasons == ["length"]
    res = plain_generate(params, cfg, golden_prompts, N_GREEDY, capacity=CAPACITY)
    for i in range(4):
        assert res.tokens[i] == golden_continuation(reference, i), f"batched row {i}"


@pytest.fixture(scope="module")
def hf_gqa(tmp_path_factory):
    """A tiny random HF Llama with grouped-query attention, saved and reloaded through hf_io."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    path = tmp_path_factory.mktemp("hf_gqa")
    model.save_pretrained(path)
    return model, hf.load_target(path)


def test_random_gqa_greedy_matches_hf(hf_gqa):
    import torch

    model, (cfg, params) = hf_gqa
    assert cfg.num_kv_heads < cfg.num_heads
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (3, 9, 17)]
    expected = []
    for p in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=24)
        expected.append(seq[0, len(p) :].tolist())
    for p, want in zip(prompts, expected):
        assert plain_generate(params, cfg, [p], 24).tokens[0] == want
    assert plain_generate(params, cfg, prompts, 24).tokens == expected


# --- stopping and capacity -------------------------------------------------------------------


def test_eos_stops_row_and_keeps_eos(golden_target, golden_prompts, reference):
    cfg, params = golden_target
    cont0, cont1 = golden_continuation(reference, 0)[:30], golden_continuation(reference, 1)
    eos = next(t for t in cont1[3:] if t not in cont0)  # row 1 hits it, row 0 never does
    stop = cont1.index(eos)
    res = plain_generate(
        params, dataclasses.replace(cfg, eos_token_ids=(eos,)), golden_prompts[:2], 30, capacity=CAPACITY
    )
    assert res.tokens[0] == cont0 and res.stop_reasons[0] == "length"
    assert res.tokens[1] == cont1[: stop + 1] and res.stop_reasons[1] == "eos"


def test_capacity_errors_and_clamping(golden_target, golden_prompts, reference):
    cfg, params = golden_target
    with pytest.raises(EagleError, match="40 tokens does not fit the cache capacity 40"):
        plain_generate(params, cfg, [golden_prompts[3]], 5, capacity=40)
    with pytest.warns(UserWarning, match="clamped to 3"):  # each cycle commits its root: prompt + 3 + 1 slots
        res = plain_generate(params, cfg, [golden_prompts[3]], 10, capacity=44)
    assert res.tokens[0] == golden_continuation(reference, 3)[:3]
    with pytest.raises(EagleError):
        plain_generate(params, cfg, [[]], 5)


def test_prompt_bucket():
    lengths = (1, 16, 17, 24, 25, 32, 33, 48, 49, 65, 97, 100, 300)
    assert [schedule.prompt_bucket(n) for n in lengths] == [16, 16, 24, 24, 32, 32, 48, 48, 64, 96, 128, 128, 384]
    assert schedule.prompt_bucket(100, capacity=120) == 120


# --- sampling --------------------------------------------------------------------------------


def numpy_processed_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Direct float64 reference: temperature, then top-k (ties with the k-th kept), then the smallest
    prefix (probability descending, ties by lower id) whose mass reaches top_p."""
    out = []
    for row in np.asarray(logits, np.float64):
        x = row / temperature
        if 0 < top_k < x.size:
            x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
        p = np.exp(x - x.max())
        p /= p.sum()
        keep = np.zeros(x.size, bool)
        mass = 0.0
        for idx in sorted(range(x.size), key=lambda j: (-p[j], j)):
            keep[idx] = True
            mass += p[idx]
            if mass >= top_p:
                break
        p = np.where(keep, p, 0.0)
        out.append(p / p.sum())
    return np.stack(out)


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [
        (1.0, 0, 1.0),
        (0.7, 0, 1.0),
        (1.3, 5, 1.0),
        (1.0, 0, 0.55),
        (0.8, 12, 0.9),
        (2.0, 1, 0.3),
    ],
)
def test_processed_probs_match_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    logits = np.round(rng.normal(0, 2, (16, 40)) * 2) / 2  # a coarse grid, so ties occur
    got = np.asarray(processed_probs(jnp.asarray(logits), SamplingConfig(temperature, top_p, top_k)))
    np.testing.assert_allclose(got, numpy_processed_probs(logits, temperature, top_k, top_p), atol=1e-6)


def test_processed_probs_match_hf_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = np.random.default_rng(2).normal(0, 3, (8, 64)).astype(np.float32)
    scores = torch.tensor(logits)
    for warper in (TemperatureLogitsWarper(0.6), TopKLogitsWarper(10), TopPLogitsWarper(0.8)):
        scores = warper(None, scores)
    want = torch.softmax(scores, -1).numpy()
    got = processed_probs(jnp.asarray(logits), SamplingConfig(0.6, top_p=0.8, top_k=10))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_greedy_probs_and_sample_are_argmax():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(4, 3, 50)), jnp.float32)
    sc = SamplingConfig()
    np.testing.assert_array_equal(np.asarray(sample(jax.random.key(0), logits, sc)), np.argmax(logits, -1))
    np.testing.assert_array_equal(np.asarray(processed_probs(logits, sc)), jax.nn.one_hot(np.argmax(logits, -1), 50))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_matches_jnp_argmax_with_ties_inf_and_nan(dtype):
    rng = np.random.default_rng(4)
    x = rng.integers(-3, 4, size=(6, 4096)).astype(np.float32)  # many ties: the first index must win
    x[1] = -np.inf
    x[2, [7, 900]] = np.inf
    x[3, [5, 3000]] = np.nan
    x[4, 4095] = 10.0
    x = jnp.asarray(x, dtype)
    np.testing.assert_array_equal(np.asarray(argmax(x)), np.asarray(jnp.argmax(x, axis=-1)))
    assert argmax(x).dtype == jnp.int32


def chi2_quantile(q: float, df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (a few % high for df < 7)."""
    z = statistics.NormalDist().inv_cdf(q)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square_ok(draws: np.ndarray, probs: np.ndarray, alpha: float = 1e-6) -> bool:
    """Pearson chi-square of draws against probs, at significance alpha; zero-probability draws fail."""
    counts = np.bincount(draws, minlength=probs.size)
    support = probs > 0
    if counts[~support].any():
        return False
    expected = probs[support] * draws.size
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat < chi2_quantile(1 - alpha, int(support.sum()) - 1)


SC_STAT = SamplingConfig(temperature=1.5, top_p=0.95, top_k=8)


def test_sample_distribution_matches_processed_probs(reference):
    logits = jnp.asarray(reference["p1.logits"][-1])  # the golden target's first-token logits
    probs = np.asarray(processed_probs(logits, SC_STAT), np.float64)
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = np.asarray(jax.vmap(lambda k: sample(k, logits, SC_STAT))(keys))
    assert 3 <= (probs > 0).sum() <= 8
    assert chi_square_ok(draws, probs)
    plain = np.asarray(jax.nn.softmax(logits), np.float64)  # the test can tell distributions apart
    assert not chi_square_ok(draws, plain)


def test_generate_first_token_distribution(golden_target, golden_prompts, reference):
    cfg, params = golden_target
    res = plain_generate(params, cfg, [golden_prompts[1]] * 1024, 1, sampling=SC_STAT, seed=5, capacity=16)
    draws = np.array([t[0] for t in res.tokens])
    probs = np.asarray(processed_probs(jnp.asarray(reference["p1.logits"][-1]), SC_STAT), np.float64)
    assert chi_square_ok(draws, probs)


def test_sampling_reproducible_per_seed(golden_target, golden_prompts):
    cfg, params = golden_target
    sc = SamplingConfig(temperature=1.0, top_p=0.9)

    def run(seed: int) -> list[list[int]]:
        return plain_generate(params, cfg, golden_prompts[:2], 20, sampling=sc, seed=seed, capacity=CAPACITY).tokens

    first = run(7)
    assert run(7) == first
    assert run(8) != first
    assert all(len(t) == 20 for t in first)


# --- compilation -----------------------------------------------------------------------------


@pytest.fixture
def compile_log():
    names: list[str] = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield names
    jax.monitoring.unregister_event_duration_listener(listener)


def test_no_recompilation_within_bucket(golden_target, compile_log):
    cfg, params = golden_target
    rng = np.random.default_rng(4)

    def prompt(n: int) -> list[int]:
        return [1] + rng.integers(3, cfg.vocab_size, n - 1).tolist()

    plain_generate(params, cfg, [prompt(26), prompt(18)], 8)  # warm-up: bucket 32, capacity 128
    compile_log.clear()
    plain_generate(params, cfg, [prompt(27), prompt(31)], 8)  # new lengths, same bucket
    plain_generate(params, cfg, [prompt(17), prompt(30)], 60, seed=3)  # more decode steps, new seed
    assert compile_log == []
    plain_generate(params, cfg, [prompt(200), prompt(18)], 8)  # a larger cache: compiles (the counter works)
    assert compile_log, "a larger cache compiles"

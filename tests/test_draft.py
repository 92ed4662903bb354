"""Draft heads: official checkpoints in, exact behaviour out, clear errors for bad heads."""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tiny import tiny_target_config

from eagle_jax.errors import EagleError
from eagle_jax.io import official
from eagle_jax.models import draft, target

TOP_K = {"t60_d7_k10": 10, "t16_d4_k4": 4}


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_level_one_matches_golden_first_tree(kind, golden_dir, golden_target, reference):
    """Level-1 nodes of the golden first tree are, in order, a prefix of the draft's top-k at the last position."""
    tcfg, tparams = golden_target
    dcfg, dparams = official.load_head(golden_dir / kind, tcfg)
    assert dcfg.kind == kind
    for i in range(4):
        ids = jnp.asarray(reference[f"p{i}.input_ids"])[None]
        n = ids.shape[1]
        out = target.forward(
            tparams,
            tcfg,
            ids,
            jnp.arange(n)[None],
            target.init_cache(tcfg, 1, n),
            feature_layers=dcfg.feature_layers(tcfg),
        )
        root = jnp.argmax(out.logits[:, -1], axis=-1)
        features = out.features if kind == "eagle3" else out.hidden
        tokens = jnp.concatenate([ids[:, 1:], root[:, None]], axis=1)  # feature t pairs with token t+1
        hidden, _ = draft.forward(
            dparams,
            dcfg,
            tparams["embed"],
            tokens,
            draft.project_features(dparams, dcfg, features),
            jnp.arange(n)[None],
            draft.init_cache(dcfg, 1, n),
        )
        for setting, k in TOP_K.items():
            pre = f"{kind}.{setting}.p{i}.tree0."
            assert int(root[0]) == int(reference[pre + "sample_token"].ravel()[0])
            level1 = reference[pre + "draft_tokens"][0][reference[pre + "tree_position_ids"] == 1]
            ids_k, logp = draft.top_k(dparams, dcfg, hidden[:, -1], target.output_head(tparams, tcfg), k)
            assert np.asarray(ids_k[0, : len(level1)]).tolist() == level1.tolist()
            assert np.all(np.diff(np.asarray(logp[0])) <= 0)


def test_eagle3_vocab_map_and_keys(golden_dir, golden_target):
    tcfg, _ = golden_target
    dcfg, dparams = official.load_head(golden_dir / "eagle3", tcfg)
    assert (dcfg.draft_vocab_size, dcfg.vocab_size, dcfg.has_vocab_map) == (256, 1024, True)
    raw = load_file(golden_dir / "eagle3" / "model.safetensors")
    used = np.nonzero(raw["t2d"])[0]
    np.testing.assert_array_equal(draft.to_target_ids(dparams, dcfg, jnp.arange(256)), used)
    back = official.tensors_from_params(dparams, dcfg)
    assert set(back) == set(raw)
    for key in raw:
        assert back[key].dtype == raw[key].dtype and back[key].shape == raw[key].shape
        np.testing.assert_array_equal(back[key], raw[key])


def test_bin_and_safetensors_load_the_same(golden_dir, golden_target, tmp_path):
    pytest.importorskip("torch", reason="reading pytorch_model.bin needs the optional torch extra")
    tcfg, _ = golden_target
    only_bin = tmp_path / "eagle1"
    only_bin.mkdir()
    for name in ("config.json", "pytorch_model.bin"):
        shutil.copy(golden_dir / "eagle1" / name, only_bin / name)
    _, from_bin = official.load_head(only_bin, tcfg)
    _, from_st = official.load_head(golden_dir / "eagle1", tcfg)
    np.testing.assert_array_equal(from_bin["fc"], from_st["fc"])
    np.testing.assert_array_equal(from_bin["layers"][0]["mlp"]["down"], from_st["layers"][0]["mlp"]["down"])
    assert from_bin["layers"][0].keys() == from_st["layers"][0].keys()


def _copy_head(golden_dir, tmp_path, kind="eagle3"):
    head = tmp_path / kind
    head.mkdir()
    shutil.copy(golden_dir / kind / "config.json", head / "config.json")
    return head, load_file(golden_dir / kind / "model.safetensors")


def _one_line_error(fn) -> str:
    with pytest.raises(EagleError) as exc:
        fn()
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_truncated_head_file(golden_dir, golden_target, tmp_path):
    tcfg, _ = golden_target
    head, _ = _copy_head(golden_dir, tmp_path)
    data = (golden_dir / "eagle3" / "model.safetensors").read_bytes()
    (head / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated" in _one_line_error(lambda: official.load_head(head, tcfg))


def test_renamed_key(golden_dir, golden_target, tmp_path):
    tcfg, _ = golden_target
    head, tensors = _copy_head(golden_dir, tmp_path)
    tensors["midlayer.self_attn.q_proj.weightX"] = tensors.pop("midlayer.self_attn.q_proj.weight")
    save_file(tensors, head / "model.safetensors")
    message = _one_line_error(lambda: official.load_head(head, tcfg))
    assert "missing midlayer.self_attn.q_proj.weight" in message
    assert "unexpected midlayer.self_attn.q_proj.weightX" in message


def test_mis_shaped_key(golden_dir, golden_target, tmp_path):
    tcfg, _ = golden_target
    head, tensors = _copy_head(golden_dir, tmp_path)
    tensors["norm.weight"] = np.ones(64, np.float32)
    save_file(tensors, head / "model.safetensors")
    assert "mis-shaped norm.weight (64,)" in _one_line_error(lambda: official.load_head(head, tcfg))


def test_head_for_another_target(golden_dir):
    wide = tiny_target_config("llama", vocab=1024, hidden=256, heads=4, kv_heads=2)
    message = _one_line_error(lambda: official.load_head(golden_dir / "eagle3", wide))
    assert "does not fit the target" in message and "256" in message and "128" in message
    other_vocab = tiny_target_config("llama", vocab=2048, hidden=128, heads=4, kv_heads=2)
    assert "vocab_size 1024 vs target 2048" in _one_line_error(
        lambda: official.load_head(golden_dir / "eagle1", other_vocab)
    )


def test_forced_kind_mismatch(golden_dir, golden_target):
    tcfg, _ = golden_target
    message = _one_line_error(lambda: official.load_head(golden_dir / "eagle1", tcfg, kind="eagle3"))
    assert "EAGLE1 head" in message and "EAGLE3 was requested" in message
    assert official.load_head(golden_dir / "eagle1", tcfg, kind="eagle1")[0].kind == "eagle1"


def test_missing_files(golden_dir, golden_target, tmp_path):
    tcfg, _ = golden_target
    assert "not found" in _one_line_error(lambda: official.load_head(tmp_path / "nope", tcfg))
    head, _ = _copy_head(golden_dir, tmp_path)
    assert "no weights found" in _one_line_error(lambda: official.load_head(head, tcfg))
    (head / "config.json").unlink()
    save_file(load_file(golden_dir / "eagle3" / "model.safetensors"), head / "model.safetensors")
    assert "config.json: file not found" in _one_line_error(lambda: official.load_head(head, tcfg))


def test_eagle1_bias_flag(golden_dir, golden_target, tmp_path):
    """`bias` defaults to true; with bias false, an fc.bias tensor is unexpected."""
    tcfg, _ = golden_target
    head, tensors = _copy_head(golden_dir, tmp_path, "eagle1")
    cfg = json.loads((head / "config.json").read_text())
    cfg["bias"] = False
    (head / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, head / "model.safetensors")
    assert "unexpected fc.bias" in _one_line_error(lambda: official.load_head(head, tcfg))
    del cfg["bias"]
    (head / "config.json").write_text(json.dumps(cfg))
    assert "fc_bias" in official.load_head(head, tcfg)[1]

"""EAGLE-1 training objective: parity with the official v1 code (`eagle/train/main.py`).

`golden/eagle1_loss.npz` holds one forward and backward of the official v1 head and loss on the golden target
and EAGLE-1 head (made by `tools/golden/make_eagle1_loss.py`): a right-padded batch of two sequences the target
continues greedily, as v1's pipeline hands it. Losses, accuracies and every gradient must match.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ttt import _flat_get

from eagle_jax.io import official
from eagle_jax.training import objective

NAMES = ("hidden_states", "input_ids", "target", "attention_mask", "loss_mask")


@pytest.fixture(scope="module")
def golden(golden_dir):
    return dict(np.load(golden_dir / "eagle1_loss.npz"))


@pytest.mark.parametrize("groups", [None, 1, 2], ids=["everywhere", "loss_positions", "per_sequence"])
def test_eagle1_loss_matches_official(golden_dir, golden_target, golden, groups):
    """Read out everywhere, or only at the loss mask's positions (`loss_positions`, as training does: in one group,
    or one per sequence as on a data=2 mesh): the official values either way."""
    tcfg, tparams = golden_target
    dcfg, dparams = official.load_head(golden_dir / "eagle1", tcfg)
    batch = tuple(jnp.asarray(golden[n]) for n in NAMES)
    loss_at = None if groups is None else objective.loss_positions(golden["loss_mask"], groups)
    assert loss_at is None or loss_at.size < golden["loss_mask"].size  # fewer positions read out

    def loss(p):
        return objective.eagle1_loss(p, dcfg, tparams["lm_head"], tparams["embed"], *batch, loss_at)

    (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(jax.tree.map(jnp.asarray, dparams))
    np.testing.assert_allclose(value, golden["loss"], rtol=1e-5)
    for name in ("vloss", "ploss"):
        np.testing.assert_allclose(metrics[name], golden[name], rtol=1e-5)
    for k in ("top1", "top2", "top3"):
        np.testing.assert_allclose(metrics[k], golden[k], atol=1e-9)
    assert 0 < golden["top1"] < 1  # a head that predicts some positions and misses others

    ours = {theirs: (name, transposed) for name, (theirs, transposed) in official.official_names(dcfg).items()}
    theirs_grads = {k.removeprefix("grad/"): v for k, v in golden.items() if k.startswith("grad/")}
    assert sorted(theirs_grads) == sorted(ours)  # every trainable tensor, the frozen embedding not among them
    total = 0.0
    for theirs, ref in theirs_grads.items():
        name, transposed = ours[theirs]
        g = _flat_get(grads, name)
        g = g.T if transposed else g
        assert np.abs(g - ref).max() <= 1e-5 * np.linalg.norm(ref), theirs
        total += float(np.sum(np.square(g.astype(np.float64))))
    np.testing.assert_allclose(np.sqrt(total), golden["grad_norm"], rtol=1e-5)


def test_eagle1_loss_counts_only_masked_positions(golden_dir, golden_target, golden):
    """Changing the target feature where the loss mask is 0 changes nothing; where it is 1, the loss moves."""
    tcfg, tparams = golden_target
    dcfg, dparams = official.load_head(golden_dir / "eagle1", tcfg)
    batch = {n: jnp.asarray(golden[n]) for n in NAMES}
    args = (dparams, dcfg, tparams["lm_head"], tparams["embed"])
    base = objective.eagle1_loss(*args, *batch.values())[0]
    masked_out = np.argwhere(np.asarray(batch["loss_mask"]) == 0)[0]
    counted = np.argwhere(np.asarray(batch["loss_mask"]) == 1)[0]
    for (b, t), moves in ((masked_out, False), (counted, True)):
        changed = dict(batch, target=batch["target"].at[b, t].add(3.0))
        value = objective.eagle1_loss(*args, *changed.values())[0]
        assert (abs(float(value) - float(base)) > 1e-4) == moves

"""Training objectives with the official conventions: EAGLE-3's training-time test (TTT, traineagle3) and
EAGLE-1's feature regression (`eagle1_loss`, the v1 branch's `eagle/train/main.py`).

EAGLE-3 (TTT):

For a right-padded batch, the frozen target gives fused features [B, T, 3Ht] and logits [B, T, V]
(`target_batch`), or they come from a store (`eagle_jax.training.features`: the logits of the draft
vocabulary rebuilt from the final hidden states, `Targets`). The draft then runs `steps` steps
(`ttt_loss`); `shift(x, k)[t] = x[t+k]`, zero past the end. At step j, position t:
- token `shift(input_ids, j+1)`, hidden input fc(features) at j = 0 and the previous step's pre-norm
  output afterwards, rope position t + j (base and scaling from the head's config);
- attention: the step-0 keys at s <= t with attention_mask[s] = 1, plus the keys of steps 1..j at the
  same t, under one softmax;
- target `p = softmax(shift(target_logits, j+1)[..., draft columns])` (increasing target id), gated by
  `t2d[argmax over the full vocab] * shift(loss_mask, j)` (the mask is *not* shifted with the target);
- loss `-sum(mask * sum(p * log_softmax(draft logits))) / (B*T)` (a mean over all positions);
  accuracy `sum(mask * [argmax draft == argmax p]) / (sum shift(loss_mask, j) + 1e-6)`.
Total loss `sum_j step_weight**j * loss_j`. Gradients reach only the draft's float parameters.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decoding.sampling import argmax
from eagle_jax.errors import EagleError
from eagle_jax.models import draft, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.layers import attend, linear
from eagle_jax.models.params import is_spec

VOCAB_MAP_KEYS = ("d2t", "t2d")


def padded_causal(attention_mask: jax.Array) -> jax.Array:
    """[B, T, T]: causal plus key padding for a right-padded batch (a padded query sees the real prefix)."""
    b, t = attention_mask.shape
    return target.causal_mask(b, t) & attention_mask.astype(bool)[:, None, :]


def target_outputs(
    target_params: dict,
    tcfg: TargetConfig,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    feature_layers: tuple[int, ...],
    compute_logits: bool = True,
) -> target.TargetOutput:
    """Frozen target on a right-padded batch [B, T]: its output (features [B, T, 3Ht] of the head's
    `feature_layers`, logits [B, T, V] f32 unless not `compute_logits`, final normed hidden states [B, T, Ht]),
    without gradients.

    Mask: causal plus key padding (a padded query sees the real prefix, not itself); positions 0..T-1.
    """
    b, t = input_ids.shape
    mask = padded_causal(attention_mask)  # [B, T, T]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = target.init_cache(tcfg, b, t, target_params["embed"].dtype)
    out = target.forward(
        target_params,
        tcfg,
        input_ids,
        positions,
        cache,
        mask,
        feature_layers=feature_layers,
        compute_logits=compute_logits,
    )
    return jax.lax.stop_gradient(out)


def target_batch(
    target_params: dict,
    tcfg: TargetConfig,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    feature_layers: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:
    """(features [B, T, 3Ht], logits [B, T, V] f32) of `target_outputs`."""
    out = target_outputs(target_params, tcfg, input_ids, attention_mask, feature_layers)
    return out.features, out.logits


def draft_columns(draft_params: dict, dcfg: DraftConfig) -> jax.Array:
    """Target ids of the draft vocabulary in draft-id order [Vd] (= the t2d columns, increasing)."""
    vocab_map = {k: jnp.asarray(draft_params[k]) for k in VOCAB_MAP_KEYS if k in draft_params}
    return draft.to_target_ids(vocab_map, dcfg, jnp.arange(dcfg.draft_vocab_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Targets:
    """The target's side of the TTT objective one position after each of `loss_at` (zero past the end)."""

    draft_logits: jax.Array  # [G, K, Vd] f32: the logits of the draft vocabulary's tokens
    argmax: jax.Array  # [G, K] int32: the argmax over the full vocabulary


def loss_positions(loss_mask: np.ndarray, groups: int = 1, parts: int = 4) -> np.ndarray:
    """`loss_at` of a batch (host side) [G, K]: the batch's sequences in `groups` groups of B / G (a data-parallel
    shard's each), and each group's loss-mask positions r * T + t (r its r-th sequence) in order, padded with
    B / G * T (none) to the largest group's count rounded up to a multiple of B / G * T / `parts` (so a batch
    shape compiles at most `parts` programs). Only these positions pay for the readout in `ttt_loss` and
    `eagle1_loss`."""
    b, t = loss_mask.shape
    flat = np.asarray(loss_mask).reshape(groups, b // groups * t)
    quantum = -(-flat.shape[1] // parts)
    at = [np.flatnonzero(m) for m in flat]
    k = min(flat.shape[1], max(1, -(-max(map(len, at)) // quantum)) * quantum)
    return np.stack([np.pad(a, (0, k - len(a)), constant_values=flat.shape[1]) for a in at]).astype(np.int32)


def _everywhere(b: int, t: int) -> jax.Array:
    """`loss_at` reading out every position of a [B, T] batch, in one group: [1, B * T]."""
    return jnp.arange(b * t)[None]


def _take(x: jax.Array, at: jax.Array) -> jax.Array:
    """x [B, T, ...] at the group positions at [G, K] (`loss_positions`; out of range: zero) -> [G, K, ...]."""
    g = at.shape[0]
    x = x.reshape((g, -1) + x.shape[2:])  # [G, B / G * T, ...]
    return x.at[jnp.arange(g)[:, None], at].get(mode="fill", fill_value=0)


def _after(x: jax.Array, loss_at: jax.Array) -> jax.Array:
    """x [B, T, ...] one position after each of `loss_at` [G, K] (zero past the end of a sequence) -> [G, K, ...]."""
    t = x.shape[1]
    return _take(x, jnp.where(loss_at % t == t - 1, x.shape[0] * t, loss_at + 1))


def targets_from_logits(draft_params: dict, dcfg: DraftConfig, logits: jax.Array, loss_at: jax.Array) -> Targets:
    """From the target's logits [B, T, V] (the online step), after each of `loss_at` [G, K]."""
    logits = _after(jax.lax.stop_gradient(logits).astype(jnp.float32), loss_at)  # [G, K, V]
    return Targets(jnp.take(logits, draft_columns(draft_params, dcfg), axis=-1), argmax(logits))


def targets_from_hidden(
    draft_params: dict,
    dcfg: DraftConfig,
    output_head: jax.Array,
    hidden: jax.Array,
    full_argmax: jax.Array,
    loss_at: jax.Array,
) -> Targets:
    """From stored final normed hidden states [B, T, Ht] and full-vocabulary argmax [B, T] (the offline step),
    after each of `loss_at` [G, K]: the draft vocabulary's columns of the target's readout `output_head` [Ht, V],
    accumulated in f32."""
    columns = jnp.take(jax.lax.stop_gradient(output_head), draft_columns(draft_params, dcfg), axis=1)  # [Ht, Vd]
    hidden = _after(hidden, loss_at).astype(columns.dtype)  # [G, K, Ht]
    return Targets(linear(hidden, columns, out_dtype=jnp.float32), _after(full_argmax, loss_at))


def _step_targets(draft_params: dict, dcfg: DraftConfig, targets: Targets):
    """p [G, K, Vd], argmax p [G, K] and t2d[argmax of the full logits] [G, K] bool of `targets`."""
    draft_params = jax.tree.map(jnp.asarray, draft_params)
    p = jax.nn.softmax(targets.draft_logits, axis=-1)  # [G, K, Vd]
    in_vocab = draft_params["t2d"][targets.argmax] if dcfg.has_vocab_map else jnp.ones(targets.argmax.shape, bool)
    return p, argmax(p), in_vocab


def _pad_end(x: jax.Array, n: int, fill) -> jax.Array:
    """Append n rows of `fill` along the time axis: [B, T, ...] -> [B, T + n, ...]."""
    x = jnp.asarray(x)
    return jnp.concatenate([x, jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)], axis=1)


def position_masks(
    draft_params: dict, dcfg: DraftConfig, target_logits: jax.Array, loss_mask: jax.Array, steps: int = 7
) -> jax.Array:
    """position_mask_j [steps, B, T] f32: t2d[argmax shift(target_logits, j+1)] * shift(loss_mask, j)."""
    b, t = loss_mask.shape
    targets = targets_from_logits(draft_params, dcfg, target_logits, _everywhere(b, t))
    _, _, in_vocab = _step_targets(draft_params, dcfg, targets)
    gate = _pad_end(in_vocab.reshape(b, t) * jnp.asarray(loss_mask, jnp.float32), steps, 0.0)  # [B, T + S]
    return jnp.stack([gate[:, j : j + t] for j in range(steps)])  # [S, B, T]


def _ttt_attend(
    q: jax.Array, k0: jax.Array, v0: jax.Array, mask0: jax.Array, kd: jax.Array, vd: jax.Array
) -> jax.Array:
    """Attention of a step-j query q [B, T, N, D] over the union, under one softmax, of
    - the step-0 keys/values k0, v0 [B, T, KV, D] allowed by mask0 [B, T, T], and
    - the keys/values of steps 1..j at the query's own position, kd, vd [B, j, T, KV, D].  -> [B, T, N, D]."""
    b, t, n, d = q.shape
    kv = k0.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    floor = jnp.finfo(jnp.float32).min
    block = jnp.einsum("btkgd,bskd->bkgts", q, k0, preferred_element_type=jnp.float32) / math.sqrt(d)
    block = jnp.where(mask0[:, None, None], block, floor)  # [B, KV, G, T, T]
    diag = jnp.einsum("btkgd,bjtkd->bkgtj", q, kd, preferred_element_type=jnp.float32) / math.sqrt(d)  # [.., T, j]
    # softmax over [block, diag] without concatenating them
    top = jax.lax.stop_gradient(jnp.maximum(block.max(-1, keepdims=True), diag.max(-1, keepdims=True)))
    e_block, e_diag = jnp.exp(block - top), jnp.exp(diag - top)
    norm = e_block.sum(-1, keepdims=True) + e_diag.sum(-1, keepdims=True)
    p_block, p_diag = (e_block / norm).astype(v0.dtype), (e_diag / norm).astype(v0.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p_block, v0) + jnp.einsum("bkgtj,bjtkd->btkgd", p_diag, vd)
    return out.reshape(b, t, n, d)


@jax.custom_vjp
def soft_cross_entropy(logits: jax.Array, p: jax.Array, mask: jax.Array) -> jax.Array:
    """-sum(mask * sum(p * log_softmax(logits))) for logits and targets p [..., V] f32 and a mask [...].

    Its gradient, mask * (softmax(logits) * sum(p) - p), is one elementwise pass over [..., V] (autodiff's
    log_softmax backward takes several, and on XLA:CPU they dominated a TTT step's time outside the matmuls);
    p and the mask get none."""
    return _sce_fwd(logits, p, mask)[0]


def _sce_fwd(logits: jax.Array, p: jax.Array, mask: jax.Array):
    logq = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(mask * jnp.sum(p * logq, axis=-1)), (logq, p, mask)


def _sce_bwd(residuals, g):
    logq, p, mask = residuals
    dlogits = (g * mask)[..., None] * (jnp.exp(logq) * jnp.sum(p, axis=-1, keepdims=True) - p)
    return dlogits, None, None


soft_cross_entropy.defvjp(_sce_fwd, _sce_bwd)


def ttt_loss(
    draft_params: dict,
    dcfg: DraftConfig,
    embed: jax.Array,
    features: jax.Array,
    targets: jax.Array | Targets,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    loss_mask: jax.Array,
    loss_at: jax.Array | None = None,
    steps: int = 7,
    step_weight: float = 0.8,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Official EAGLE-3 TTT objective -> (sum_j step_weight**j * plosses[j] (f32), metrics).

    embed [V, H] (frozen target embedding), features [B, T, 3Ht], targets (the target's logits [B, T, V] or
    `Targets` after `loss_at`), input_ids / attention_mask / loss_mask [B, T]. `loss_at` [G, K]
    (`loss_positions`): positions that hold every loss-mask position of each group of B / G sequences (default: all
    positions, one group); step j reads the draft out only at p - j for each p of them, where its loss can reach.
    Metrics, each [steps]: `plosses` f32, `acces` f32 (`accuracies` gives the exact float64 values), `n_correct`,
    `n_counted` (positions with mask 1) and `loss_mask_sum` (the accuracy denominator without 1e-6), int32.
    The steps are unrolled (a few; each attends to a different number of earlier steps' keys, and a compiler's cost
    analysis counts every one). Jit with `static_argnames=("dcfg", "steps", "step_weight")`.
    """
    if dcfg.kind != "eagle3":
        raise EagleError(f"TTT trains EAGLE-3 heads, got a {dcfg.kind} config")
    if steps < 1:
        raise EagleError(f"steps={steps}: TTT needs at least one step")
    b, t = input_ids.shape
    p = draft_params["layers"][0]
    embed = jax.lax.stop_gradient(jnp.asarray(embed))
    loss_at = _everywhere(b, t) if loss_at is None else jnp.asarray(loss_at)  # [G, K]
    if not isinstance(targets, Targets):
        targets = targets_from_logits(draft_params, dcfg, targets, loss_at)
    probs, target_argmax, in_vocab = _step_targets(draft_params, dcfg, targets)  # [G, K, Vd], [G, K], [G, K]
    lm = _take(jnp.asarray(loss_mask, jnp.float32), loss_at)  # [G, K]: 0 for the padding
    position = loss_at % t  # [G, K]: in its sequence
    tokens = _pad_end(input_ids, steps, 0)  # [B, T + S]: step j reads [j+1, j+1+T) (the zero-filled shift)
    mask0 = padded_causal(attention_mask)  # [B, T, T]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def step_input(h: jax.Array, j: int):
        emb = embed[tokens[:, j + 1 : j + 1 + t]].astype(h.dtype)  # [B, T, H]
        return draft.qkv(p, dcfg, draft.eagle3_input(p, dcfg, emb, h), positions + j)

    def step_loss(h: jax.Array, j: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        lm_j = lm * (position >= j)  # [G, K]: shift(loss_mask, j) at the positions read out
        out = _take(h, jnp.where(position >= j, loss_at - j, b * t))  # [G, K, H]
        logits = draft.logits(draft_params, dcfg, out, None)  # [G, K, Vd] f32
        mask_j = in_vocab * lm_j
        loss = soft_cross_entropy(logits, probs, mask_j) / (b * t)
        hit = argmax(logits) == target_argmax
        count = lambda x: jnp.sum(x).astype(jnp.int32)  # noqa: E731
        return loss, count(hit * mask_j), count(mask_j), count(lm_j)

    features = jax.lax.stop_gradient(features).astype(draft_params["fc"].dtype)  # compute in the draft's dtype
    h = draft.project_features(draft_params, dcfg, features)  # [B, T, H]
    q, k0, v0 = step_input(h, 0)
    h = draft.post_attention(p, dcfg, attend(q, jnp.swapaxes(k0, 1, 2), jnp.swapaxes(v0, 1, 2), mask0), h)
    parts = [step_loss(h, 0)]
    kd, vd = [], []  # keys and values of steps 1..j, each [B, T, KV, D]
    for j in range(1, steps):
        q, k, v = step_input(h, j)
        kd.append(k)
        vd.append(v)
        h = draft.post_attention(p, dcfg, _ttt_attend(q, k0, v0, mask0, jnp.stack(kd, 1), jnp.stack(vd, 1)), h)
        parts.append(step_loss(h, j))
    plosses, n_correct, n_counted, lm_sums = (jnp.stack(xs) for xs in zip(*parts))
    total = jnp.sum(plosses * step_weight ** jnp.arange(steps, dtype=jnp.float32))
    metrics = {
        "plosses": plosses,
        "acces": n_correct.astype(jnp.float32) / (lm_sums.astype(jnp.float32) + 1e-6),
        "n_correct": n_correct,
        "n_counted": n_counted,
        "loss_mask_sum": lm_sums,
    }
    return total, metrics


def split_trainable(draft_params: dict) -> tuple[dict, dict]:
    """(trainable float parameters, frozen vocabulary map {'d2t', 't2d'} or {})."""
    trainable = {k: v for k, v in draft_params.items() if k not in VOCAB_MAP_KEYS}
    return trainable, {k: draft_params[k] for k in VOCAB_MAP_KEYS if k in draft_params}


def ttt_value_and_grad(draft_params: dict, dcfg: DraftConfig, *args, compute_dtype=None, **kwargs):
    """(total loss, metrics, grads); grads cover `split_trainable(draft_params)[0]`. Args as `ttt_loss`.

    compute_dtype: the draft computes in this dtype (e.g. bf16) from its parameters (the float32 master
    weights, which the gradients are taken against); default: their own dtype.
    """
    trainable, vocab_map = split_trainable(draft_params)

    def loss(tr: dict):
        if compute_dtype is not None:
            tr = jax.tree.map(lambda x: x.astype(compute_dtype), tr)
        return ttt_loss({**tr, **vocab_map}, dcfg, *args, **kwargs)

    (total, metrics), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
    return total, metrics, grads


def accuracies(metrics: dict) -> np.ndarray:
    """Per-step accuracies [steps] in float64, exactly as upstream: n_correct / (sum lm_j + 1e-6)."""
    return np.asarray(metrics["n_correct"], np.float64) / (np.asarray(metrics["loss_mask_sum"], np.float64) + 1e-6)


def simulated_tau(acces: jax.Array) -> jax.Array:
    """Acceptance length a chain draft would reach: 1 + sum_k prod_{i<=k} acc_i."""
    return 1.0 + jnp.sum(jnp.cumprod(jnp.asarray(acces)))


def ttt_flops(dcfg: DraftConfig, steps: int, lengths: np.ndarray, readouts: float | None = None) -> float:
    """Model FLOPs of a TTT training step on sequences of these real lengths [B] with `readouts` positions read out
    (the loss mask's; default every token): forward and backward, counted as 3x the forward's multiply-adds (fc
    once, the layer once per step on every token, the lm_head once per step on the read-out positions; attention
    over the causal prefix plus the step's earlier TTT keys). Padding and masked work are not counted."""
    specs = draft.param_specs(dcfg)

    def weights(tree) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(tree, is_leaf=is_spec) if len(s.shape) == 2)

    lengths = np.asarray(lengths, np.float64)
    tokens, pairs = lengths.sum(), (lengths * (lengths + 1) / 2).sum()
    readouts = tokens if readouts is None else readouts
    dense = tokens * (weights(specs["fc"]) + steps * weights(specs["layers"])) + readouts * steps * weights(
        specs["lm_head"]
    )
    attention = dcfg.num_heads * dcfg.head_dim * (steps * pairs + tokens * steps * (steps - 1) / 2)
    return 3 * 2 * float(dense + 2 * attention)


def smooth_l1(x: jax.Array) -> jax.Array:
    """Huber with beta 1 (torch's SmoothL1Loss): 0.5 x^2 where |x| < 1, else |x| - 0.5."""
    a = jnp.abs(x)
    return jnp.where(a < 1, 0.5 * x * x, a - 0.5)


def eagle1_loss(
    draft_params: dict,
    dcfg: DraftConfig,
    lm_head: jax.Array,
    embed: jax.Array,
    hidden_states: jax.Array,
    input_ids: jax.Array,
    target: jax.Array,
    attention_mask: jax.Array,
    loss_mask: jax.Array,
    loss_at: jax.Array | None = None,
    p_w: float = 0.1,
    v_w: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Official EAGLE-1 objective (v1 `eagle/train/main.py`) -> (v_w * vloss + p_w * ploss (f32), metrics).

    The batch as the v1 pipeline hands it, right-padded [B, T]: `hidden_states` [B, T, H] the target's final
    normed hidden states, `input_ids` and `target` [B, T, H] already shifted one step left and zero-padded,
    `loss_mask` with its last position zeroed. The head predicts the next feature from (feature_t, embedding
    of token t+1): causal attention over key padding, positions 0..T-1; `embed` and `lm_head` [H, V] are the
    frozen target's. With m = loss_mask and n = sum(m) + 1e-5:
    ploss = -sum(m * softmax(lm_head(target)) * log_softmax(lm_head(predict))) / n,
    vloss = sum over positions of m * mean over H of SmoothL1(predict - target) / n; metrics also hold the
    top-1/2/3 accuracies of lm_head(predict) against argmax lm_head(target) over the masked positions, their
    counts `n_correct` [3] and `loss_mask_sum`. `loss_at` [G, K] (`loss_positions`: every position of the loss
    mask, in groups of B / G sequences; default all positions): only they go through the lm_head.
    """
    b, t = input_ids.shape
    mask = padded_causal(attention_mask)  # [B, T, T]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = draft.init_cache(dcfg, b, t, hidden_states.dtype)
    predict, _ = draft.forward(draft_params, dcfg, embed, input_ids, hidden_states, positions, cache, mask)
    m = loss_mask.astype(jnp.float32)[..., None]  # [B, T, 1]
    n = jnp.sum(m) + 1e-5
    diff = predict.astype(jnp.float32) - target.astype(jnp.float32)
    vloss = jnp.sum(jnp.mean(m * smooth_l1(diff), axis=-1)) / n
    loss_at = _everywhere(b, t) if loss_at is None else jnp.asarray(loss_at)  # [G, K]
    out_logits = draft.logits(draft_params, dcfg, _take(predict, loss_at), lm_head)  # [G, K, V] f32
    target_logits = jax.lax.stop_gradient(draft.logits(draft_params, dcfg, _take(target, loss_at), lm_head))
    m_at = _take(m, loss_at)  # [G, K, 1]
    ploss = -jnp.sum(m_at * jax.nn.softmax(target_logits, -1) * jax.nn.log_softmax(out_logits, -1)) / n
    wanted = argmax(target_logits)  # [G, K]
    top3 = jax.lax.top_k(out_logits, 3)[1]  # [G, K, 3]
    hits = jnp.cumsum(top3 == wanted[..., None], axis=-1) > 0  # [G, K, 3]: within the top 1, 2, 3
    n_correct = jnp.sum(m_at * hits, axis=(0, 1))  # [3]
    acc = n_correct / jnp.maximum(jnp.sum(m), 1.0)
    metrics = {"vloss": vloss, "ploss": ploss, "top1": acc[0], "top2": acc[1], "top3": acc[2]}
    return v_w * vloss + p_w * ploss, {**metrics, "n_correct": n_correct, "loss_mask_sum": jnp.sum(m)}


def eagle1_batch(
    hidden: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, ...]:
    """A right-padded batch in the v1 pipeline's layout, for `eagle1_loss`: (hidden_states, input_ids, target,
    attention_mask, loss_mask). From the target's final normed hidden states [B, T, H] and the conversations'
    tokens and masks [B, T] (`data.collate`), as v1's dataset and collator build them: the ids and the target
    (the next position's hidden state) shifted one step left and zero-padded, the loss mask zero at each
    sequence's last token."""
    b, t = input_ids.shape
    length = jnp.sum(attention_mask, axis=1, keepdims=True)  # [B, 1]
    inside = jnp.arange(t)[None, :] < length - 1  # [B, T]: positions with a next token in the sequence
    ids = jnp.where(inside, jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1))), 0)
    target = jnp.where(inside[..., None], jnp.pad(hidden[:, 1:], ((0, 0), (0, 1), (0, 0))), 0)
    return hidden, ids, target, attention_mask, jnp.where(inside, loss_mask, 0)


def uniform_noise(key: jax.Array, hidden: jax.Array, attention_mask: jax.Array, std: float = 0.2) -> jax.Array:
    """v1's data augmentation (`AddUniformNoise`, std 0.2) of the head's input features [B, T, H]:
    (U[0, 1) - 0.5) * std * 512 / L, L each sequence's length (v1 divides by `shape[1]` of a [1, L, H] tensor)."""
    length = jnp.maximum(jnp.sum(attention_mask, axis=1), 1).astype(jnp.float32)[:, None, None]  # [B, 1, 1]
    u = jax.random.uniform(key, hidden.shape, jnp.float32)
    return (hidden.astype(jnp.float32) + (u - 0.5) * std * 512 / length).astype(hidden.dtype)


def eagle1_flops(dcfg: DraftConfig, lengths: np.ndarray, readouts: float | None = None) -> float:
    """Model FLOPs of an EAGLE-1 training step on sequences of these real lengths [B] with `readouts` positions read
    out (the loss mask's; default every token): the head's forward and backward (3x the forward's multiply-adds:
    fc, its layers, causal attention, the readout of its prediction) plus the forward-only readout of the target
    feature. Padding and masked work are not counted."""
    specs = draft.param_specs(dcfg)
    weights = sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec) if len(s.shape) == 2)
    lengths = np.asarray(lengths, np.float64)
    tokens, pairs = lengths.sum(), (lengths * (lengths + 1) / 2).sum()
    readout = (tokens if readouts is None else readouts) * dcfg.hidden_size * dcfg.vocab_size
    attention = 2 * dcfg.num_layers * dcfg.num_heads * dcfg.head_dim * pairs
    return 2 * float(3 * (tokens * weights + attention + readout) + readout)


def build_vocab_map(
    token_counts: np.ndarray, draft_vocab_size: int, first_seen: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Draft vocabulary from loss-masked token counts [V] -> (d2t int32 [Vd], t2d bool [V]).

    Upstream: `Counter.most_common(Vd)` over the loss-masked tokens, ids sorted, d2t[i] = used[i] - i,
    t2d[v] = v in used. most_common breaks count ties by insertion order, i.e. by first occurrence in
    the scan; pass `first_seen` [V] (that occurrence's index, any order-preserving key) to reproduce it;
    without it ties go to the lower token id. Upstream keeps only seen tokens, so with fewer than Vd it
    builds a map shorter than the head's lm_head and training fails at the first loss (a shape
    mismatch); this raises instead.
    """
    counts = np.asarray(token_counts, np.int64)
    seen = np.flatnonzero(counts > 0)
    if len(seen) < draft_vocab_size:
        raise EagleError(
            f"only {len(seen)} distinct tokens occur under the loss mask, fewer than draft_vocab_size="
            f"{draft_vocab_size}; use a smaller draft vocabulary or more data"
        )
    tie = seen if first_seen is None else np.asarray(first_seen)[seen]
    ranked = seen[np.lexsort((tie, -counts[seen]))]  # by count desc, then tie key asc
    used = np.sort(ranked[:draft_vocab_size])
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int32)
    t2d = np.zeros(counts.shape[0], bool)
    t2d[used] = True
    return d2t, t2d

"""Training objectives with the official conventions: EAGLE-3's training-time test (TTT, traineagle3) and
EAGLE-1's feature regression (`eagle1_loss`, the v1 branch's `eagle/train/main.py`).

EAGLE-3 (TTT):

For a right-padded batch, the frozen target gives fused features [B, T, 3Ht] and logits [B, T, V]
(`target_batch`), or they come from a store (`eagle_jax.training.features`: the logits of the draft
vocabulary rebuilt from the final hidden states, `Targets`). The draft then unrolls `steps` steps
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
    return draft.to_target_ids(draft_params, dcfg, jnp.arange(dcfg.draft_vocab_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Targets:
    """The target's side of the TTT objective: what its logits say at each position."""

    draft_logits: jax.Array  # [B, T, Vd] f32: the logits of the draft vocabulary's tokens
    argmax: jax.Array  # [B, T] int32: the argmax over the full vocabulary


def targets_from_logits(draft_params: dict, dcfg: DraftConfig, logits: jax.Array) -> Targets:
    """From the target's logits [B, T, V] (the online step)."""
    logits = jax.lax.stop_gradient(logits).astype(jnp.float32)
    return Targets(jnp.take(logits, draft_columns(draft_params, dcfg), axis=-1), argmax(logits))


def targets_from_hidden(
    draft_params: dict, dcfg: DraftConfig, output_head: jax.Array, hidden: jax.Array, full_argmax: jax.Array
) -> Targets:
    """From stored final normed hidden states [B, T, Ht] and full-vocabulary argmax [B, T] (the offline step):
    the draft vocabulary's columns of the target's readout `output_head` [Ht, V], accumulated in f32."""
    columns = jnp.take(jax.lax.stop_gradient(output_head), draft_columns(draft_params, dcfg), axis=1)  # [Ht, Vd]
    return Targets(linear(hidden.astype(columns.dtype), columns, out_dtype=jnp.float32), full_argmax)


def _step_targets(draft_params: dict, dcfg: DraftConfig, targets: jax.Array | Targets):
    """Unshifted target side: p [B, T, Vd], argmax p [B, T], t2d[argmax logits] [B, T] bool, and that
    flag for a zero (past-the-end) row. `targets`: the target's logits [B, T, V] or `Targets`."""
    draft_params = jax.tree.map(jnp.asarray, draft_params)
    if not isinstance(targets, Targets):
        targets = targets_from_logits(draft_params, dcfg, targets)
    p = jax.nn.softmax(targets.draft_logits, axis=-1)  # [B, T, Vd]
    if dcfg.has_vocab_map:
        t2d = draft_params["t2d"]
        in_vocab, zero_row_in_vocab = t2d[targets.argmax], t2d[0]
    else:
        in_vocab, zero_row_in_vocab = jnp.ones(targets.argmax.shape, bool), True
    return p, argmax(p), in_vocab, zero_row_in_vocab


def _pad_end(x: jax.Array, n: int, fill) -> jax.Array:
    """Append n rows of `fill` along the time axis: [B, T, ...] -> [B, T + n, ...]."""
    x = jnp.asarray(x)
    return jnp.concatenate([x, jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)], axis=1)


def _position_masks(in_vocab: jax.Array, zero_in, loss_mask: jax.Array, steps: int) -> jax.Array:
    """[steps, B, T] f32 from in_vocab [B, T] (t2d of the target argmax) and the loss mask [B, T]."""
    in_vocab = _pad_end(in_vocab, steps, zero_in)  # [B, T + S]
    lm = _pad_end(jnp.asarray(loss_mask, jnp.float32), steps, 0.0)  # [B, T + S]
    t = loss_mask.shape[1]
    return jnp.stack([in_vocab[:, j + 1 : j + 1 + t] * lm[:, j : j + t] for j in range(steps)])


def position_masks(
    draft_params: dict, dcfg: DraftConfig, target_logits: jax.Array, loss_mask: jax.Array, steps: int = 7
) -> jax.Array:
    """position_mask_j [steps, B, T] f32: t2d[argmax shift(target_logits, j+1)] * shift(loss_mask, j)."""
    _, _, in_vocab, zero_in = _step_targets(draft_params, dcfg, target_logits)
    return _position_masks(in_vocab, zero_in, loss_mask, steps)


def _ttt_attend(
    q: jax.Array, k0: jax.Array, v0: jax.Array, mask0: jax.Array, kd: jax.Array, vd: jax.Array, valid: jax.Array
) -> jax.Array:
    """Attention of a step-j query q [B, T, N, D] over the union, under one softmax, of
    - the step-0 keys/values k0, v0 [B, T, KV, D] allowed by mask0 [B, T, T], and
    - the keys/values of steps 1..S at the query's own position, kd, vd [B, S, T, KV, D], where only
      the slots with valid [S] (steps 1..j) count.  -> [B, T, N, D]."""
    b, t, n, d = q.shape
    kv = k0.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    floor = jnp.finfo(jnp.float32).min
    block = jnp.einsum("btkgd,bskd->bkgts", q, k0, preferred_element_type=jnp.float32) / math.sqrt(d)
    block = jnp.where(mask0[:, None, None], block, floor)  # [B, KV, G, T, T]
    diag = jnp.einsum("btkgd,bjtkd->bkgtj", q, kd, preferred_element_type=jnp.float32) / math.sqrt(d)
    diag = jnp.where(valid, diag, floor)  # [B, KV, G, T, S]
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
    steps: int = 7,
    step_weight: float = 0.8,
    unroll: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Official EAGLE-3 TTT objective -> (sum_j step_weight**j * plosses[j] (f32), metrics).

    embed [V, H] (frozen target embedding), features [B, T, 3Ht], targets (the target's logits [B, T, V] or
    `Targets`), input_ids / attention_mask / loss_mask [B, T]. Metrics, each [steps]: `plosses` f32, `acces` f32
    (`accuracies` gives the exact float64 values), `n_correct`, `n_counted` (positions with mask 1)
    and `loss_mask_sum` (the accuracy denominator without 1e-6), int32.
    Steps 1.. run as one `lax.scan` (unrolled with `unroll`, e.g. for a compiler's cost analysis, which counts a
    loop body once). Jit with `static_argnames=("dcfg", "steps", "step_weight", "unroll")`.
    """
    if dcfg.kind != "eagle3":
        raise EagleError(f"TTT trains EAGLE-3 heads, got a {dcfg.kind} config")
    if steps < 1:
        raise EagleError(f"steps={steps}: TTT needs at least one step")
    b, t = input_ids.shape
    p = draft_params["layers"][0]
    embed = jax.lax.stop_gradient(jnp.asarray(embed))
    probs, target_argmax, in_vocab, zero_in = _step_targets(draft_params, dcfg, targets)
    # padded at the end so that step j reads rows [j+1, j+1+T) (the zero-filled shift)
    tokens = _pad_end(input_ids, steps, 0)  # [B, T + S]
    probs = _pad_end(probs, steps, 1.0 / dcfg.draft_vocab_size)  # [B, T + S, Vd]; softmax of a zero row
    target_argmax = _pad_end(target_argmax, steps, 0)  # [B, T + S]; argmax of a zero row
    masks = _position_masks(in_vocab, zero_in, loss_mask, steps)  # [S, B, T]
    lm = _pad_end(loss_mask.astype(jnp.float32), steps, 0.0)  # [B, T + S]
    mask0 = padded_causal(attention_mask)  # [B, T, T]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))

    def window(x: jax.Array, start) -> jax.Array:  # rows [start, start + T)
        return jax.lax.dynamic_slice_in_dim(x, start, t, axis=1)

    def step_input(h: jax.Array, j):
        emb = embed[window(tokens, j + 1)].astype(h.dtype)  # [B, T, H]
        return draft.qkv(p, dcfg, draft.eagle3_input(p, dcfg, emb, h), positions + j)

    def step_loss(h: jax.Array, j) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        logits = draft.logits(draft_params, dcfg, h, None)  # [B, T, Vd] f32
        lm_j = window(lm, j)  # [B, T]
        mask_j = masks[j]  # [B, T]
        loss = soft_cross_entropy(logits, window(probs, j + 1), mask_j) / (b * t)
        hit = argmax(logits) == window(target_argmax, j + 1)
        count = lambda x: jnp.sum(x).astype(jnp.int32)  # noqa: E731
        return loss, count(hit * mask_j), count(mask_j), count(lm_j)

    features = jax.lax.stop_gradient(features).astype(draft_params["fc"].dtype)  # compute in the draft's dtype
    h = draft.project_features(draft_params, dcfg, features)  # [B, T, H]
    q, k0, v0 = step_input(h, 0)
    h = draft.post_attention(p, dcfg, attend(q, jnp.swapaxes(k0, 1, 2), jnp.swapaxes(v0, 1, 2), mask0), h)
    first = step_loss(h, 0)

    def later_step(carry, j):
        h, kd, vd = carry
        q, k, v = step_input(h, j)
        kd = kd.at[:, j - 1].set(k)
        vd = vd.at[:, j - 1].set(v)
        attn = _ttt_attend(q, k0, v0, mask0, kd, vd, jnp.arange(steps - 1) < j)
        h = draft.post_attention(p, dcfg, attn, h)
        return (h, kd, vd), step_loss(h, j)

    parts = [tuple(x[None] for x in first)]
    if steps > 1:
        buf = jnp.zeros((b, steps - 1) + k0.shape[1:], k0.dtype)  # [B, S-1, T, KV, D]
        parts.append(jax.lax.scan(later_step, (h, buf, buf), jnp.arange(1, steps), unroll=unroll)[1])
    plosses, n_correct, n_counted, lm_sums = (jnp.concatenate(xs) for xs in zip(*parts))
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


def ttt_flops(dcfg: DraftConfig, steps: int, lengths: np.ndarray) -> float:
    """Model FLOPs of a TTT training step on sequences of these real lengths [B]: forward and backward, counted
    as 3x the forward's multiply-adds (fc once, the layer and lm_head once per step; attention over the
    causal prefix plus the step's earlier TTT keys). Padding and masked work are not counted."""
    specs = draft.param_specs(dcfg)

    def weights(tree) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(tree, is_leaf=is_spec) if len(s.shape) == 2)

    lengths = np.asarray(lengths, np.float64)
    tokens, pairs = lengths.sum(), (lengths * (lengths + 1) / 2).sum()
    dense = tokens * (weights(specs["fc"]) + steps * weights([specs["layers"], specs["lm_head"]]))
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
    counts `n_correct` [3] and `loss_mask_sum`.
    """
    b, t = input_ids.shape
    mask = padded_causal(attention_mask)  # [B, T, T]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = draft.init_cache(dcfg, b, t, hidden_states.dtype)
    predict, _ = draft.forward(draft_params, dcfg, embed, input_ids, hidden_states, positions, cache, mask)
    out_logits = draft.logits(draft_params, dcfg, predict, lm_head)  # [B, T, V] f32
    target_logits = jax.lax.stop_gradient(draft.logits(draft_params, dcfg, target, lm_head))
    m = loss_mask.astype(jnp.float32)[..., None]  # [B, T, 1]
    n = jnp.sum(m) + 1e-5
    ploss = -jnp.sum(m * jax.nn.softmax(target_logits, -1) * jax.nn.log_softmax(out_logits, -1)) / n
    diff = predict.astype(jnp.float32) - target.astype(jnp.float32)
    vloss = jnp.sum(jnp.mean(m * smooth_l1(diff), axis=-1)) / n
    wanted = argmax(target_logits)  # [B, T]
    top3 = jax.lax.top_k(out_logits, 3)[1]  # [B, T, 3]
    hits = jnp.cumsum(top3 == wanted[..., None], axis=-1) > 0  # [B, T, 3]: within the top 1, 2, 3
    n_correct = jnp.sum(m * hits, axis=(0, 1))  # [3]
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


def eagle1_flops(dcfg: DraftConfig, lengths: np.ndarray) -> float:
    """Model FLOPs of an EAGLE-1 training step on sequences of these real lengths [B]: the head's forward and
    backward (3x the forward's multiply-adds: fc, its layers, causal attention, the readout of its prediction)
    plus the forward-only readout of the target feature. Padding and masked work are not counted."""
    specs = draft.param_specs(dcfg)
    weights = sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec) if len(s.shape) == 2)
    lengths = np.asarray(lengths, np.float64)
    tokens, pairs = lengths.sum(), (lengths * (lengths + 1) / 2).sum()
    readout = tokens * dcfg.hidden_size * dcfg.vocab_size
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

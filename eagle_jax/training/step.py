"""One jitted training step on a mesh: frozen target forward (or its stored outputs), the head's loss, AdamW update.

EAGLE-3: the TTT loss with upstream's optimiser (clip 0.5 by global norm, AdamW betas (0.9, 0.95), weight decay
0, linear warm-up then cosine). EAGLE-1: the v1 branch's feature regression (`objective.eagle1_loss`) with its
optimiser (each gradient clipped to +-0.5, AdamW betas (0.9, 0.95) with torch's default weight decay 0.01,
linear warm-up from 0 then linear decay, as `get_linear_schedule_with_warmup`) and its uniform noise on the
input features. The draft's float parameters are float32 master weights, optionally computed in bf16; the
target and the vocabulary map are frozen. Every input and state is placed by its logical axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.models import draft, target
from eagle_jax.models.config import DraftConfig, TargetConfig
from eagle_jax.models.params import abstract_params, is_spec, with_dtype
from eagle_jax.parallel import sharding
from eagle_jax.parallel.memory import MemoryPlan, abstract, compile_program, compiler_name, device_bytes, mesh_text
from eagle_jax.training import objective

PyTree = Any


def _decay_progress(count: jax.Array, warmup: int, steps: int) -> jax.Array:
    """How far past the warm-up an update is, 0 at its end to 1 at `steps`."""
    return jnp.clip((count - warmup) / max(steps - warmup, 1), 0.0, 1.0)


def warmup_cosine(peak: float, warmup: int, steps: int) -> optax.Schedule:
    """EAGLE-3's: linear warm-up to `peak` over `warmup` updates (the first update already uses peak/warmup), then
    cosine to 0 at `steps`."""

    def schedule(count: jax.Array) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        warm = peak * (count + 1) / max(warmup, 1)
        return jnp.where(
            count < warmup, warm, 0.5 * peak * (1 + jnp.cos(math.pi * _decay_progress(count, warmup, steps)))
        )

    return schedule


def warmup_linear(peak: float, warmup: int, steps: int) -> optax.Schedule:
    """EAGLE-1's (v1, `get_linear_schedule_with_warmup`): linear warm-up from 0 (the first update uses lr 0), then
    linear to 0 at `steps`."""

    def schedule(count: jax.Array) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        return jnp.where(
            count < warmup, peak * count / max(warmup, 1), peak * (1 - _decay_progress(count, warmup, steps))
        )

    return schedule


@dataclasses.dataclass(frozen=True)
class Recipe:
    """An upstream optimiser recipe: AdamW betas (0.9, 0.95) with this learning-rate schedule (peak, warmup, steps),
    gradient clip and weight decay."""

    schedule: Callable[[float, int, int], optax.Schedule]
    clip: optax.GradientTransformation
    weight_decay: float


EAGLE3_RECIPE = Recipe(warmup_cosine, optax.clip_by_global_norm(0.5), 0.0)
EAGLE1_RECIPE = Recipe(warmup_linear, optax.clip(0.5), 0.01)  # each gradient clipped; torch's default decay


def make_optimizer(
    lr: float, warmup: int, steps: int, grad_accum: int = 1, recipe: Recipe = EAGLE3_RECIPE
) -> optax.GradientTransformation:
    """The head's optimiser by `recipe`; MultiSteps accumulates grad_accum micro-batches."""
    adamw = optax.adamw(recipe.schedule(lr, warmup, steps), b1=0.9, b2=0.95, weight_decay=recipe.weight_decay)
    return optax.MultiSteps(optax.chain(recipe.clip, adamw), every_k_schedule=grad_accum).gradient_transformation()


@dataclasses.dataclass(frozen=True)
class Shardings:
    target: PyTree
    trainable: PyTree
    vocab_map: PyTree
    opt_state: PyTree
    batch: NamedSharding  # [B, T] arrays: batch over ('data', 'fsdp')
    features: NamedSharding  # [B, T, X] stored target rows, placed like the batch
    replicated: NamedSharding


def make_shardings(
    tcfg: TargetConfig, dcfg: DraftConfig, optimizer: optax.GradientTransformation, mesh: Mesh
) -> Shardings:
    """Placement of every input and state of a train step, from the logical-axis rules."""
    rules = sharding.rules_for(tcfg.num_kv_heads, mesh)
    trainable_specs, map_specs = objective.split_trainable(draft.param_specs(dcfg))
    trainable = sharding.param_shardings(trainable_specs, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(optimizer.init, abstract_params(trainable_specs))
    opt_state = optax.tree_map_params(
        optimizer, lambda _, s: s, opt_shape, trainable, transform_non_params=lambda _: replicated
    )
    return Shardings(
        target=sharding.target_shardings(tcfg, mesh),
        trainable=trainable,
        vocab_map=jax.tree.map(lambda _: replicated, map_specs, is_leaf=is_spec),
        opt_state=opt_state,
        batch=NamedSharding(mesh, sharding.partition_spec(("batch", None), rules)),
        features=NamedSharding(mesh, sharding.partition_spec(("batch", None, None), rules)),
        replicated=replicated,
    )


def make_train_step(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    optimizer: optax.GradientTransformation,
    ttt_steps: int,
    sh: Shardings,
    compute_dtype=jnp.float32,
    offline: bool = False,
    noise_seed: int | None = None,
) -> Callable:
    """The jitted train step -> (trainable, opt_state, metrics).

    Online: (trainable, opt_state, vocab_map, target_params, ids, attn, loss_mask, loss_at, index): the target runs
    forward (no gradient, not in the optimiser); `loss_at` [G, K] (`objective.loss_positions`, one group per
    batch shard) where the draft is read out. Offline (`features.FeatureStore`): (trainable, opt_state,
    vocab_map, readout, ids, attn, loss_mask, loss_at, features [B, T, 3Ht], hidden [B, T, Ht], argmax [B, T],
    index), `readout` the target's embed (and lm_head when untied); `index` (int32 []) the micro-batch's. The draft
    computes in `compute_dtype` from fp32 master weights; the loss is fp32. Metrics are sums/values of one
    micro-batch.

    An EAGLE-1 head (`dcfg.kind`) trains on the final hidden states only: offline the stored rows are
    (hidden,), and with `noise_seed` the input features get v1's uniform noise drawn from (noise_seed, index).
    """
    if dcfg.kind == "eagle1":
        return _eagle1_step(tcfg, dcfg, optimizer, sh, compute_dtype, offline, noise_seed)

    def update(
        trainable, opt_state, vocab_map, embed, features, targets, input_ids, attention_mask, loss_mask, loss_at
    ):
        total, m, grads = objective.ttt_value_and_grad(
            {**trainable, **vocab_map},
            dcfg,
            embed,
            features,
            targets,
            input_ids,
            attention_mask,
            loss_mask,
            loss_at,
            steps=ttt_steps,
            compute_dtype=compute_dtype,
        )
        trainable, opt_state = _apply(optimizer, trainable, opt_state, grads)
        metrics = {
            "loss": total,
            "plosses": m["plosses"],
            "n_correct": m["n_correct"],
            "loss_mask_sum": m["loss_mask_sum"],
            "grad_norm": optax.tree.norm(grads),
        }
        return trainable, opt_state, metrics

    def online(trainable, opt_state, vocab_map, tparams, input_ids, attention_mask, loss_mask, loss_at, index):
        features, logits = objective.target_batch(tparams, tcfg, input_ids, attention_mask, dcfg.feature_layers(tcfg))
        tokens = (input_ids, attention_mask, loss_mask, loss_at)
        return update(trainable, opt_state, vocab_map, tparams["embed"], features, logits, *tokens)

    def stored(
        trainable,
        opt_state,
        vocab_map,
        weights,
        input_ids,
        attention_mask,
        loss_mask,
        loss_at,
        features,
        hidden,
        top,
        index,
    ):
        head = target.output_head(weights, tcfg).astype(compute_dtype)
        targets = objective.targets_from_hidden({**trainable, **vocab_map}, dcfg, head, hidden, top, loss_at)
        tokens = (input_ids, attention_mask, loss_mask, loss_at)
        embed = weights["embed"].astype(compute_dtype)
        return update(trainable, opt_state, vocab_map, embed, features, targets, *tokens)

    return _placed(stored if offline else online, sh, offline, (sh.features, sh.features, sh.batch))


def readout(target_tree: dict) -> dict:
    """The target's readout out of a tree of its parameters (or their shardings): the embedding, and the lm_head
    when untied: all of the target a step from stored features holds."""
    return {k: target_tree[k] for k in ("embed", "lm_head") if k in target_tree}


def _placed(step: Callable, sh: Shardings, offline: bool, rows: tuple[NamedSharding, ...]) -> Callable:
    """A train step jitted with its placements: (trainable, opt_state, vocab_map, the target or offline its
    readout, four [B, T] token arrays, offline the stored `rows`, the index), the state donated."""
    weights = readout(sh.target) if offline else sh.target
    tokens = (sh.batch,) * 4 + (rows if offline else ())
    return jax.jit(
        step,
        in_shardings=(sh.trainable, sh.opt_state, sh.vocab_map, weights, *tokens, sh.replicated),
        out_shardings=(sh.trainable, sh.opt_state, sh.replicated),
        donate_argnums=(0, 1),
    )


def _apply(optimizer, trainable, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state


def _eagle1_step(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    optimizer: optax.GradientTransformation,
    sh: Shardings,
    compute_dtype,
    offline: bool,
    noise_seed: int | None,
) -> Callable:
    """`make_train_step` for an EAGLE-1 head: the v1 objective on the target's final normed hidden states."""

    def update(trainable, opt_state, weights, hidden, input_ids, attention_mask, loss_mask, loss_at, index):
        weights = jax.tree.map(lambda x: x.astype(compute_dtype), weights)
        batch = objective.eagle1_batch(hidden.astype(compute_dtype), input_ids, attention_mask, loss_mask)
        if noise_seed is not None:
            key = jax.random.fold_in(jax.random.key(noise_seed), index)
            batch = (objective.uniform_noise(key, batch[0], attention_mask), *batch[1:])
        head = target.output_head(weights, tcfg)

        def loss(tr: dict):
            tr = jax.tree.map(lambda x: x.astype(compute_dtype), tr)
            return objective.eagle1_loss(tr, dcfg, head, weights["embed"], *batch, loss_at)

        (total, m), grads = jax.value_and_grad(loss, has_aux=True)(trainable)
        trainable, opt_state = _apply(optimizer, trainable, opt_state, grads)
        metrics = {k: m[k] for k in ("vloss", "ploss", "n_correct", "loss_mask_sum")}
        return trainable, opt_state, {"loss": total, **metrics, "grad_norm": optax.tree.norm(grads)}

    def online(trainable, opt_state, vocab_map, tparams, input_ids, attention_mask, loss_mask, loss_at, index):
        out = objective.target_outputs(tparams, tcfg, input_ids, attention_mask, (), compute_logits=False)
        tokens = (input_ids, attention_mask, loss_mask, loss_at)
        return update(trainable, opt_state, readout(tparams), out.hidden, *tokens, index)

    def stored(trainable, opt_state, vocab_map, weights, input_ids, attention_mask, loss_mask, loss_at, hidden, index):
        return update(trainable, opt_state, weights, hidden, input_ids, attention_mask, loss_mask, loss_at, index)

    return _placed(stored if offline else online, sh, offline, (sh.features,))


def plan_training(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    mesh: Mesh,
    batch: int,
    seq_len: int,
    ttt_steps: int = 7,
    bf16: bool = True,
    offline: bool = False,
) -> MemoryPlan:
    """Compile the train step (`make_train_step`) on [batch, seq_len] token batches with abstract arguments;
    offline: from stored bf16 features, only the target's readout resident."""
    sharding.check_mesh(mesh, tcfg, dcfg, batch)
    compute = jnp.bfloat16 if bf16 else jnp.float32
    optimizer = make_optimizer(5e-5, 1, 1)  # the schedule does not change the state's shapes
    sh = make_shardings(tcfg, dcfg, optimizer, mesh)
    step = make_train_step(tcfg, dcfg, optimizer, ttt_steps, sh, compute, offline)
    trainable_specs, map_specs = objective.split_trainable(draft.param_specs(dcfg))
    trainable = abstract(trainable_specs, sh.trainable)
    opt_state = abstract(jax.eval_shape(optimizer.init, trainable), sh.opt_state)
    vocab_map = abstract(map_specs, sh.vocab_map)
    tparams = abstract(with_dtype(target.param_specs(tcfg), compute), sh.target)
    tokens = (jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sh.batch),) * 3
    groups = sharding.data_parallelism(mesh)  # loss_at: read out everywhere, the most a batch can ask for
    tokens += (jax.ShapeDtypeStruct((groups, batch // groups * seq_len), jnp.int32, sharding=sh.batch),)
    if offline:
        tparams = readout(tparams)
        rows = (
            jax.ShapeDtypeStruct((batch, seq_len, 3 * tcfg.hidden_size), jnp.bfloat16, sharding=sh.features),
            jax.ShapeDtypeStruct((batch, seq_len, tcfg.hidden_size), jnp.bfloat16, sharding=sh.features),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=sh.batch),
        )
    resident = (
        ("target readout (frozen)" if offline else "target parameters (frozen)", device_bytes(tparams)),
        ("draft parameters (f32 master)", device_bytes(trainable) + device_bytes(vocab_map)),
        ("optimizer state", device_bytes(opt_state)),
    )
    program = compile_program(
        f"train step ([{batch}, {seq_len}] tokens, {ttt_steps} TTT steps{', stored features' if offline else ''})",
        mesh,
        step,
        trainable,
        opt_state,
        vocab_map,
        tparams,
        *tokens,
        *(rows if offline else ()),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=sh.replicated),
    )
    title = (
        f"training{' from stored features' if offline else ''}: batch {batch}, length {seq_len}, "
        f"{'bf16 compute' if bf16 else 'f32'}, mesh {mesh_text(mesh)}"
    )
    return MemoryPlan(title, mesh.size, compiler_name(mesh), resident, (program,))


def step_flops_bytes(
    tcfg: TargetConfig,
    dcfg: DraftConfig,
    mesh: Mesh,
    batch: int,
    seq_len: int,
    ttt_steps: int,
    bf16: bool,
    offline: bool,
) -> tuple[MemoryPlan, float, float]:
    """The step's memory plan and its flops and bytes accessed per device by the compiler's count (every TTT step:
    they are unrolled). Zero costs when the compiler refused the step."""
    plan = plan_training(tcfg, dcfg, mesh, batch, seq_len, ttt_steps, bf16, offline)
    (program,) = plan.programs
    return plan, (0.0 if program.refused else program.flops), (0.0 if program.refused else program.bytes_accessed)

"""A draft-head training run (EAGLE-3 with training-time test, or EAGLE-1's feature regression): data (or stored
target features), vocabulary map, sharded train steps, checkpoints, logs and export.

`train(RunConfig(...))` runs or resumes a run in its output folder, which holds run.json (the
settings), vocab_map.npz (d2t, t2d, loss-masked token counts), ckpt/ (orbax training state),
metrics.jsonl (one line per logged step), tau.jsonl (the head's real tau measured with the speculative
engine on held-out prompts), curves.png, head/ (the final head as an orbax store) and export/ (the
final head in the official format). A resumed run continues with the same batches and losses as an
uninterrupted one. Ctrl-C (or SIGTERM) during the steps stops the run after the current step with a
checkpoint and the head exported, then raises KeyboardInterrupt; the same settings continue it (`loop.run`).
What differs by head kind is its `HeadKind`; what differs between the target run online and stored features is
the run's `Source`.
"""

from __future__ import annotations

import dataclasses
import math
import time
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eagle_jax.decoding import generation, speculative
from eagle_jax.decoding.tree import DynamicTree, TreeConfig, parse_envelopes
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading, official, store
from eagle_jax.models import draft
from eagle_jax.models.config import DraftConfig, TargetConfig, eagle1_head_like, eagle3_head_like
from eagle_jax.models.params import init_params
from eagle_jax.parallel import sharding
from eagle_jax.training import data, features, loop, objective
from eagle_jax.training.step import (
    EAGLE1_RECIPE,
    EAGLE3_RECIPE,
    Recipe,
    Shardings,
    make_optimizer,
    make_shardings,
    make_train_step,
)

DEFAULT_DRAFT_VOCAB = 32000
# Flags that fix the data order, model and optimiser trajectory: a resumed run must repeat them.
RESUME_KEYS = (
    "target",
    "data",
    "batch_size",
    "max_length",
    "ttt_steps",
    "lr",
    "warmup",
    "grad_accum",
    "seed",
    "draft_vocab_size",
    "init_head",
    "bf16",
    "chat_template",
    "features",
    "kind",
    "noise",
)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines a run (saved as OUT/run.json)."""

    target: str
    data: tuple[str, ...]
    out: str
    steps: int = 1000
    batch_size: int = 8
    max_length: int = 2048
    ttt_steps: int = 7
    lr: float = 5e-5
    warmup: int | None = None  # default: 5% of steps
    grad_accum: int = 1
    mesh: str | None = None
    seed: int = 0
    draft_vocab_size: int | None = None  # default: min(32000, target vocab)
    init_head: str | None = None
    bf16: bool = False
    chat_template: str | None = None
    save_every: int = 500
    keep: int = 3
    log_every: int = 10
    tau_prompts: str | None = None
    tau_every: int = 0
    tau_max_new_tokens: int = 64
    tau_tree: str | None = None  # TOTAL/DEPTH/TOP_K of the tau measurements (default: upstream's dynamic tree)
    features: str | None = None  # a `train.features` folder for this target and data: train without the target
    kind: str = "eagle3"  # the head: "eagle3" (TTT) or "eagle1" (v1's feature regression; no ttt_steps, full vocab)
    noise: bool = True  # EAGLE-1: v1's uniform noise on the input features

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)


def place_batch(b: data.Batch, sh: Shardings, index: int) -> tuple[jax.Array, ...]:
    """The step's batch arguments: ids, attention and loss masks [B, T], where the loss reads the draft out
    (`objective.loss_positions`, one group per batch shard), from a store the rows it holds, and last the
    micro-batch's index (int32 [], which draws EAGLE-1's noise)."""
    placed = tuple(sharding.put(x, sh.batch) for x in (b.input_ids, b.attention_mask, b.loss_mask))
    loss_at = objective.loss_positions(b.loss_mask, sharding.data_parallelism(sh.batch.mesh))
    placed += (sharding.put(loss_at, sh.batch),)
    if isinstance(b, features.StoredBatch):
        rows = {"features": b.features, "hidden": b.hidden, "argmax": b.argmax}
        placed += tuple(
            sharding.put(x, sh.batch if x.ndim == 2 else sh.features) for x in rows.values() if x is not None
        )
    return (*placed, np.int32(index))


def export_head(params: dict, dcfg: DraftConfig, tcfg: TargetConfig, out: Path) -> list[str]:
    """The trained head as an orbax store (OUT/head) and in the official format (OUT/export)."""
    config = official.official_config(dcfg, tcfg)
    params = jax.device_get(params)
    store.save_draft(out / "head", config, params, kind=dcfg.kind)
    return official.save_head(out / "export", config, params, dcfg, overwrite=True)


def vocab_map(
    rc: RunConfig, out: Path, examples: list[data.Example], dcfg: DraftConfig, init_map: dict | None
) -> dict[str, np.ndarray]:
    """d2t/t2d of the run: from OUT (resume), the initial head, or built once from the data; {} when Vd == V."""
    path = out / "vocab_map.npz"
    if path.is_file():
        try:
            with np.load(path) as saved:
                return {k: saved[k] for k in objective.VOCAB_MAP_KEYS if k in saved}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise EagleError(
                f"{path}: cannot be read ({files.first_line(exc)}); remove it to rebuild it from the data"
            ) from None
    counts, first_seen = data.token_counts(examples, dcfg.vocab_size)
    if init_map is not None:
        maps = init_map
    elif dcfg.has_vocab_map:
        d2t, t2d = objective.build_vocab_map(counts, dcfg.draft_vocab_size, first_seen)
        maps = {"d2t": d2t, "t2d": t2d}
    else:
        maps = {}
    files.save_npz_atomic(path, counts=counts, **maps)
    return maps


# ---------------------------------------------------------------- real tau


def tau_prompts(path: str, tokenizer, limit: int = 16) -> list[list[int]]:
    """Held-out prompts: the first user turn of each record (eval `turns` lists or conversations), templated."""
    records, _ = data.read_records(path)
    prompts = []
    for index, record in enumerate(records[:limit]):
        where = f"{path}: record {index}"
        if isinstance(record, dict) and isinstance(record.get("turns"), list) and record["turns"]:
            first = {"role": "user", "content": str(record["turns"][0])}
        else:
            first = next((m for m in data.messages_of(record, where) if m["role"] == "user"), None)
            if first is None:
                raise EagleError(f"{where}: no user turn to use as a prompt")
        text = tokenizer.apply_chat_template([first], tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not prompts:
        raise EagleError(f"{path}: no prompts")
    return prompts


def measure_tau(
    tparams: dict,
    tcfg: TargetConfig,
    dparams: dict,
    dcfg: DraftConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    tree: TreeConfig = DynamicTree(),
) -> float:
    """Mean tokens per cycle of greedy speculative decoding (default: EAGLE-2's dynamic tree, upstream defaults)."""
    return generation.generate(
        tparams, dparams, prompts, max_new_tokens, speculative.DecodeConfig(tcfg, dcfg, tree)
    ).tau


# ---------------------------------------------------------------- the run


@dataclasses.dataclass(frozen=True)
class HeadKind:
    """What a head kind supplies to a run: its fresh head, its optimiser recipe, the target rows a step from stored
    features reads, the model flops of a micro-batch, its own metrics fields and summary, and its curves' labels.
    (Its objective is its head's: `make_train_step` follows the head config's kind.)"""

    name: str
    recipe: Recipe
    fresh: Callable[[RunConfig, TargetConfig], DraftConfig]
    stored: tuple[str, ...]
    flops: Callable[[RunConfig, DraftConfig, np.ndarray, int], float]  # (run, head, lengths [B], loss tokens)
    fields: Callable[[Sequence[dict], list[float]], dict]  # (micro-batch metrics, accuracies) -> its fields
    summary: Callable[[dict], str]  # a metrics line -> its part of the progress bar
    curves: loop.Curves


def _joined(acc: list[float]) -> str:
    return "/".join(f"{a:.2f}" for a in acc)


EAGLE3 = HeadKind(
    name="eagle3",
    recipe=EAGLE3_RECIPE,
    fresh=lambda rc, tcfg: eagle3_head_like(tcfg, rc.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, tcfg.vocab_size)),
    stored=features.STORED,
    flops=lambda rc, dcfg, lengths, readouts: objective.ttt_flops(dcfg, rc.ttt_steps, lengths, readouts),
    fields=lambda ms, acc: {
        "plosses": np.mean([m["plosses"] for m in ms], axis=0).tolist(),
        "tau_sim": float(objective.simulated_tau(np.asarray(acc))),
    },
    summary=lambda m: f"acc {_joined(m['acc'])} tau~{m['tau_sim']:.2f}",
    curves=loop.Curves("TTT loss", "accuracy per TTT step", lambda j: f"acc_{j}", tau=True),
)
EAGLE1 = HeadKind(
    name="eagle1",
    recipe=EAGLE1_RECIPE,
    fresh=lambda rc, tcfg: eagle1_head_like(tcfg),
    stored=("hidden",),
    flops=lambda rc, dcfg, lengths, readouts: objective.eagle1_flops(dcfg, lengths, readouts),
    fields=lambda ms, acc: {name: float(np.mean([m[name] for m in ms])) for name in ("vloss", "ploss")},
    summary=lambda m: f"top-1/2/3 {_joined(m['acc'])}",
    curves=loop.Curves("loss (vloss + 0.1 ploss)", "next-token accuracy", lambda j: f"top-{j + 1}", tau=True),
)
KINDS = {kind.name: kind for kind in (EAGLE3, EAGLE1)}


def initial_head(rc: RunConfig, kind: HeadKind, tcfg: TargetConfig) -> tuple[DraftConfig, dict, dict | None]:
    """The head to start from: --init-head's (fp32 master weights, its vocabulary map), else a fresh head of the
    run's kind shaped like a target layer. -> (config, trainable parameters, the vocabulary map or None)."""
    if not rc.init_head:
        dcfg = kind.fresh(rc, tcfg)
        return dcfg, objective.split_trainable(init_params(draft.param_specs(dcfg), jax.random.key(rc.seed)))[0], None
    dcfg, head = loading.load_draft(rc.init_head, tcfg, kind=kind.name, dtype=np.float32)
    if rc.draft_vocab_size not in (None, dcfg.draft_vocab_size):
        raise EagleError(
            f"draft vocabulary size {rc.draft_vocab_size} differs from {rc.init_head}'s ({dcfg.draft_vocab_size})"
        )
    return (dcfg, *objective.split_trainable(head))


def matmul_peak(mesh: Mesh, dtype=jnp.float32, n: int = 2048) -> float:
    """The mesh's measured matmul rate in FLOP/s: the best of 5 runs of [n, n] @ [n, n] on every device."""
    rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
    x = jax.device_put(jnp.ones((mesh.size * n, n), dtype), rows)
    w = jax.device_put(jnp.ones((n, n), dtype), NamedSharding(mesh, PartitionSpec()))
    product = jax.jit(lambda a, b: a @ b, out_shardings=rows)
    product(x, w).block_until_ready()
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        product(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * mesh.size * n**3 / best


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a run's sequences and the target's outputs come from: the target run online on the data, or a
    `features.FeatureStore` (`store`; None online)."""

    examples: list[data.Example]
    batch: Callable[[np.ndarray, int], data.Batch]  # (rows, length) -> the micro-batch
    store: features.FeatureStore | None = None

    @property
    def online(self) -> bool:
        return self.store is None

    def weights(self, tparams: dict | None, sh: Shardings, dtype) -> dict:
        """What of the target a step reads: all of it online, the readout from a store."""
        if self.online:
            return tparams
        readout = jax.tree.map(lambda x: x.astype(dtype), self.store.readout())
        return sharding.place(readout, {k: sh.target[k] for k in readout})


def source(rc: RunConfig, kind: HeadKind, tcfg: TargetConfig, tokenizer, dcfg: DraftConfig) -> Source:
    """The run's `Source`: --features' store (checked against the run) or the data, tokenized."""
    if rc.features:
        fs = features.FeatureStore(rc.features)
        fs.check(tcfg, rc.data, rc.chat_template, rc.max_length, dcfg.feature_layers(tcfg))
        examples = fs.examples()
        loop.log(f"data: {len(examples)} sequences from {rc.features}")
        return Source(examples, lambda rows, length: fs.batch(rows, length, kind.stored), fs)
    examples, stats = data.load_examples(rc.data, tokenizer, rc.max_length, tcfg.vocab_size)
    loop.log(f"data: {stats.summary()}")
    pad_id = tokenizer.pad_token_id or 0
    return Source(examples, lambda rows, length: data.collate([examples[i] for i in rows], length, pad_id))


@dataclasses.dataclass
class HeadRun:
    """A head's training run as `loop.run` drives it (a `loop.Job`)."""

    rc: RunConfig
    kind: HeadKind
    tcfg: TargetConfig
    dcfg: DraftConfig
    out: Path
    state: dict
    step_fn: Callable
    sh: Shardings
    plan: data.BatchPlan
    batch: Callable[[np.ndarray, int], data.Batch]
    maps: dict[str, np.ndarray]
    vocab_map: dict  # on the devices
    weights: dict
    peak: float
    prompts: list[list[int]] | None  # held-out prompts for the engine's tau, read by the full target
    tparams: dict | None
    tree: TreeConfig

    @property
    def curves(self) -> loop.Curves:
        return self.kind.curves

    def step(self, state: dict, index: int, progress: float) -> loop.Micro:
        rows, length = self.plan(index)
        batch = self.batch(rows, length)
        lengths = batch.attention_mask.sum(axis=1)
        params, opt_state, metrics = self.step_fn(
            state["params"], state["opt_state"], self.vocab_map, self.weights, *place_batch(batch, self.sh, index)
        )
        flops = self.kind.flops(self.rc, self.dcfg, lengths, batch.loss_mask.sum())
        return loop.Micro({"params": params, "opt_state": opt_state}, metrics, int(lengths.sum()), flops)

    def record(self, done: int, micro: Sequence[dict], interval: loop.Interval) -> dict:
        """`acc`: EAGLE-3 the accuracy of each TTT step, EAGLE-1 the top-1/2/3 accuracies of the next token."""
        correct = np.sum([m["n_correct"] for m in micro], axis=0)
        denom = np.sum([m["loss_mask_sum"] for m in micro], axis=0)
        acc = (correct / (denom + 1e-6)).tolist()
        rc = self.rc
        return {
            "step": done,
            "loss": float(np.mean([m["loss"] for m in micro])),
            "acc": acc,
            **self.kind.fields(micro, acc),
            "grad_norm": float(np.mean([m["grad_norm"] for m in micro])),
            "lr": float(self.kind.recipe.schedule(rc.lr, rc.warmup_steps, rc.steps)(done - 1)),
            "tokens_per_s": interval.tokens / interval.seconds,
            "head_flops_per_s": interval.flops / interval.seconds,
            "of_peak": interval.flops / interval.seconds / self.peak,
        }

    def postfix(self, m: dict) -> str:
        return (
            f"loss {m['loss']:.3f} {self.kind.summary(m)} {m['tokens_per_s']:.0f} tok/s "
            f"{m['head_flops_per_s'] / 1e9:.0f} GFLOP/s ({m['of_peak']:.0%} of peak)"
        )

    def reached(self, done: int, state: dict, write: Callable[[str], None]) -> None:
        rc = self.rc
        if not self.prompts or not rc.tau_every or done % rc.tau_every:
            return
        params = {**state["params"], **self.vocab_map}
        tau = measure_tau(self.tparams, self.tcfg, params, self.dcfg, self.prompts, rc.tau_max_new_tokens, self.tree)
        prompts = len(self.prompts)
        seen = self.plan.real_tokens(done * rc.grad_accum)
        loop.append_jsonl(self.out / "tau.jsonl", {"step": done, "tau": tau, "prompts": prompts, "tokens_seen": seen})
        write(f"step {done}: engine tau {tau:.3f} on {prompts} held-out prompts")

    def export(self, state: dict, done: int, trained: float) -> str:
        exported = export_head({**state["params"], **self.maps}, self.dcfg, self.tcfg, self.out)
        return f"exported {', '.join(exported)} to {self.out / 'export'}"


def train(rc: RunConfig) -> dict:
    """Run (or resume) training; returns the last logged metrics record."""
    out = loop.check_run_folder(
        Path(rc.out), (rc.target, *rc.data, rc.init_head, rc.tau_prompts, rc.chat_template, rc.features)
    )
    mesh = sharding.make_mesh(rc.mesh or f"fsdp={jax.device_count()}")
    sharding.check_dims(mesh, {"batch": rc.batch_size}, "batch size")
    loop.check_resume(rc, out, RESUME_KEYS)

    tcfg = loading.target_config(rc.target)  # weights later: bad settings and data fail first
    tokenizer = data.chat_tokenizer(rc.target, rc.chat_template)
    kind = KINDS[rc.kind]
    dcfg, trainable_init, init_map = initial_head(rc, kind, tcfg)
    sharding.check_mesh(mesh, tcfg, dcfg)  # an axis that does not divide a model dimension: an error, not replication
    src = source(rc, kind, tcfg, tokenizer, dcfg)
    prompts = tau_prompts(rc.tau_prompts, tokenizer) if rc.tau_prompts else None
    loop.record_settings(rc, out)
    maps = vocab_map(rc, out, src.examples, dcfg, init_map)

    compute_dtype = jnp.bfloat16 if rc.bf16 else jnp.float32
    optimizer = make_optimizer(rc.lr, rc.warmup_steps, rc.steps, rc.grad_accum, kind.recipe)
    sh = make_shardings(tcfg, dcfg, optimizer, mesh)
    # from a store the step reads only the target's readout; the whole target only measures the real tau
    tparams = loading.load_target(rc.target, compute_dtype, mesh, progress=True)[1] if prompts or src.online else None
    trainable = sharding.place(trainable_init, sh.trainable)
    opt_state = jax.jit(optimizer.init, out_shardings=sh.opt_state)(trainable)
    step_fn = make_train_step(
        tcfg,
        dcfg,
        optimizer,
        rc.ttt_steps,
        sh,
        compute_dtype,
        offline=not src.online,
        noise_seed=rc.seed if rc.noise else None,
    )
    peak = matmul_peak(mesh, compute_dtype)
    loop.log(f"matmul peak measured on this mesh: {peak / 1e9:.0f} GFLOP/s")
    job = HeadRun(
        rc=rc,
        kind=kind,
        tcfg=tcfg,
        dcfg=dcfg,
        out=out,
        state={"params": trainable, "opt_state": opt_state},
        step_fn=step_fn,
        sh=sh,
        plan=data.BatchPlan(
            [len(ex.input_ids) for ex in src.examples], rc.batch_size, rc.seed, data.bucket_sizes(rc.max_length)
        ),
        batch=src.batch,
        maps=maps,
        vocab_map=sharding.place(maps, sh.vocab_map),
        weights=src.weights(tparams, sh, compute_dtype),
        peak=peak,
        prompts=prompts,
        tparams=tparams,
        tree=parse_envelopes(rc.tau_tree)[0] if rc.tau_tree else DynamicTree(),
    )
    settings = loop.LoopSettings(
        steps=rc.steps, grad_accum=rc.grad_accum, log_every=rc.log_every, save_every=rc.save_every, keep=rc.keep
    )
    return loop.run(job, out, settings)

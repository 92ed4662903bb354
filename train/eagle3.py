"""Train an EAGLE-3 draft head with training-time test (TTT) against a frozen target.

    python -m train.eagle3 --target DIR --data FILE [FILE...] --out DIR [--steps N] [--batch-size B]
        [--max-length L] [--ttt-steps 7] [--lr X] [--mesh data=D,fsdp=F,tensor=T] [--seed S] ...

Re-running with the same --out resumes from the newest complete checkpoint and continues with the
same batches and losses as an uninterrupted run (the flags that define the run must repeat; --steps,
--mesh, --save-every, --keep, --log-every and the tau flags may change). OUT holds run.json (the
flags), vocab_map.npz (d2t, t2d, loss-masked token counts), ckpt/ (orbax training state),
metrics.jsonl (one line per logged step), tau.jsonl (the head's real tau measured with the
speculative engine on --tau-prompts), curves.png, head/ (the final head as an orbax store) and
export/ (the final head in the official format).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from cli import command
from convert import orbax_to_torch
from eagle_jax.decoding import speculative
from eagle_jax.errors import EagleError
from eagle_jax.io import store
from eagle_jax.io.hf import load_target
from eagle_jax.models import draft, params, target
from eagle_jax.models.config import TargetConfig, load_target_config, target_config_from_hf
from eagle_jax.models.draft import DraftConfig
from eagle_jax.parallel import sharding
from eagle_jax.training import checkpoints, data, objective

PyTree = Any
DEFAULT_DRAFT_VOCAB = 32000
# Flags that fix the data order, model and optimiser trajectory: a resumed run must repeat them.
RESUME_KEYS = ("target", "data", "batch_size", "max_length", "ttt_steps", "lr", "warmup", "grad_accum", "seed",
               "draft_vocab_size", "init_head", "bf16", "chat_template")


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

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else max(1, self.steps // 20)


# ---------------------------------------------------------------- model and optimiser


def target_config(path: str) -> TargetConfig:
    """The target's config, from a Hugging Face directory or an eagle-jax store (weights not read)."""
    if store.is_store(path):
        m = store.read_manifest(path)
        if m.target_config is None:
            raise EagleError(f"{path}: this store holds no target (it holds only a draft head)")
        return target_config_from_hf(m.target_config, m.generation_config)
    return load_target_config(path)


def target_tokenizer(path: str, chat_template: str | None):
    """The target's tokenizer (a store keeps it in tokenizer/), with a chat template."""
    tok_dir = store.tokenizer_dir(path) if store.is_store(path) else path
    if tok_dir is None:
        raise EagleError(f"{path}: the store holds no tokenizer; store the target with its tokenizer")
    return data.load_tokenizer(tok_dir, chat_template)


def target_params(path: str, dtype, shardings: PyTree, mesh: Mesh) -> PyTree:
    """Target weights placed on the mesh: a store restores onto it directly, HF weights go via the host."""
    if store.is_store(path):
        return place(store.load_target_store(path, dtype, mesh)[1], shardings)
    return place(load_target(path, dtype=dtype, progress=True)[1], shardings)


def head_config(tcfg: TargetConfig, draft_vocab_size: int) -> DraftConfig:
    """A one-layer EAGLE-3 head shaped like a target layer (hidden, heads, kv heads, MLP, rope)."""
    if not 0 < draft_vocab_size <= tcfg.vocab_size:
        raise EagleError(f"--draft-vocab-size {draft_vocab_size} must be in 1..{tcfg.vocab_size} (the target vocabulary)")
    return DraftConfig(
        kind="eagle3",
        hidden_size=tcfg.hidden_size,
        intermediate_size=tcfg.intermediate_size,
        num_layers=1,
        num_heads=tcfg.num_heads,
        num_kv_heads=tcfg.num_kv_heads,
        head_dim=tcfg.head_dim,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope=tcfg.rope,
        vocab_size=tcfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=tcfg.hidden_size,
    )


def lr_schedule(peak: float, warmup: int, steps: int) -> optax.Schedule:
    """Linear warmup to `peak` over `warmup` updates (the first update already uses peak/warmup), then cosine to 0 at `steps`."""

    def schedule(count: jax.Array) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        warm = peak * (count + 1) / max(warmup, 1)
        progress = jnp.clip((count - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        return jnp.where(count < warmup, warm, 0.5 * peak * (1 + jnp.cos(math.pi * progress)))

    return schedule


def make_optimizer(rc: RunConfig) -> optax.GradientTransformation:
    """Upstream recipe: clip 0.5, AdamW betas (0.9, 0.95), wd 0; MultiSteps accumulates grad_accum micro-batches."""
    inner = optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(lr_schedule(rc.lr, rc.warmup_steps, rc.steps), b1=0.9, b2=0.95, weight_decay=0.0),
    )
    return optax.MultiSteps(inner, every_k_schedule=rc.grad_accum).gradient_transformation()


@dataclasses.dataclass(frozen=True)
class Shardings:
    target: PyTree
    trainable: PyTree
    vocab_map: PyTree
    opt_state: PyTree
    batch: NamedSharding  # [B, T] arrays: batch over ('data', 'fsdp')
    replicated: NamedSharding


def make_shardings(tcfg: TargetConfig, dcfg: DraftConfig, optimizer: optax.GradientTransformation,
                   mesh: Mesh, target_dtype=jnp.float32) -> Shardings:
    """Placement of every input and state of a train step, from the logical-axis rules."""
    rules = sharding.rules_for(tcfg.num_kv_heads, mesh)
    trainable_specs, map_specs = objective.split_trainable(draft.param_specs(dcfg))
    trainable = sharding.param_shardings(trainable_specs, mesh, rules)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(optimizer.init, params.abstract_params(trainable_specs))
    opt_state = optax.tree_map_params(optimizer, lambda _, s: s, opt_shape, trainable,
                                      transform_non_params=lambda _: replicated)
    return Shardings(
        target=sharding.param_shardings(target.param_specs(tcfg, target_dtype), mesh, rules),
        trainable=trainable,
        vocab_map=jax.tree.map(lambda _: replicated, map_specs, is_leaf=params.is_spec),
        opt_state=opt_state,
        batch=NamedSharding(mesh, sharding.partition_spec(("batch", None), rules)),
        replicated=replicated,
    )


def place(tree: PyTree, shardings: PyTree) -> PyTree:
    """Host or device arrays -> arrays with these shardings (device arrays already placed are kept as they are)."""
    return jax.tree.map(sharding.put, tree, shardings)


def make_train_step(tcfg: TargetConfig, dcfg: DraftConfig, optimizer: optax.GradientTransformation,
                    ttt_steps: int, sh: Shardings, compute_dtype=jnp.float32) -> Callable:
    """Jitted (trainable, opt_state, vocab_map, target_params, ids, attn, loss_mask) -> (trainable, opt_state, metrics).

    The target runs forward only (no gradient, not in the optimiser); the draft computes in
    `compute_dtype` from fp32 master weights; the loss is fp32. Metrics are sums/values of one micro-batch.
    """

    def step(trainable, opt_state, vocab_map, tparams, input_ids, attention_mask, loss_mask):
        features, target_logits = objective.target_batch(tparams, tcfg, input_ids, attention_mask)

        def loss_fn(tr):
            params = {**jax.tree.map(lambda x: x.astype(compute_dtype), tr), **vocab_map}
            return objective.ttt_loss(params, dcfg, tparams["embed"], features, target_logits, input_ids,
                                attention_mask, loss_mask, steps=ttt_steps)

        (total, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics = {
            "loss": total,
            "plosses": m["plosses"],
            "n_correct": m["n_correct"],
            "loss_mask_sum": m["loss_mask_sum"],
            "grad_norm": optax.tree.norm(grads),
        }
        return trainable, opt_state, metrics

    batch = (sh.batch,) * 3
    return jax.jit(
        step,
        in_shardings=(sh.trainable, sh.opt_state, sh.vocab_map, sh.target) + batch,
        out_shardings=(sh.trainable, sh.opt_state, sh.replicated),
        donate_argnums=(0, 1),
    )


def place_batch(b: data.Batch, sh: Shardings) -> tuple[jax.Array, jax.Array, jax.Array]:
    return tuple(sharding.put(x, sh.batch) for x in (b.input_ids, b.attention_mask, b.loss_mask))


def official_config(dcfg: DraftConfig, tcfg: TargetConfig) -> dict:
    """The head's config.json in the format of upstream eagle/traineagle3/config.json."""
    rope = dcfg.rope
    rope_scaling = None
    if rope.rope_type != "default":
        rope_scaling = {"rope_type": rope.rope_type, "factor": rope.factor}
        if rope.rope_type == "llama3":
            rope_scaling.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                                original_max_position_embeddings=rope.original_max_position_embeddings)
    eos = list(tcfg.eos_token_ids)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "bos_token_id": tcfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": tcfg.pad_token_id,
        "hidden_act": "silu",
        "hidden_size": dcfg.hidden_size,
        "head_dim": dcfg.head_dim,
        "initializer_range": 0.02,
        "intermediate_size": dcfg.intermediate_size,
        "max_position_embeddings": rope.max_position_embeddings,
        "num_attention_heads": dcfg.num_heads,
        "num_key_value_heads": dcfg.num_kv_heads,
        "num_hidden_layers": 1,
        "pretraining_tp": 1,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_scaling": rope_scaling,
        "rope_theta": rope.theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
    }
    if dcfg.target_hidden_size != dcfg.hidden_size:
        cfg["target_hidden_size"] = dcfg.target_hidden_size
    return cfg


def export_head(params: dict, dcfg: DraftConfig, tcfg: TargetConfig, out: Path) -> list[str]:
    """The trained head as an orbax store (OUT/head) and in the official format (OUT/export)."""
    store.save_draft(out / "head", official_config(dcfg, tcfg), jax.device_get(params), kind="eagle3")
    return orbax_to_torch.export(out / "head", out / "export", overwrite=True)


# ---------------------------------------------------------------- run directory


def check_resume(rc: RunConfig, out: Path) -> None:
    """Refuse to resume a run in OUT that was started with different defining flags."""
    path = out / "run.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    mine = json.loads(json.dumps(dataclasses.asdict(rc)))
    diffs = [f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})" for k in RESUME_KEYS if saved.get(k) != mine[k]]
    if diffs:
        raise EagleError(f"{out} holds a run started with {'; '.join(diffs)}; repeat those flags to resume or use a new --out")


def vocab_map(rc: RunConfig, out: Path, examples: list[data.Example], dcfg: DraftConfig,
              init_map: dict | None) -> dict[str, np.ndarray]:
    """d2t/t2d of the run: from OUT (resume), the initial head, or built once from the data; {} when Vd == V."""
    path = out / "vocab_map.npz"
    if path.is_file():
        saved = np.load(path)
        return {k: saved[k] for k in objective.VOCAB_MAP_KEYS if k in saved}
    counts, first_seen = data.token_counts(examples, dcfg.vocab_size)
    if init_map is not None:
        maps = init_map
    elif dcfg.has_vocab_map:
        d2t, t2d = objective.build_vocab_map(counts, dcfg.draft_vocab_size, first_seen)
        maps = {"d2t": d2t, "t2d": t2d}
    else:
        maps = {}
    checkpoints.save_npz_atomic(path, counts=counts, **maps)
    return maps


def truncate_log(path: Path, step: int) -> None:
    """Keep the complete lines of a JSONL log with 'step' <= step (what a resumed run will not repeat)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def plot_curves(out: Path) -> Path | None:
    """OUT/curves.png: loss, per-step accuracies, simulated and measured tau against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if not rows:
        return None
    taus = [json.loads(line) for line in (out / "tau.jsonl").read_text().splitlines()] if (out / "tau.jsonl").is_file() else []
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [r["loss"] for r in rows])
    axes[0].set(title="TTT loss", xlabel="step", yscale="log")
    acc = np.asarray([r["acc"] for r in rows])
    for j in range(acc.shape[1]):
        axes[1].plot(steps, acc[:, j], label=f"acc_{j}")
    axes[1].set(title="accuracy per TTT step", xlabel="step", ylim=(0, 1))
    axes[1].legend(fontsize=7)
    axes[2].plot(steps, [r["tau_sim"] for r in rows], label="simulated tau")
    if taus:
        axes[2].plot([t["step"] for t in taus], [t["tau"] for t in taus], "o-", label="engine tau")
    axes[2].set(title="tau", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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


def measure_tau(tparams: dict, tcfg: TargetConfig, dparams: dict, dcfg: DraftConfig,
                prompts: list[list[int]], max_new_tokens: int) -> float:
    """Mean tokens per cycle of greedy speculative decoding (EAGLE-2 dynamic tree, upstream defaults)."""
    return speculative.generate(tparams, tcfg, dparams, dcfg, prompts, max_new_tokens).tau


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> RunConfig:
    p = command.ArgumentParser(prog="python -m train.eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target: Hugging Face directory (weights, config, tokenizer) or eagle-jax store")
    p.add_argument("--data", required=True, nargs="+", help="ShareGPT / UltraChat files (.json, .jsonl, .parquet)")
    p.add_argument("--out", required=True, help="run directory; reusing it resumes")
    p.add_argument("--steps", type=int, default=1000, help="optimiser updates")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--max-length", type=int, default=2048, help="longer sequences are dropped")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup updates (default 5%% of --steps)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per update")
    p.add_argument("--mesh", default=None, help="data=D,fsdp=F,tensor=T (default: fsdp over all devices)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="default min(32000, target vocab)")
    p.add_argument("--init-head", default=None, help="start from this official EAGLE-3 head directory")
    p.add_argument("--bf16", action="store_true", help="bf16 target and draft compute, fp32 master weights and loss")
    p.add_argument("--chat-template", default=None, help="jinja chat template file (if the tokenizer has none)")
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tau-prompts", default=None, help="held-out prompts (JSONL with 'turns' or conversations) for the real tau")
    p.add_argument("--tau-every", type=int, default=0, help="measure the real tau every K steps (needs --tau-prompts)")
    p.add_argument("--tau-max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_length", "ttt_steps", "grad_accum", "save_every", "keep", "log_every"):
        if getattr(a, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not a.lr > 0:
        raise EagleError(f"--lr must be > 0, got {a.lr}")
    if a.tau_every and not a.tau_prompts:
        raise EagleError("--tau-every needs --tau-prompts FILE")
    resolve = lambda x: str(Path(x).absolute()) if x else None  # noqa: E731
    return RunConfig(
        target=resolve(a.target), data=tuple(resolve(d) for d in a.data), out=resolve(a.out), steps=a.steps,
        batch_size=a.batch_size, max_length=a.max_length, ttt_steps=a.ttt_steps, lr=a.lr, warmup=a.warmup,
        grad_accum=a.grad_accum, mesh=a.mesh, seed=a.seed, draft_vocab_size=a.draft_vocab_size,
        init_head=resolve(a.init_head), bf16=a.bf16, chat_template=resolve(a.chat_template),
        save_every=a.save_every, keep=a.keep, log_every=a.log_every, tau_prompts=resolve(a.tau_prompts),
        tau_every=a.tau_every, tau_max_new_tokens=a.tau_max_new_tokens,
    )


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(rc: RunConfig) -> dict:
    """Run (or resume) training; returns the last logged metrics record."""
    out = Path(rc.out)
    mesh = sharding.make_mesh(rc.mesh or f"fsdp={jax.device_count()}")
    sharding.check_dims(mesh, {"batch": rc.batch_size}, "batch (--batch-size)")
    check_resume(rc, out)

    tcfg = target_config(rc.target)  # weights later: bad flags and data fail first
    tokenizer = target_tokenizer(rc.target, rc.chat_template)
    init_map = None
    if rc.init_head:
        dcfg, init_params = draft.load_draft(rc.init_head, tcfg, kind="eagle3", dtype=np.float32)  # fp32 master
        if rc.draft_vocab_size not in (None, dcfg.draft_vocab_size):
            raise EagleError(f"--draft-vocab-size {rc.draft_vocab_size} differs from {rc.init_head} ({dcfg.draft_vocab_size})")
        trainable_init, init_map = objective.split_trainable(init_params)
    else:
        dcfg = head_config(tcfg, rc.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, tcfg.vocab_size))
        trainable_init = objective.split_trainable(params.init_params(draft.param_specs(dcfg), jax.random.key(rc.seed)))[0]
    examples, stats = data.load_examples(rc.data, tokenizer, rc.max_length, tcfg.vocab_size)
    log(f"data: {stats.summary()}")
    prompts = tau_prompts(rc.tau_prompts, tokenizer) if rc.tau_prompts else None
    out.mkdir(parents=True, exist_ok=True)
    checkpoints.write_json_atomic(out / "run.json", dataclasses.asdict(rc))
    maps = vocab_map(rc, out, examples, dcfg, init_map)

    compute_dtype = jnp.bfloat16 if rc.bf16 else jnp.float32
    optimizer = make_optimizer(rc)
    sh = make_shardings(tcfg, dcfg, optimizer, mesh, compute_dtype)
    tparams = target_params(rc.target, compute_dtype, sh.target, mesh)
    vmap_dev = place(maps, sh.vocab_map)
    trainable = place(trainable_init, sh.trainable)
    opt_state = jax.jit(optimizer.init, out_shardings=sh.opt_state)(trainable)
    state = {"params": trainable, "opt_state": opt_state}

    mgr = checkpoints.manager(out / "ckpt", rc.keep)
    start = 0
    restored = checkpoints.restore_latest(mgr, checkpoints.abstract_like(state, {"params": sh.trainable, "opt_state": sh.opt_state}))
    if restored is not None:
        state, meta = restored
        start = int(meta["step"])
        log(f"resuming {out} at step {start}")
    for name in ("metrics.jsonl", "tau.jsonl"):
        truncate_log(out / name, start)

    step_fn = make_train_step(tcfg, dcfg, optimizer, rc.ttt_steps, sh, compute_dtype)
    plan = data.BatchPlan([len(ex.input_ids) for ex in examples], rc.batch_size, rc.seed, data.bucket_sizes(rc.max_length))
    pad_id = tokenizer.pad_token_id or 0

    def real_tau(step: int) -> None:
        tau = measure_tau(tparams, tcfg, {**state["params"], **vmap_dev}, dcfg, prompts, rc.tau_max_new_tokens)
        append_jsonl(out / "tau.jsonl", {"step": step, "tau": tau, "prompts": len(prompts)})
        bar.write(f"step {step}: engine tau {tau:.3f} on {len(prompts)} held-out prompts")

    bar = tqdm(total=rc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    if prompts and start == 0 and rc.tau_every:
        real_tau(0)
    last: dict = {}
    tokens, t0 = 0, time.perf_counter()
    for step in range(start, rc.steps):
        micro = []
        for k in range(rc.grad_accum):
            rows, length = plan(step * rc.grad_accum + k)
            batch = data.collate([examples[i] for i in rows], length, pad_id)
            tokens += batch.real_tokens
            state["params"], state["opt_state"], m = step_fn(
                state["params"], state["opt_state"], vmap_dev, tparams, *place_batch(batch, sh))
            micro.append(m)
        done = step + 1
        if done % rc.log_every == 0 or done == rc.steps:
            ms = jax.device_get(micro)
            elapsed = time.perf_counter() - t0
            correct = np.sum([m["n_correct"] for m in ms], axis=0)
            denom = np.sum([m["loss_mask_sum"] for m in ms], axis=0)
            acc = (correct / (denom + 1e-6)).tolist()
            last = {
                "step": done,
                "loss": float(np.mean([m["loss"] for m in ms])),
                "plosses": np.mean([m["plosses"] for m in ms], axis=0).tolist(),
                "acc": acc,
                "tau_sim": float(objective.simulated_tau(np.asarray(acc))),
                "grad_norm": float(np.mean([m["grad_norm"] for m in ms])),
                "lr": float(lr_schedule(rc.lr, rc.warmup_steps, rc.steps)(step)),
                "tokens_per_s": tokens / elapsed,
            }
            append_jsonl(out / "metrics.jsonl", last)
            bar.set_postfix_str(
                f"loss {last['loss']:.3f} acc {'/'.join(f'{a:.2f}' for a in acc)} tau~{last['tau_sim']:.2f} "
                f"{last['tokens_per_s']:.0f} tok/s", refresh=False)
            tokens, t0 = 0, time.perf_counter()
        bar.update(1)
        if prompts and rc.tau_every and done % rc.tau_every == 0:
            real_tau(done)
        if done % rc.save_every == 0 or done == rc.steps:
            checkpoints.save(mgr, done, state, {"step": done, "micro_batches": done * rc.grad_accum})
    bar.close()
    mgr.wait_until_finished()
    mgr.close()

    files = export_head({**state["params"], **maps}, dcfg, tcfg, out)
    png = plot_curves(out) if (out / "metrics.jsonl").is_file() else None
    log(f"exported {', '.join(files)} to {out / 'export'}" + (f"; curves in {png}" if png else ""))
    return last


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--plan" in argv:  # the compiled memory plan of a training step (infer.plan --train)
        from infer import plan

        return plan.main(argv)
    train(parse_args(argv))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

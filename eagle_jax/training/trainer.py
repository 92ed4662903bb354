"""A draft-head training run (EAGLE-3 with training-time test, or EAGLE-1's feature regression): data (or stored
target features), vocabulary map, sharded train steps, checkpoints, logs and export.

`train(RunConfig(...))` runs or resumes a run in its output folder, which holds run.json (the
settings), vocab_map.npz (d2t, t2d, loss-masked token counts), ckpt/ (orbax training state),
metrics.jsonl (one line per logged step), tau.jsonl (the head's real tau measured with the speculative
engine on held-out prompts), curves.png, head/ (the final head as an orbax store) and export/ (the
final head in the official format). A resumed run continues with the same batches and losses as an
uninterrupted one. Ctrl-C (or SIGTERM) during the steps stops the run after the current step with a
checkpoint and the head exported, then raises KeyboardInterrupt; the same settings continue it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm import tqdm

from eagle_jax.decoding import speculative
from eagle_jax.decoding.tree import DynamicTree, TreeConfig, parse_envelopes
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading, official, store
from eagle_jax.models import draft
from eagle_jax.models.config import DraftConfig, TargetConfig, eagle1_head_like, eagle3_head_like
from eagle_jax.models.params import init_params
from eagle_jax.parallel import sharding
from eagle_jax.training import checkpoints, data, features, objective
from eagle_jax.training.step import Shardings, lr_schedule, make_optimizer, make_shardings, make_train_step

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


def place_batch(b: data.Batch, sh: Shardings) -> tuple[jax.Array, ...]:
    """The step's batch arguments: ids, attention and loss masks [B, T], where the loss reads the draft out
    (`objective.loss_positions`, one group per batch shard), and, from a store, the rows it holds."""
    placed = tuple(sharding.put(x, sh.batch) for x in (b.input_ids, b.attention_mask, b.loss_mask))
    loss_at = objective.loss_positions(b.loss_mask, sharding.data_parallelism(sh.batch.mesh))
    placed += (sharding.put(loss_at, sh.batch),)
    if isinstance(b, features.StoredBatch):
        rows = {"features": b.features, "hidden": b.hidden, "argmax": b.argmax}
        placed += tuple(
            sharding.put(x, sh.batch if x.ndim == 2 else sh.features) for x in rows.values() if x is not None
        )
    return placed


def export_head(params: dict, dcfg: DraftConfig, tcfg: TargetConfig, out: Path) -> list[str]:
    """The trained head as an orbax store (OUT/head) and in the official format (OUT/export)."""
    config = official.official_config(dcfg, tcfg)
    params = jax.device_get(params)
    store.save_draft(out / "head", config, params, kind=dcfg.kind)
    return official.save_head(out / "export", config, params, dcfg, overwrite=True)


# ---------------------------------------------------------------- run directory


class RunMismatch(EagleError):
    """The output folder holds a run started with other defining settings: (name, saved, now) in `diffs`."""

    def __init__(self, out: Path, diffs: list[tuple[str, object, object]]):
        self.out, self.diffs = out, diffs
        shown = "; ".join(f"{k}={saved!r} (now {now!r})" for k, saved, now in diffs)
        super().__init__(
            f"{out} holds a run started with {shown}; repeat those settings to resume or use a new output folder"
        )


def check_run_folder(rc: RunConfig) -> Path:
    """Refuse, before any work, an output folder that is a file, is or holds an input, or holds files but no
    run.json (a folder that is not a run: nothing in it is replaced); returns OUT."""
    inputs = [p for p in (rc.target, *rc.data, rc.init_head, rc.tau_prompts, rc.chat_template, rc.features) if p]
    out = Path(rc.out)
    if out.is_dir() and any(out.iterdir()) and not (out / "run.json").is_file():
        raise EagleError(
            f"{out}: holds files but no run.json, so it is not a training run; choose a new or empty folder", "out"
        )
    return files.check_output_directory(out, inputs, overwrite=True, owned=None)


def check_resume(rc: RunConfig, out: Path) -> None:
    """Refuse to resume a run in OUT that was started with different defining settings (`RunMismatch`) or
    more steps (run.json is left as it is)."""
    path = out / "run.json"
    if not path.is_file():
        return
    try:
        saved = files.read_json(path)
    except EagleError as exc:
        raise EagleError(f"{exc}; repair it (it holds the run's settings) or use a new run folder", "out") from None
    mine = json.loads(json.dumps(dataclasses.asdict(rc)))
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}  # for a setting newer than the run
    diffs = [(k, saved.get(k, defaults[k]), mine[k]) for k in RESUME_KEYS if saved.get(k, defaults[k]) != mine[k]]
    if diffs:
        raise RunMismatch(out, diffs)
    if isinstance(saved.get("steps"), int) and rc.steps < saved["steps"]:
        raise EagleError(
            f"{rc.steps} is below the {saved['steps']} steps of the run in {out}; a resumed run keeps or raises "
            "its steps (run.json is left as it is)",
            "steps",
        )


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
    files.write_text_atomic(path, "".join(kept))


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def plot_curves(out: Path) -> Path | None:
    """OUT/curves.png: loss, accuracies (EAGLE-3: per TTT step; EAGLE-1: top-1/2/3), simulated (EAGLE-3) and
    measured tau against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    if not rows:
        return None
    taus = (
        [json.loads(line) for line in (out / "tau.jsonl").read_text().splitlines()]
        if (out / "tau.jsonl").is_file()
        else []
    )
    steps = [r["step"] for r in rows]
    ttt = "tau_sim" in rows[0]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    axes[0].plot(steps, [r["loss"] for r in rows])
    axes[0].set(title="TTT loss" if ttt else "loss (vloss + 0.1 ploss)", xlabel="step", yscale="log")
    acc = np.asarray([r["acc"] for r in rows])
    for j in range(acc.shape[1]):
        axes[1].plot(steps, acc[:, j], label=f"acc_{j}" if ttt else f"top-{j + 1}")
    axes[1].set(title="accuracy per TTT step" if ttt else "next-token accuracy", xlabel="step", ylim=(0, 1))
    axes[1].legend(fontsize=7)
    if ttt:
        axes[2].plot(steps, [r["tau_sim"] for r in rows], label="simulated tau")
    if taus:
        axes[2].plot([t["step"] for t in taus], [t["tau"] for t in taus], "o-", label="engine tau")
    axes[2].set(title="tau", xlabel="step")
    if ttt or taus:
        axes[2].legend()
    seen = [t for t in taus if "tokens_seen" in t]
    axes[3].plot([t["tokens_seen"] / 1e6 for t in seen], [t["tau"] for t in seen], "o-")
    axes[3].set(title="engine tau on held-out prompts", xlabel="training tokens seen (millions)")
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
    return speculative.generate(
        tparams, dparams, prompts, max_new_tokens, speculative.DecodeConfig(tcfg, dcfg, tree)
    ).tau


# ---------------------------------------------------------------- the run


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stop_between_steps() -> Iterator[Callable[[], bool]]:
    """Within: the first SIGINT or SIGTERM only asks the loop to stop after its current step (the function
    yielded says whether one came); a second one raises KeyboardInterrupt at once. An ignored signal (SIGINT
    in a background job) stays ignored; signals keep their usual effect outside the main thread and on
    multi-host runs (whose hosts would stop at different steps)."""
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    received: list[int] = []

    def handler(signum: int, frame) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        log(f"{signal.Signals(signum).name}: stopping after this step with a checkpoint and an export (again: at once)")

    watched = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, handler) for sig in watched}
    try:
        yield lambda: bool(received)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def initial_head(rc: RunConfig, tcfg: TargetConfig) -> tuple[DraftConfig, dict, dict | None]:
    """The head to start from: --init-head's (fp32 master weights, its vocabulary map), else a fresh head of the
    run's kind shaped like a target layer. -> (config, trainable parameters, the vocabulary map or None)."""
    if not rc.init_head:
        if rc.kind == "eagle1":
            dcfg = eagle1_head_like(tcfg)
        else:
            dcfg = eagle3_head_like(tcfg, rc.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, tcfg.vocab_size))
        return dcfg, objective.split_trainable(init_params(draft.param_specs(dcfg), jax.random.key(rc.seed)))[0], None
    dcfg, head = loading.load_draft(rc.init_head, tcfg, kind=rc.kind, dtype=np.float32)
    if rc.draft_vocab_size not in (None, dcfg.draft_vocab_size):
        raise EagleError(
            f"draft vocabulary size {rc.draft_vocab_size} differs from {rc.init_head}'s ({dcfg.draft_vocab_size})"
        )
    return (dcfg, *objective.split_trainable(head))


def record_settings(rc: RunConfig, out: Path) -> None:
    """run.json: the run's settings (rewritten when they changed, e.g. a raised --steps)."""
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(dataclasses.asdict(rc)))
    if not (out / "run.json").is_file() or files.read_json(out / "run.json") != settings:
        files.write_json_atomic(out / "run.json", settings)


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


def metrics_record(
    rc: RunConfig, done: int, micro: list[dict], tokens: int, flops: float, elapsed: float, peak: float
) -> dict:
    """One metrics.jsonl line from the micro-batches of the step just done; `tokens` and the head's model `flops`
    are those of the steps since the last line, `elapsed` their time, `peak` the measured matmul rate. `acc`:
    EAGLE-3 the accuracy of each TTT step, EAGLE-1 the top-1/2/3 accuracies of the next token."""
    ms = jax.device_get(micro)
    correct = np.sum([m["n_correct"] for m in ms], axis=0)
    denom = np.sum([m["loss_mask_sum"] for m in ms], axis=0)
    acc = (correct / (denom + 1e-6)).tolist()
    if rc.kind == "eagle1":
        kind = {name: float(np.mean([m[name] for m in ms])) for name in ("vloss", "ploss")}
    else:
        kind = {
            "plosses": np.mean([m["plosses"] for m in ms], axis=0).tolist(),
            "tau_sim": float(objective.simulated_tau(np.asarray(acc))),
        }
    return {
        "step": done,
        "loss": float(np.mean([m["loss"] for m in ms])),
        "acc": acc,
        **kind,
        "grad_norm": float(np.mean([m["grad_norm"] for m in ms])),
        "lr": float(lr_schedule(rc.lr, rc.warmup_steps, rc.steps, rc.kind)(done - 1)),
        "tokens_per_s": tokens / elapsed,
        "head_flops_per_s": flops / elapsed,
        "of_peak": flops / elapsed / peak,
    }


def postfix(m: dict) -> str:
    acc = "/".join(f"{a:.2f}" for a in m["acc"])
    kind = f"acc {acc} tau~{m['tau_sim']:.2f}" if "tau_sim" in m else f"top-1/2/3 {acc}"
    return (
        f"loss {m['loss']:.3f} {kind} {m['tokens_per_s']:.0f} tok/s "
        f"{m['head_flops_per_s'] / 1e9:.0f} GFLOP/s ({m['of_peak']:.0%} of peak)"
    )


def restore(mgr, state: dict, sh: Shardings, out: Path) -> tuple[dict, int]:
    """The latest checkpoint's state and step (`state` and 0 without one); the logs are cut back to that step."""
    start = 0
    restored = checkpoints.restore_latest(
        mgr, checkpoints.abstract_like(state, {"params": sh.trainable, "opt_state": sh.opt_state}), log
    )
    if restored is not None:
        state, meta = restored
        start = int(meta["step"])
        log(f"resuming {out} at step {start}")
    for name in ("metrics.jsonl", "tau.jsonl"):
        truncate_log(out / name, start)
    return state, start


def train(rc: RunConfig) -> dict:
    """Run (or resume) training; returns the last logged metrics record."""
    out = check_run_folder(rc)
    mesh = sharding.make_mesh(rc.mesh or f"fsdp={jax.device_count()}")
    sharding.check_dims(mesh, {"batch": rc.batch_size}, "batch size")
    check_resume(rc, out)

    tcfg = loading.target_config(rc.target)  # weights later: bad settings and data fail first
    tokenizer = data.chat_tokenizer(rc.target, rc.chat_template)
    dcfg, trainable_init, init_map = initial_head(rc, tcfg)
    sharding.check_mesh(mesh, tcfg, dcfg)  # an axis that does not divide a model dimension: an error, not replication
    if rc.features:
        store = features.FeatureStore(rc.features)
        store.check(tcfg, rc.data, rc.chat_template, rc.max_length, dcfg.feature_layers(tcfg))
        examples = store.examples()
        log(f"data: {len(examples)} sequences from {rc.features}")
    else:
        examples, stats = data.load_examples(rc.data, tokenizer, rc.max_length, tcfg.vocab_size)
        log(f"data: {stats.summary()}")
    prompts = tau_prompts(rc.tau_prompts, tokenizer) if rc.tau_prompts else None
    record_settings(rc, out)
    maps = vocab_map(rc, out, examples, dcfg, init_map)

    compute_dtype = jnp.bfloat16 if rc.bf16 else jnp.float32
    optimizer = make_optimizer(rc.lr, rc.warmup_steps, rc.steps, rc.grad_accum, rc.kind)
    sh = make_shardings(tcfg, dcfg, optimizer, mesh)
    # from a store the step reads only the target's readout; the whole target only measures the real tau
    tparams = (
        loading.load_target(rc.target, compute_dtype, mesh, progress=True)[1] if prompts or not rc.features else None
    )
    if rc.features:
        readout = jax.tree.map(lambda x: x.astype(compute_dtype), store.readout())
        weights = sharding.place(readout, {k: sh.target[k] for k in readout})
    else:
        weights = tparams
    vmap_dev = sharding.place(maps, sh.vocab_map)
    trainable = sharding.place(trainable_init, sh.trainable)
    opt_state = jax.jit(optimizer.init, out_shardings=sh.opt_state)(trainable)
    state = {"params": trainable, "opt_state": opt_state}

    with checkpoints.opened(out / "ckpt", rc.keep) as mgr:
        state, start = restore(mgr, state, sh, out)
        noise_seed = rc.seed if rc.kind == "eagle1" and rc.noise else None
        step_fn = make_train_step(
            tcfg, dcfg, optimizer, rc.ttt_steps, sh, compute_dtype, offline=bool(rc.features), noise_seed=noise_seed
        )
        plan = data.BatchPlan(
            [len(ex.input_ids) for ex in examples], rc.batch_size, rc.seed, data.bucket_sizes(rc.max_length)
        )
        pad_id = store.pad_id if rc.features else tokenizer.pad_token_id or 0

        def batch_of(rows: np.ndarray, length: int) -> data.Batch:
            if rc.features:
                return store.batch(rows, length, ("hidden",) if rc.kind == "eagle1" else features.STORED)
            return data.collate([examples[i] for i in rows], length, pad_id)

        tree = parse_envelopes(rc.tau_tree)[0] if rc.tau_tree else DynamicTree()

        def real_tau(step: int) -> None:
            params = {**state["params"], **vmap_dev}
            tau = measure_tau(tparams, tcfg, params, dcfg, prompts, rc.tau_max_new_tokens, tree)
            seen = plan.real_tokens(step * rc.grad_accum)
            append_jsonl(out / "tau.jsonl", {"step": step, "tau": tau, "prompts": len(prompts), "tokens_seen": seen})
            bar.write(f"step {step}: engine tau {tau:.3f} on {len(prompts)} held-out prompts")

        bar = tqdm(total=rc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
        if prompts and start == 0 and rc.tau_every:
            real_tau(0)
        last: dict = {}
        peak = matmul_peak(mesh, compute_dtype)
        log(f"matmul peak measured on this mesh: {peak / 1e9:.0f} GFLOP/s")
        tokens, flops, t0 = 0, 0.0, time.perf_counter()
        with stop_between_steps() as stop_asked:
            for step in range(start, rc.steps):
                micro = []
                for k in range(rc.grad_accum):
                    index = step * rc.grad_accum + k
                    rows, length = plan(index)
                    batch = batch_of(rows, length)
                    lengths = batch.attention_mask.sum(axis=1)
                    tokens += int(lengths.sum())
                    args = place_batch(batch, sh)
                    if rc.kind == "eagle1":
                        flops += objective.eagle1_flops(dcfg, lengths, batch.loss_mask.sum())
                        args += (np.int32(index),)  # the index draws the noise
                    else:
                        flops += objective.ttt_flops(dcfg, rc.ttt_steps, lengths, batch.loss_mask.sum())
                    state["params"], state["opt_state"], m = step_fn(
                        state["params"], state["opt_state"], vmap_dev, weights, *args
                    )
                    micro.append(m)
                done = step + 1
                if done % rc.log_every == 0 or done == rc.steps:
                    jax.block_until_ready(state)  # the steps so far are done: the interval is their time
                    last = metrics_record(rc, done, micro, tokens, flops, time.perf_counter() - t0, peak)
                    append_jsonl(out / "metrics.jsonl", last)
                    bar.set_postfix_str(postfix(last), refresh=False)
                    tokens, flops, t0 = 0, 0.0, time.perf_counter()
                bar.update(1)
                if prompts and rc.tau_every and done % rc.tau_every == 0:
                    real_tau(done)
                if done % rc.save_every == 0 or done == rc.steps or stop_asked():
                    checkpoints.save(mgr, done, state, {"step": done, "micro_batches": done * rc.grad_accum})
                if stop_asked():
                    break
        bar.close()

    exported = export_head({**state["params"], **maps}, dcfg, tcfg, out)
    png = plot_curves(out) if (out / "metrics.jsonl").is_file() else None
    log(f"exported {', '.join(exported)} to {out / 'export'}" + (f"; curves in {png}" if png else ""))
    if stop_asked() and done < rc.steps:
        log(f"stopped at step {done} of {rc.steps}; the same command continues the run")
        raise KeyboardInterrupt
    return last

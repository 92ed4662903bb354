"""Train the demo's small Llama target on ShareGPT (plain next-token loss) and save it in HF format.

    python -m train.pretrain --tokenizer demo/target --out demo/target --minutes 40

Conversations (mostly-ASCII ShareGPT records) are rendered with the tokenizer's chat template,
tokenized, concatenated and cut into sequences of --seq-len tokens; the loss is next-token cross
entropy over every token. The model is `eagle_jax.target.forward` (a Llama); the optimiser AdamW
with warm-up and cosine decay. With --minutes the schedule follows wall time (the run ends on time
on a loaded machine); with --steps it follows the step count (reproducible step for step).
The result (config.json, generation_config.json, model.safetensors) loads with
`eagle_jax.hf_io.load_target` and with transformers' LlamaForCausalLM.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np


def hf_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, inter: int, tok) -> dict:
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


def hf_tensors(params: dict, cfg) -> dict[str, np.ndarray]:
    """Our (dense Llama) parameter tree -> HF tensor names and layouts (weights [out, in])."""
    p = {k: np.asarray(v, np.float32) for k, v in _flat(params).items()}
    out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = p["lm_head"].T
    names = {
        "attn_norm": ("input_layernorm.weight", False),
        "q": ("self_attn.q_proj.weight", True),
        "k": ("self_attn.k_proj.weight", True),
        "v": ("self_attn.v_proj.weight", True),
        "o": ("self_attn.o_proj.weight", True),
        "mlp_norm": ("post_attention_layernorm.weight", False),
        "mlp.gate": ("mlp.gate_proj.weight", True),
        "mlp.up": ("mlp.up_proj.weight", True),
        "mlp.down": ("mlp.down_proj.weight", True),
    }
    for ours, (theirs, transpose) in names.items():
        stacked = p[f"layers.{ours}"]
        for i in range(cfg.num_layers):
            out[f"model.layers.{i}.{theirs}"] = stacked[i].T if transpose else stacked[i]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def save_model(out: Path, params: dict, cfg, config: dict, log: dict) -> None:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(params, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
           "pad_token_id": config["pad_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")


def export_half(src: Path, dst: Path) -> None:
    """Copy a saved target (and its tokenizer) with float16 weights: half the size, for shipping."""
    import shutil

    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(np.float16) for k, v in load_file(str(src / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["torch_dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("generation_config.json", "training_log.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    print(f"wrote {dst} (float16 weights, {(dst / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")


def token_stream(tok, data: Path | None, max_conversations: int | None) -> np.ndarray:
    from train.tokenizer import english_conversations, sharegpt_path

    convs = english_conversations(data or sharegpt_path())
    if max_conversations:
        convs = convs[:max_conversations]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in convs]
    ids = []
    for i in range(0, len(texts), 512):
        for row in tok(texts[i:i + 512], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
    return np.asarray(ids, np.int32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default="demo/target")
    ap.add_argument("--out", default="demo/target")
    ap.add_argument("--data", default=None)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the run")
    ap.add_argument("--minutes", type=float, default=None, help="wall-time budget (schedule follows time)")
    ap.add_argument("--steps", type=int, default=None, help="step budget (schedule follows steps)")
    ap.add_argument("--max-conversations", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench", type=int, default=0, help="time this many steps and exit")
    ap.add_argument("--save-every", type=float, default=5.0, help="minutes between checkpoints")
    ap.add_argument("--export-half", nargs=2, metavar=("SRC", "DST"),
                    help="only copy the trained target SRC to DST with float16 weights, and exit")
    args = ap.parse_args(argv)
    if args.export_half:
        export_half(Path(args.export_half[0]), Path(args.export_half[1]))
        return
    if args.minutes is None and args.steps is None and not args.bench:
        ap.error("give --minutes or --steps")

    import jax
    import jax.numpy as jnp
    import optax
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from eagle_jax.models import target as target_model
    from eagle_jax.models.config import target_config_from_hf
    from eagle_jax.models.params import init_params

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = hf_config(len(tok), args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, tok)
    cfg = target_config_from_hf(config)
    params = init_params(target_model.param_specs(cfg), jax.random.PRNGKey(args.seed))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.2f}M parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}", flush=True)

    t0 = time.time()
    stream = token_stream(tok, Path(args.data) if args.data else None,
                          args.max_conversations or (200 if args.bench else None))
    T = args.seq_len
    n_seq = len(stream) // (T + 1)
    seqs = stream[: n_seq * (T + 1)].reshape(n_seq, T + 1)
    print(f"data: {len(stream)} tokens -> {n_seq} sequences of {T + 1} ({time.time() - t0:.0f}s)", flush=True)

    opt = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=args.lr, b1=0.9, b2=0.95, weight_decay=0.1),
    )
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        x, y = batch[:, :-1], batch[:, 1:]
        b = x.shape[0]
        cache = target_model.init_cache(cfg, b, T)
        pos = jnp.broadcast_to(jnp.arange(T)[None], (b, T))
        out = target_model.forward(p, cfg, x, pos, cache, feature_layers=())
        logp = jax.nn.log_softmax(out.logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

    @jax.jit
    def step(p, s, batch, lr):
        s[1].hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    rng = np.random.default_rng(args.seed)

    def lr_at(frac: float) -> float:
        if frac < args.warmup:
            return args.lr * frac / args.warmup
        f = min(1.0, (frac - args.warmup) / (1 - args.warmup))
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))

    order = rng.permutation(n_seq)
    cursor = 0

    def next_batch():
        nonlocal order, cursor
        if cursor + args.batch > len(order):
            order, cursor = rng.permutation(n_seq), 0
        idx = order[cursor:cursor + args.batch]
        cursor += args.batch
        return jnp.asarray(seqs[idx])

    if args.bench:
        params, opt_state, loss = step(params, opt_state, next_batch(), 1e-4)
        loss.block_until_ready()
        t = time.time()
        for _ in range(args.bench):
            params, opt_state, loss = step(params, opt_state, next_batch(), 1e-4)
        loss.block_until_ready()
        dt = (time.time() - t) / args.bench
        print(f"bench: {dt:.3f}s/step, {args.batch * T / dt:.0f} tokens/s, loss {float(loss):.3f}")
        return

    out = Path(args.out)
    budget_s = args.minutes * 60 if args.minutes else None
    start = time.time()
    history, losses, i, last_save = [], [], 0, time.time()
    bar = tqdm(total=args.steps or int(budget_s), unit="step" if args.steps else "s", file=sys.stdout,
               mininterval=10, dynamic_ncols=False, ncols=100)
    while True:
        elapsed = time.time() - start
        frac = i / args.steps if args.steps else elapsed / budget_s
        if frac >= 1:
            break
        params, opt_state, loss = step(params, opt_state, next_batch(), lr_at(frac))
        i += 1
        if i % 10 == 0:
            losses.append(float(loss))
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", lr=f"{lr_at(frac):.2e}", step=i)
        if i % 100 == 0:
            history.append({"step": i, "seconds": round(elapsed, 1), "loss": round(float(np.mean(losses[-10:])), 4),
                            "tokens": i * args.batch * T})
        bar.update(1 if args.steps else min(time.time() - start, budget_s) - bar.n)
        log = {"steps": i, "tokens": i * args.batch * T, "parameters": n_params, "args": vars(args),
               "history": history}
        if time.time() - last_save > args.save_every * 60:
            save_model(out, params, cfg, config, log)
            last_save = time.time()
    bar.close()
    log = {"steps": i, "tokens": i * args.batch * T, "parameters": n_params, "args": vars(args),
           "seconds": round(time.time() - start, 1), "final_loss": float(np.mean(losses[-10:])) if losses else None,
           "history": history}
    save_model(out, params, cfg, config, log)
    print(f"saved {out}: {i} steps, {log['tokens']} tokens, loss {log['final_loss']}", flush=True)


if __name__ == "__main__":
    main()

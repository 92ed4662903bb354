"""Hugging Face target + official EAGLE head -> one store, and a check of the conversion against torch.

`verify` runs one forward of the target through transformers' torch model and one of the head through
a plain torch re-implementation of the official head, and the same forwards in JAX from the written
store, and reports the largest differences. Both sides use the stored (possibly rounded) weights and
compute in float32, so the numbers measure the conversion, not the dtype.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.errors import EagleError
from eagle_jax.io import files, hf, official, store
from eagle_jax.models import draft, target

VERIFY_TOKENS = 16


def convert(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    out: str | Path,
    dtype=None,
    kind: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    quantize: str | None = None,
) -> Path:
    """Read, check and store (the target quantised by `quantize`, e.g. "int8", so that no start quantises it
    again); the head is checked against the target before the target is read."""
    target_dir = Path(target_dir)
    files.check_output_directory(
        out, [p for p in (target_dir, draft_dir) if p is not None], overwrite, store.STORE_NAMES
    )
    tcfg = hf.load_target_config(target_dir)
    if quantize:
        from eagle_jax.models import quantize as quantizing  # qwix loads only for a quantised target

        quantizing.check(tcfg, quantize)
    draft_part = None
    if draft_dir is not None:
        dcfg, dparams = official.load_head(draft_dir, tcfg, kind, dtype)
        draft_part = store.DraftPart(files.read_json(Path(draft_dir) / "config.json"), dcfg.kind, dparams)
    _, tparams = hf.load_target(target_dir, dtype, progress=progress)
    if quantize:
        tparams = jax.device_get(quantizing.quantize_target(tcfg, tparams, quantize)[1])
    gen_path = target_dir / "generation_config.json"
    generation = files.read_json(gen_path) if gen_path.is_file() else None
    target_part = store.TargetPart(files.read_json(target_dir / "config.json"), tparams, generation, quantize)
    return store.save(out, target_part, draft_part, tokenizer_from=target_dir, overwrite=overwrite, progress=progress)


# ---------------------------------------------------------------- verification (torch only here)


def _cat(parts):
    import torch

    return torch.cat(parts, dim=-1)


def _rms(x, w, eps):
    import torch

    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, cos, sin):
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _torch_rope(raw_cfg: dict, head_dim: int, seq: int):
    """(cos, sin) [T, 1, D] from transformers' own rotary embedding for this rope config."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    cfg = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        **{k: raw_cfg[k] for k in keys if raw_cfg.get(k) is not None},
    )
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, seq, head_dim), torch.arange(seq)[None])
    return cos[0, :, None, :], sin[0, :, None, :]


def _torch_layer(t: dict, prefix: str, x, residual, cos, sin, heads: int, kv_heads: int, head_dim: int, eps: float):
    """One official decoder layer on the normed input x (causal attention over all T positions)."""
    import torch

    seq = x.shape[0]
    q = (x @ t[f"{prefix}.self_attn.q_proj.weight"].T).view(seq, heads, head_dim)
    k = (x @ t[f"{prefix}.self_attn.k_proj.weight"].T).view(seq, kv_heads, head_dim)
    v = (x @ t[f"{prefix}.self_attn.v_proj.weight"].T).view(seq, kv_heads, head_dim)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    scores = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, heads * head_dim)
    h = residual + attn @ t[f"{prefix}.self_attn.o_proj.weight"].T
    m = _rms(h, t[f"{prefix}.post_attention_layernorm.weight"], eps)
    gate = torch.nn.functional.silu(m @ t[f"{prefix}.mlp.gate_proj.weight"].T)
    return h + (gate * (m @ t[f"{prefix}.mlp.up_proj.weight"].T)) @ t[f"{prefix}.mlp.down_proj.weight"].T


def torch_draft_forward(t: dict, raw_cfg: dict, kind: str, embed, lm_head, tokens, features):
    """Plain torch forward of an official head over one sequence: (outputs [T, H], logits [T, V or Vd]).

    t: official tensors (float32); embed [V, H] and lm_head [V, H] are the target's; tokens [T];
    features [T, 3Ht] (EAGLE-3) or [T, H] (EAGLE-1).
    """
    hidden = int(raw_cfg["hidden_size"])
    heads = int(raw_cfg["num_attention_heads"])
    kv_heads = int(raw_cfg.get("num_key_value_heads") or heads)
    head_dim = int(raw_cfg.get("head_dim") or hidden // heads)
    eps = float(raw_cfg.get("rms_norm_eps") or 1e-6)
    cos, sin = _torch_rope(raw_cfg, head_dim, tokens.shape[0])
    emb = embed[tokens]
    if kind == "eagle3":
        h = features @ t["fc.weight"].T
        x = _cat([_rms(emb, t["midlayer.input_layernorm.weight"], eps), _rms(h, t["midlayer.hidden_norm.weight"], eps)])
        out = _torch_layer(t, "midlayer", x, h, cos, sin, heads, kv_heads, head_dim, eps)
        return out, _rms(out, t["norm.weight"], eps) @ t["lm_head.weight"].T
    x = _cat([emb, features]) @ t["fc.weight"].T
    if "fc.bias" in t:
        x = x + t["fc.bias"]
    layers = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    for i in range(layers):
        normed = _rms(x, t[f"layers.{i}.input_layernorm.weight"], eps) if i > 0 else x
        x = _torch_layer(t, f"layers.{i}", normed, x, cos, sin, heads, kv_heads, head_dim, eps)
    return x, x @ lm_head.T


def _rounded(x: np.ndarray, dtype):
    """float32 torch tensor of x after rounding it to the stored dtype (ints and bools unchanged)."""
    import torch

    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(dtype).astype(np.float32) if dtype is not None else x.astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(x))


def verify(
    store_dir: str | Path, target_dir: str | Path, draft_dir: str | Path | None, seed: int = 0
) -> dict[str, float]:
    """Largest |torch - jax| differences: target logits, and draft outputs and logits."""
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise EagleError("verifying needs torch: pip install 'eagle-jax[torch]'") from None
    m = store.read_manifest(store_dir)
    tcfg, tparams = store.load_target_store(store_dir, dtype=np.float32)
    stored = np.dtype(m.target_dtype) if m.target_dtype else None
    ids = np.random.default_rng(seed).integers(0, tcfg.vocab_size, (1, VERIFY_TOKENS))
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(_rounded(p.detach().numpy(), stored))
        ref = model(torch.from_numpy(ids), output_hidden_states=True)
    tokens = jnp.asarray(ids, jnp.int32)
    positions = jnp.arange(VERIFY_TOKENS)[None]
    out = target.forward(tparams, tcfg, tokens, positions, target.init_cache(tcfg, 1, VERIFY_TOKENS))
    report = {"target_logits": float(np.abs(np.asarray(out.logits) - ref.logits.numpy()).max())}
    if draft_dir is None or m.draft_config is None:
        return report
    dcfg, dparams = store.load_draft_store(store_dir, tcfg, dtype=np.float32)
    layers = (
        [ref.hidden_states[i] for i in dcfg.feature_layers(tcfg)] if dcfg.kind == "eagle3" else [ref.hidden_states[-1]]
    )
    features = torch.cat(layers, dim=-1)[0].float()
    tensors = {k: _rounded(v, np.dtype(m.draft_dtype)) for k, v in hf.read_tensors(draft_dir).items()}
    embed = torch.from_numpy(np.asarray(tparams["embed"]))
    lm_head = torch.from_numpy(np.asarray(target.output_head(tparams, tcfg)).T.copy())
    with torch.no_grad():
        t_out, t_logits = torch_draft_forward(
            tensors, m.draft_config, dcfg.kind, embed, lm_head, torch.from_numpy(ids[0]), features
        )
    hidden = draft.project_features(dparams, dcfg, jnp.asarray(features.numpy())[None])
    j_out, _ = draft.forward(
        dparams, dcfg, tparams["embed"], tokens, hidden, positions, draft.init_cache(dcfg, 1, VERIFY_TOKENS)
    )
    j_logits = draft.logits(dparams, dcfg, j_out, target.output_head(tparams, tcfg))
    report["draft_outputs"] = float(np.abs(np.asarray(j_out[0]) - t_out.numpy()).max())
    report["draft_logits"] = float(np.abs(np.asarray(j_logits[0]) - t_logits.numpy()).max())
    return report

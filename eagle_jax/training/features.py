"""Stored target features for offline head training: the frozen target runs once over the data.

`extract(FeaturesConfig(...))` tokenizes the conversations as training does (`data.load_examples`, same order,
same drops), runs the target over them in length-bucketed batches and stores what the TTT objective reads from
it: the fused features of the EAGLE-3 head's layers, the final normed hidden state (the logits of any draft
vocabulary are rebuilt from it with the target's readout, and it is EAGLE-1's feature) and the argmax over the
full vocabulary (the draft vocabulary's gate). A conversation of L tokens is stored with L + 1 rows: the last is
the first padding position (the pad token, seeing the conversation), whose target output the objective reads
after the last loss-masked token. The readout (embedding, and the lm_head when untied) is stored once, so a
training run from features needs none of the target's decoder layers.

FEATS/
  index.json      the settings (target, its config, feature layers, data files and sha256, max length, pad id,
                  dtype), the shards written so far and whether all are
  readout.npz     embed [V, Ht] and, for an untied target, lm_head [Ht, V] in the target's dtype
  shard-00000/    offsets.npy [n + 1] int64 (conversation i: rows offsets[i] .. offsets[i+1]), input_ids.npy [N]
                  int32 (the last row of each conversation the pad id), loss_mask.npy [N] int8, features.npy
                  [N, 3Ht], hidden.npy [N, Ht] (float32, or bfloat16 kept as its uint16 bits), argmax.npy [N] int32

A shard is written to a temporary folder and renamed, then entered in the index (with its size), so a run killed
at any point continues with the same command: shards not in the index, or not of the recorded size, are redone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from eagle_jax.decoding import sampling
from eagle_jax.errors import EagleError
from eagle_jax.io import files, loading
from eagle_jax.models.config import TargetConfig, eagle3_head_like
from eagle_jax.parallel import sharding
from eagle_jax.training import data, objective

FORMAT = 1
DTYPES = {"bf16": ml_dtypes.bfloat16, "fp32": np.float32}
STORED = ("features", "hidden", "argmax")  # the target's side of a conversation, in a batch's order
ARRAYS = ("offsets", "input_ids", "loss_mask", *STORED)
INDEX = "index.json"
READOUT = "readout.npz"
# settings that define what a store holds: a rerun must repeat them, a training run must match them
DEFINING = ("format", "target", "target_config", "feature_layers", "data", "max_length", "pad_id", "dtype")


@dataclasses.dataclass(frozen=True)
class FeaturesConfig:
    target: str  # store, HF folder or GGUF file
    data: tuple[str, ...]  # conversation files
    out: str  # the features folder
    max_length: int = 2048  # longer conversations are dropped (as training drops them)
    batch_size: int = 8  # conversations per target call
    shard_size: int = 256  # conversations per shard (the unit a killed run redoes)
    dtype: str = "bf16"  # storage dtype of features and hidden states: bf16 | fp32
    chat_template: str | None = None  # jinja file, for a tokenizer without a chat template


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def config_json(tcfg: TargetConfig) -> dict:
    """The target config as it is stored in the index (JSON values; `quantize` only when set, so that stores
    written before it existed still match)."""
    out = json.loads(json.dumps(dataclasses.asdict(tcfg)))
    if out["quantize"] is None:
        del out["quantize"]
    return out


def data_json(paths: Sequence[str | Path], chat_template: str | None) -> list[dict]:
    """The data files (absolute paths) and their sha256; the chat template file counts as data."""
    named = [*paths, *([chat_template] if chat_template else [])]
    return [{"path": str(Path(p).absolute()), "sha256": sha256(p)} for p in named]


def settings(fc: FeaturesConfig, tcfg: TargetConfig, pad_id: int) -> dict:
    """The defining settings of a store (`DEFINING`)."""
    return {
        "format": FORMAT,
        "target": str(Path(fc.target).absolute()),
        "target_config": config_json(tcfg),
        "feature_layers": list(eagle3_head_like(tcfg, 1).feature_layers(tcfg)),
        "data": data_json(fc.data, fc.chat_template),
        "max_length": fc.max_length,
        "pad_id": pad_id,
        "dtype": fc.dtype,
    }


def bytes_per_token(tcfg: TargetConfig, dtype: str) -> int:
    """Stored bytes per row: features, hidden state, argmax, input id, loss mask."""
    size = np.dtype(DTYPES[dtype]).itemsize
    return 4 * tcfg.hidden_size * size + 4 + 4 + 1


def _to_disk(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x


def _from_disk(x: np.ndarray, dtype: str) -> np.ndarray:
    """Undo `_to_disk` for an array stored from `dtype` (a `DTYPES` key or a numpy dtype name)."""
    return x.view(ml_dtypes.bfloat16) if dtype in ("bf16", "bfloat16") else x


# ---------------------------------------------------------------- writing


def _mismatch(path: Path, saved: dict, mine: dict, fix: str) -> EagleError:
    diffs = [k for k in DEFINING if saved.get(k) != mine.get(k)]
    shown = ", ".join(f"{k} ({_short(saved.get(k))}, now {_short(mine.get(k))})" for k in diffs)
    return EagleError(f"{path}: holds features made with another {shown}; {fix}")


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def _shard_bytes(folder: Path) -> int:
    return sum((folder / f"{name}.npy").stat().st_size for name in ARRAYS if (folder / f"{name}.npy").is_file())


def _open_folder(fc: FeaturesConfig, mine: dict) -> tuple[Path, dict]:
    """The output folder and its index: new, or an earlier run's with the same settings (its intact shards kept,
    any other shard folder of ours removed); anything else is refused before the target loads."""
    inputs = [fc.target, *fc.data, *([fc.chat_template] if fc.chat_template else [])]
    out = Path(fc.out)
    if out.is_dir() and any(out.iterdir()) and not (out / INDEX).is_file():
        raise EagleError(f"{out}: holds files but no {INDEX}, so it is not a features folder; choose a new one", "out")
    out = files.check_output_directory(out, inputs, overwrite=True, owned=None)
    if not (out / INDEX).is_file():
        return out, {**mine, "shards": [], "complete": False}
    index = files.read_json(out / INDEX)
    if any(index.get(k) != mine[k] for k in DEFINING):
        raise _mismatch(out, index, mine, "repeat its settings to continue it, or choose another --out")
    kept = []
    for shard in index.get("shards", []):
        folder = out / shard["name"]
        if folder.is_dir() and _shard_bytes(folder) == shard["bytes"] and len(kept) == int(shard["name"][6:]):
            kept.append(shard)
        else:
            break  # a damaged shard and everything after it are redone
    ours = {s["name"] for s in kept}
    for p in out.iterdir():
        if (p.name.startswith("shard-") or p.name.startswith(".shard-")) and p.name not in ours:
            shutil.rmtree(p)
    return out, {
        **index,
        "shards": kept,
        "complete": index.get("complete", False) and len(kept) == len(index["shards"]),
    }


@partial(jax.jit, static_argnames=("tcfg", "layers", "dtype"))
def _target_rows(tparams: dict, input_ids: jax.Array, attention_mask: jax.Array, *, tcfg, layers, dtype):
    """[B, T] -> features [B, T, 3Ht], hidden [B, T, Ht] (in `dtype`), full-vocabulary argmax [B, T] int32."""
    out = objective.target_outputs(tparams, tcfg, input_ids, attention_mask, layers)
    return out.features.astype(dtype), out.hidden.astype(dtype), sampling.argmax(out.logits)


def _write_shard(folder: Path, arrays: dict[str, np.ndarray]) -> int:
    tmp = folder.with_name("." + folder.name)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name in ARRAYS:
        with (tmp / f"{name}.npy").open("wb") as f:
            np.save(f, _to_disk(arrays[name]))
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, folder)
    return _shard_bytes(folder)


def _shard(
    tparams: dict,
    tcfg: TargetConfig,
    layers: tuple[int, ...],
    fc: FeaturesConfig,
    examples: Sequence[data.Example],
    pad_id: int,
    batch_sharding: NamedSharding | None,
    bar: tqdm,
) -> dict[str, np.ndarray]:
    """The stored rows of `examples` (in their order): the target over length-sorted batches padded to buckets."""
    buckets = data.bucket_sizes(fc.max_length + 1)
    dtype = jnp.dtype(DTYPES[fc.dtype])
    rows: list[tuple[np.ndarray, ...] | None] = [None] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    for s in range(0, len(order), fc.batch_size):
        part = order[s : s + fc.batch_size]
        chosen = [examples[i] for i in part]
        chosen += [chosen[-1]] * (fc.batch_size - len(chosen))  # a full batch: one program per bucket
        length = data.bucket_for(max(len(ex.input_ids) for ex in chosen) + 1, buckets)
        batch = data.collate(chosen, length, pad_id)
        ids, attn = batch.input_ids, batch.attention_mask
        if batch_sharding is not None:
            ids, attn = sharding.put(ids, batch_sharding), sharding.put(attn, batch_sharding)
        feats, hidden, top = jax.device_get(_target_rows(tparams, ids, attn, tcfg=tcfg, layers=layers, dtype=dtype))
        for r, i in enumerate(part):
            n = len(examples[i].input_ids) + 1
            rows[i] = (
                batch.input_ids[r, :n],
                batch.loss_mask[r, :n].astype(np.int8),
                feats[r, :n],
                hidden[r, :n],
                top[r, :n],
            )
        bar.update(len(part))
    ids, mask, feats, hidden, top = (np.concatenate(col) for col in zip(*rows))
    offsets = np.concatenate([[0], np.cumsum([len(r[0]) for r in rows])]).astype(np.int64)
    return {"offsets": offsets, "input_ids": ids, "loss_mask": mask, "features": feats, "hidden": hidden, "argmax": top}


def extract(fc: FeaturesConfig, mesh: Mesh | None = None) -> dict:
    """Store (or go on storing) the target's features of `fc.data` in `fc.out`; returns the index."""
    if fc.dtype not in DTYPES:
        raise EagleError(f"--dtype {fc.dtype}: choose one of {', '.join(DTYPES)}")
    for name in ("max_length", "batch_size", "shard_size"):
        if getattr(fc, name) < 1:
            raise EagleError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(fc, name)}")
    tcfg = loading.target_config(fc.target)
    if mesh is not None:
        sharding.check_mesh(mesh, tcfg, batch=fc.batch_size)
    tokenizer = data.chat_tokenizer(fc.target, fc.chat_template)
    pad_id = tokenizer.pad_token_id or 0
    out, index = _open_folder(fc, settings(fc, tcfg, pad_id))
    out.mkdir(parents=True, exist_ok=True)
    if index["complete"]:
        print(f"{out}: complete ({index['conversations']} conversations); nothing to do", flush=True)
        return index
    examples, stats = data.load_examples(fc.data, tokenizer, fc.max_length, tcfg.vocab_size)
    print(f"data: {stats.summary()}", flush=True)
    index.update(conversations=len(examples), tokens=stats.tokens, bytes_per_token=bytes_per_token(tcfg, fc.dtype))
    files.write_json_atomic(out / INDEX, index)
    tcfg, tparams = loading.load_target(fc.target, mesh=mesh, progress=True)
    if not (out / READOUT).is_file():
        readout = {"embed": np.asarray(tparams["embed"])}
        if not tcfg.tie_word_embeddings:
            readout["lm_head"] = np.asarray(tparams["lm_head"])
        files.save_npz_atomic(out / READOUT, **{k: _to_disk(v) for k, v in readout.items()})
    index["readout_dtype"] = str(np.asarray(tparams["embed"]).dtype)
    batch_sharding = None
    if mesh is None:
        tparams = jax.device_put(tparams)
    else:
        batch_sharding = NamedSharding(mesh, sharding.partition_spec(("batch", None)))
    layers = tuple(index["feature_layers"])
    done = sum(s["conversations"] for s in index["shards"])
    with tqdm(total=len(examples), initial=done, desc="features", unit="conv", dynamic_ncols=True) as bar:
        for start in range(done, len(examples), fc.shard_size):
            part = examples[start : start + fc.shard_size]
            arrays = _shard(tparams, tcfg, layers, fc, part, pad_id, batch_sharding, bar)
            name = _shard_name(len(index["shards"]))
            size = _write_shard(out / name, arrays)
            index["shards"].append({"name": name, "conversations": len(part), "bytes": size})
            files.write_json_atomic(out / INDEX, index)
    index["complete"] = True
    files.write_json_atomic(out / INDEX, index)
    return index


# ---------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class StoredBatch(data.Batch):
    """A right-padded training batch (`data.Batch`) with the target's stored side."""

    features: np.ndarray | None = None  # [B, T, 3Ht] stored dtype; zero past each conversation's padding row
    hidden: np.ndarray | None = None  # [B, T, Ht] stored dtype
    argmax: np.ndarray | None = None  # [B, T] int32


class FeatureStore:
    """A complete features folder, memory-mapped: conversations as training `data.Example`s, batches with their
    stored rows, and the target's readout."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / INDEX).is_file():
            raise EagleError(f"{self.path}: not a features folder (no {INDEX}); make one with python -m train.features")
        self.index = files.read_json(self.path / INDEX)
        if self.index.get("format") != FORMAT or not self.index.get("complete"):
            raise EagleError(
                f"{self.path}: its features are not complete; run the python -m train.features command that "
                "started it again to finish them"
            )
        self.dtype = self.index["dtype"]
        self.pad_id = int(self.index["pad_id"])
        self._shards = []
        for shard in self.index["shards"]:
            folder = self.path / shard["name"]
            if not folder.is_dir() or _shard_bytes(folder) != shard["bytes"]:
                raise EagleError(
                    f"{folder}: missing or not the size the index records; run python -m train.features again "
                    "to redo it"
                )
            self._shards.append({n: np.load(folder / f"{n}.npy", mmap_mode="r") for n in ARRAYS})
        self._where = [(k, i) for k, sh in enumerate(self._shards) for i in range(len(sh["offsets"]) - 1)]

    def check(
        self,
        tcfg: TargetConfig,
        data_paths: Sequence[str],
        chat_template: str | None,
        max_length: int,
        feature_layers: tuple[int, ...],
    ) -> None:
        """One-line error when the store was made from another target, data, chat template, maximum length or
        feature layers than a training run uses (an EAGLE-1 head reads none: `feature_layers` ())."""
        mine = {
            "target_config": config_json(tcfg),
            "data": [d["sha256"] for d in data_json(data_paths, chat_template)],
            "max_length": max_length,
        }
        saved = {
            "target_config": self.index["target_config"],
            "data": [d["sha256"] for d in self.index["data"]],
            "max_length": self.index["max_length"],
        }
        if feature_layers:
            mine["feature_layers"], saved["feature_layers"] = list(feature_layers), self.index["feature_layers"]
        names = {"target_config": "target", "data": "data (sha256 of the files and chat template)"}
        diffs = [k for k in mine if mine[k] != saved[k]]
        if diffs:
            shown = "; ".join(
                f"{names.get(k, k.replace('_', ' '))}: {_short(saved[k])} there, {_short(mine[k])} here" for k in diffs
            )
            raise EagleError(
                f"{self.path}: holds features of another {shown}; make features for this run "
                "with python -m train.features, or train with the settings they were made with"
            )

    def __len__(self) -> int:
        return len(self._where)

    def _rows(self, i: int, name: str) -> np.ndarray:
        k, j = self._where[i]
        shard = self._shards[k]
        return shard[name][shard["offsets"][j] : shard["offsets"][j + 1]]

    def examples(self) -> list[data.Example]:
        """The conversations (without their padding row), in data order."""
        return [
            data.Example(np.asarray(self._rows(i, "input_ids")[:-1]), np.asarray(self._rows(i, "loss_mask")[:-1]))
            for i in range(len(self))
        ]

    def batch(self, rows: Sequence[int], length: int, names: Sequence[str] = STORED) -> StoredBatch:
        """Conversations `rows` right-padded to `length` (with the store's pad id), their stored rows `names`
        (of `STORED`; an EAGLE-1 head reads only "hidden") in place."""
        tokens = data.collate(
            [data.Example(self._rows(i, "input_ids")[:-1], self._rows(i, "loss_mask")[:-1]) for i in rows],
            length,
            self.pad_id,
        )
        width = {n: self._shards[0][n].shape[1] for n in ("features", "hidden") if n in names}
        dtype = DTYPES[self.dtype]
        out = {n: np.zeros((len(rows), length, width[n]), dtype) for n in width}
        if "argmax" in names:
            out["argmax"] = np.zeros((len(rows), length), np.int32)
        for r, i in enumerate(rows):
            for n in out:
                part = np.asarray(self._rows(i, n)[:length])
                part = _from_disk(part, self.dtype) if n in width else part
                out[n][r, : len(part)] = part
        return StoredBatch(**vars(tokens), **out)

    def readout(self) -> dict[str, np.ndarray]:
        """The target's embed [V, Ht] (and lm_head [Ht, V] when untied), in its dtype."""
        with np.load(self.path / READOUT) as z:
            return {k: _from_disk(z[k], self.index["readout_dtype"]) for k in z.files}

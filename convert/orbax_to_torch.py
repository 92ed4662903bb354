"""Export a stored draft head to the official EAGLE format.

    python -m convert.orbax_to_torch --draft STORE_DIR --out EAGLE_DIR [--dtype bf16|fp16|fp32] [--overwrite]

STORE_DIR is a store written by `convert.torch_to_orbax` or by `eagle_jax.store.save_draft` (e.g. a
training run's head). EAGLE_DIR gets `config.json` (the head's official config), `model.safetensors`
and `pytorch_model.bin` (skipped with a warning when torch is missing) with exactly the official
keys, shapes and dtypes (`d2t` int64, `t2d` bool), as the upstream code and serving engines expect.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import store
from eagle_jax.models.draft import tensors_from_params


def _torch_tensor(x: np.ndarray):
    import torch

    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def _config(raw: dict, tensors: dict[str, np.ndarray]) -> dict:
    """The stored official config with its dtype field naming the exported dtype."""
    dtype = next(str(v.dtype) for v in tensors.values() if jnp.issubdtype(v.dtype, jnp.floating))
    field = "dtype" if "dtype" in raw and "torch_dtype" not in raw else "torch_dtype"
    return {**raw, field: dtype}


def export(store_dir: str | Path, out: str | Path, dtype=None, overwrite: bool = False) -> list[str]:
    """Write the official head files; returns the names written. The directory appears complete or not at all."""
    from safetensors.numpy import save_file

    out = Path(out).absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise EagleError(f"{out}: already exists and is not empty; choose another --out or pass --overwrite")
    m = store.read_manifest(store_dir)
    dcfg, params = store.load_draft_store(store_dir, dtype=dtype)
    tensors = tensors_from_params(params, dcfg)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(_config(m.draft_config, tensors), indent=2) + "\n")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    try:
        import torch
    except ImportError:
        command.warn("torch is not installed: pytorch_model.bin skipped (model.safetensors holds the same tensors)")
    else:
        torch.save({k: _torch_tensor(v) for k, v in tensors.items()}, tmp / "pytorch_model.bin")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return sorted(p.name for p in out.iterdir())


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m convert.orbax_to_torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="store directory holding a draft head")
    p.add_argument("--out", required=True, help="official head directory to write")
    p.add_argument("--dtype", choices=tuple(command.DTYPES), help="cast floating weights (default: the stored dtype)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    a = p.parse_args(argv)
    files = export(a.draft, a.out, command.parse_dtype(a.dtype), a.overwrite)
    print(f"wrote {', '.join(files)} to {Path(a.out).absolute()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

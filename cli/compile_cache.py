"""JAX's persistent compilation cache for every command: the second start of a command loads its programs.

Compiled programs are stored under `$EAGLE_JAX_CACHE/jax/<jax>-<jaxlib>-<platform>-<device kind>` (default
`~/.cache/eagle-jax/jax/...`), one folder per combination that must not share entries, so that a stale folder can
be deleted whole. JAX keys each entry by the program, the compile options and the XLA flags; reads and writes
take a file lock (two processes starting at once, e.g. the hosts of a server, do not corrupt it), only process 0
of a multi-host job writes, and least recently used entries are evicted beyond `MAX_BYTES`. An entry that cannot
be read is compiled again (JAX warns once per entry). The programs compiled ahead of time are also kept whole in
`executables/` inside it (`eagle_jax.decoding.executables`: a second start neither traces nor lowers them).
`EAGLE_JAX_COMPILE_CACHE=0` turns both off; a `JAX_COMPILATION_CACHE_DIR` set by the user is left as it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cli import demo

MAX_BYTES = 4 << 30  # LRU eviction beyond this; JAX's file lock comes with a size limit
OFF = "EAGLE_JAX_COMPILE_CACHE"


def folder() -> Path:
    """This process's cache folder: separate per jax/jaxlib version, platform and device kind."""
    import jax
    import jaxlib

    device = jax.devices()[0]
    kind = re.sub(r"[^A-Za-z0-9.]+", "_", device.device_kind).strip("_") or "unknown"
    return demo.cache_dir() / "jax" / f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{device.platform}-{kind}"


def enable() -> Path | None:
    """Point JAX's persistent cache at `folder()` (every program, however fast it compiled); the folder, or None
    when turned off. Call before the first compilation (after a multi-host launch's distributed start)."""
    import jax

    if os.environ.get(OFF, "1") == "0" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    path = folder()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path

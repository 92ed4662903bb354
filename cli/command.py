"""Command-line plumbing every entry point shares: one-line errors and warnings, exit code 2 for bad input.

Every entry point does

    def main(argv=None) -> int:
        return cli.run(_main, argv)

    if __name__ == "__main__":
        sys.exit(main())

where `_main(argv)` parses its flags with `cli.ArgumentParser` and raises `EagleError` for bad input. A command
that compiles in the background (the chat, the server) ends with `cli.finish(main())` instead, so that quitting
does not wait for those compilations.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from cli import compile_cache
from eagle_jax.errors import EagleError
from eagle_jax.parallel import distributed

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors (unknown flag, bad choice, missing value) raise `EagleError`."""

    def error(self, message: str) -> NoReturn:
        raise EagleError(f"{self.prog}: {message} (see --help)")


@contextlib.contextmanager
def flag(name: str, hint: str = "") -> Iterator[None]:
    """Name the flag a library error is about: `error: --mesh: bad mesh entry ...` (+ `hint`, e.g. what to pass)."""
    try:
        yield
    except EagleError as exc:
        raise EagleError(f"{name}: {exc}{'; ' + hint if hint else ''}") from None


@contextlib.contextmanager
def hint(text: str) -> Iterator[None]:
    """Append what to do on the command line to a library error: `error: ...; raise --max-len`."""
    try:
        yield
    except EagleError as exc:
        raise EagleError(f"{exc}; {text}", exc.setting) from None


def warn(message: str) -> None:
    """Print a one-line warning to stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    warn(str(message).splitlines()[0] if str(message).strip() else category.__name__)


def flag_of(setting: str, flags: Mapping[str, str] | None = None) -> str:
    """The flag that sets a library setting: `flags[setting]`, else `--` + the name with dashes (out -> --out)."""
    return (flags or {}).get(setting) or "--" + setting.replace("_", "-")


def message(exc: EagleError, flags: Mapping[str, str] | None = None) -> str:
    """An error's line as a command shows it: prefixed by the flag of its setting, when it names one."""
    return f"{flag_of(exc.setting, flags)}: {exc}" if exc.setting else str(exc)


def run(
    main: Callable[[Sequence[str] | None], int | None],
    argv: Sequence[str] | None = None,
    flags: Mapping[str, str] | None = None,
) -> int:
    """Call `main(argv)`; an `EagleError` becomes `error: ...` on stderr and exit code 2, naming the flag of the
    setting it is about (`flag_of`; `flags` maps settings whose flag is not `--` + their name).

    Python warnings raised meanwhile (e.g. a clamped token budget) print as one `warning:` line.
    On a multi-host launch (see `eagle_jax.distributed`) JAX's distributed runtime starts first, then the
    persistent compilation cache (`cli.compile_cache`) is switched on.
    """
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        distributed.maybe_initialize()
        compile_cache.enable()
        return int(main(argv) or 0)
    except EagleError as exc:
        print(f"error: {message(exc, flags)}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        warnings.showwarning = previous


def finish(code: int) -> NoReturn:
    """End the process with `code` without waiting for compilations still under way on worker threads (a normal
    exit joins those threads: seconds each): with one running, the process flushes its output and ends at once.
    A multi-host process ends normally (its distributed runtime shuts down with the others)."""
    from eagle_jax.decoding import programs

    if programs.compiling() and not distributed.is_multi_host():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def parse_dtype(name: str | None):
    """'bf16' | 'fp16' | 'fp32' -> a numpy dtype (bfloat16 via ml_dtypes); None stays None (keep the stored dtype)."""
    if name is None:
        return None
    import jax.numpy as jnp

    return jnp.dtype(DTYPES[name])


def absolute(path: str | None) -> str | None:
    """A path flag as a run records it: absolute (so a resumed run started elsewhere finds it); None stays None."""
    return str(Path(path).absolute()) if path else None


def shown_path(path: str | Path | None) -> str | None:
    """A path as reports record it: relative to the working folder when inside it, else its last part
    (reports are shared; the machine's folders are not part of them)."""
    if path is None:
        return None
    path = Path(path).absolute()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else path.name

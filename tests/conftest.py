"""Shared fixtures. Eight virtual CPU devices are configured before jax is imported."""

import os
import tempfile

# Tests are bound by compile time: LLVM's least optimising level compiles the same programs (same HLO, same fusions,
# the same code paths) faster (test_session: 104 s -> 85 s); subprocesses started by tests inherit the flags.
# XLA:CPU's older elemental emitters (--xla_cpu_use_fusion_emitters=false) compiled faster still, but the tests
# compile what every command compiles: the fusion emitters.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["EAGLE_JAX_CACHE"] = tempfile.mkdtemp(prefix="eagle-jax-cache-")  # measured budgets stay out of $HOME
os.environ.setdefault("EAGLE_JAX_COMPILE_WORKERS", "1")  # two test workers share two cores: one compile thread each
os.environ["EAGLE_JAX_COMPILE_CACHE"] = "0"  # no run depends on another; tests/test_compile_cache.py turns it on

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"


MAPS_KEPT = 30_000  # memory maps a test worker may hold before it lets go of its compiled programs


def _release() -> None:
    import gc

    import jax

    from eagle_jax.decoding import programs

    programs.forget()
    jax.clear_caches()
    gc.collect()


def _maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(scope="module", autouse=True)
def _release_programs():
    """After each test file, and after a test that left more than MAPS_KEPT memory maps, let go of the compiled
    programs nothing holds. Every XLA:CPU executable keeps memory maps of its code: past Linux's default limit of
    65,530 a compile cannot map its code and XLA crashes (segfault or abort) inside `backend_compile_and_load`."""
    yield
    _release()


@pytest.fixture(autouse=True)
def _bounded_maps():
    yield
    if _maps() > MAPS_KEPT:
        _release()


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN


@pytest.fixture(scope="session")
def reference():
    return np.load(GOLDEN / "reference.npz")


@pytest.fixture(scope="session")
def golden_target():
    from eagle_jax.io import hf

    return hf.load_target(GOLDEN / "target")


@pytest.fixture(scope="module")
def compiles():
    """Names of backend compilations seen from now on (one entry per compiled program)."""
    from jax import monitoring

    seen: list[str] = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: seen.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
    )
    return seen


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A folder shared by one test module's tests."""
    return tmp_path_factory.mktemp("module")


@pytest.fixture(scope="module")
def target_dir(golden_dir, workdir) -> Path:
    """The golden target with a chat template (weights linked): a `--target` for the training commands."""
    from convdata import templated_target_dir

    return templated_target_dir(golden_dir, workdir / "target")

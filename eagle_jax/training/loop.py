"""The one training loop: every run (an EAGLE-1 or EAGLE-3 head, a pretrained target) goes through `run`.

A run folder OUT holds run.json (the settings), ckpt/ (orbax training state), metrics.jsonl (one line per
logged step) and curves.png. A resumed run restores the newest intact checkpoint, cuts the logs back to its step
and continues with the same batches as an uninterrupted one. Ctrl-C (or SIGTERM) during the steps stops after
the current step with a checkpoint and the export, then raises KeyboardInterrupt; the same settings continue it.
What differs between runs (the step, its batches, the metrics, the export, the curves) is the `Job`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np
from tqdm import tqdm

from eagle_jax.errors import EagleError
from eagle_jax.io import files
from eagle_jax.training import checkpoints

PyTree = Any
LOGS = ("metrics.jsonl", "tau.jsonl")  # cut back to the restored step on resume


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """When a run ends, logs and saves: after `steps` updates, or `seconds` of training (the progress then follows
    the clock); a metrics line every `log_every` updates; a checkpoint every `save_every` updates or
    `save_seconds`, at the end and on a stop, `keep` of them kept."""

    steps: int | None
    seconds: float | None = None
    grad_accum: int = 1
    log_every: int = 10
    save_every: int | None = None
    save_seconds: float | None = None
    keep: int = 3

    def progress(self, done: int, seconds: float) -> float:
        """The fraction of the run done after `done` updates and `seconds` of training."""
        return done / self.steps if self.steps else seconds / self.seconds


@dataclasses.dataclass(frozen=True)
class Micro:
    """One micro-batch's step: the new state, its metrics (device values), its tokens and the model's flops."""

    state: PyTree
    metrics: dict
    tokens: int
    flops: float = 0.0


@dataclasses.dataclass(frozen=True)
class Interval:
    """The updates since the last metrics line: their tokens, the model's flops and their seconds; `trained` the
    run's seconds of training so far (across resumes)."""

    tokens: int
    flops: float
    seconds: float
    trained: float


@dataclasses.dataclass(frozen=True)
class Curves:
    """The panels of curves.png: the loss's title; the accuracy's title and per-column label (None: no panel);
    with `tau`, the simulated and measured tau against the step and the measured tau against the tokens seen."""

    loss: str
    accuracy: str | None = None
    accuracy_label: Callable[[int], str] = str
    tau: bool = False


class Job(Protocol):
    """What the loop asks of a run: its initial state (a placed pytree), one micro-batch's step, the metrics of a
    logged step, the export of the final state and the curves' labels."""

    state: PyTree
    curves: Curves

    def step(self, state: PyTree, index: int, progress: float) -> Micro:
        """Train on micro-batch `index` (its data fixed by the index) at `progress` (0..1) of the run."""

    def record(self, done: int, micro: Sequence[dict], interval: Interval) -> dict:
        """The metrics.jsonl line after `done` updates from the last update's micro-batch metrics (host values)."""

    def postfix(self, record: dict) -> str:
        """The progress bar's summary of a metrics line."""

    def reached(self, done: int, state: PyTree, write: Callable[[str], None]) -> None:
        """The state after `done` updates is new (0 at a fresh start): measure it if the run measures it."""

    def export(self, state: PyTree, done: int, trained: float) -> str:
        """Write the state after `done` updates and `trained` seconds out (at the end or a stop); what was
        written, for the log."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- run folder


class RunMismatch(EagleError):
    """The output folder holds a run started with other defining settings: (name, saved, now) in `diffs`."""

    def __init__(self, out: Path, diffs: list[tuple[str, object, object]]):
        self.out, self.diffs = out, diffs
        shown = "; ".join(f"{k}={saved!r} (now {now!r})" for k, saved, now in diffs)
        super().__init__(
            f"{out} holds a run started with {shown}; repeat those settings to resume or use a new output folder"
        )


def check_run_folder(out: Path, inputs: Sequence[str | None]) -> Path:
    """Refuse, before any work, an output folder that is a file, is or holds an input, or holds files but no
    run.json (a folder that is not a run: nothing in it is replaced); returns OUT."""
    if out.is_dir() and any(out.iterdir()) and not (out / "run.json").is_file():
        raise EagleError(
            f"{out}: holds files but no run.json, so it is not a training run; choose a new or empty folder", "out"
        )
    return files.check_output_directory(out, [p for p in inputs if p], overwrite=True, owned=None)


def check_resume(settings, out: Path, keys: Sequence[str]) -> None:
    """Refuse to resume a run in OUT (`settings` a frozen dataclass) that was started with different defining
    settings `keys` (`RunMismatch`) or more steps (run.json is left as it is)."""
    path = out / "run.json"
    if not path.is_file():
        return
    try:
        saved = files.read_json(path)
    except EagleError as exc:
        raise EagleError(f"{exc}; repair it (it holds the run's settings) or use a new run folder", "out") from None
    mine = json.loads(json.dumps(dataclasses.asdict(settings)))
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}  # for a setting newer than the run
    diffs = [(k, saved.get(k, defaults[k]), mine[k]) for k in keys if saved.get(k, defaults[k]) != mine[k]]
    if diffs:
        raise RunMismatch(out, diffs)
    if isinstance(saved.get("steps"), int) and isinstance(mine["steps"], int) and mine["steps"] < saved["steps"]:
        raise EagleError(
            f"{mine['steps']} is below the {saved['steps']} steps of the run in {out}; a resumed run keeps or raises "
            "its steps (run.json is left as it is)",
            "steps",
        )


def record_settings(settings, out: Path) -> None:
    """run.json: the run's settings (rewritten when they changed, e.g. a raised --steps)."""
    out.mkdir(parents=True, exist_ok=True)
    record = json.loads(json.dumps(dataclasses.asdict(settings)))
    if not (out / "run.json").is_file() or files.read_json(out / "run.json") != record:
        files.write_json_atomic(out / "run.json", record)


def truncate_log(path: Path, step: int) -> None:
    """Keep the complete lines of a JSONL log with 'step' <= step (what a resumed run will not repeat)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            kept.append(line + "\n")
    files.write_text_atomic(path, "".join(kept))


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log ([] when there is none)."""
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


# ---------------------------------------------------------------- the loop


@contextlib.contextmanager
def stop_between_steps() -> Iterator[Callable[[], bool]]:
    """Within: the first SIGINT or SIGTERM only asks the loop to stop after its current step (the function
    yielded says whether one came); a second one raises KeyboardInterrupt at once. An ignored signal (SIGINT
    in a background job) stays ignored; signals keep their usual effect outside the main thread and on
    multi-host runs (whose hosts would stop at different steps)."""
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    received: list[int] = []

    def handler(signum: int, frame) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        log(f"{signal.Signals(signum).name}: stopping after this step with a checkpoint and an export (again: at once)")

    watched = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, handler) for sig in watched}
    try:
        yield lambda: bool(received)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def restore(mgr, state: PyTree, out: Path) -> tuple[PyTree, dict]:
    """The latest checkpoint's state (placed as `state` is) and meta (`state` and {} without one); the logs are
    cut back to its step."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    restored = checkpoints.restore_latest(mgr, checkpoints.abstract_like(state, shardings), log)
    meta: dict = {}
    if restored is not None:
        state, meta = restored
        log(f"resuming {out} at step {int(meta['step'])}")
    for name in LOGS:
        truncate_log(out / name, int(meta.get("step", 0)))
    return state, meta


def run(job: Job, out: Path, settings: LoopSettings) -> dict:
    """Run (or resume) `job` in the run folder OUT; returns the last metrics line. A stop asked by a signal
    before the end raises KeyboardInterrupt once the state is saved and exported."""
    with checkpoints.opened(out / "ckpt", settings.keep) as mgr:
        state, meta = restore(mgr, job.state, out)
        done, trained = int(meta.get("step", 0)), float(meta.get("seconds", 0.0))
        total, unit = (settings.steps, "step") if settings.steps else (settings.seconds, "s")
        bar = tqdm(
            total=total, initial=done if settings.steps else int(trained), desc="train", unit=unit, dynamic_ncols=True
        )
        ended = settings.progress(done, trained) >= 1
        if done == 0:
            job.reached(0, state, bar.write)
        last: dict = {}
        tokens, flops, t0 = 0, 0.0, time.perf_counter()
        started, saved_at = time.perf_counter() - trained, time.perf_counter()
        with stop_between_steps() as stop_asked:
            while not ended:  # the same test ends the loop and logs and saves its last step
                progress = settings.progress(done, time.perf_counter() - started)
                micro = []
                for k in range(settings.grad_accum):
                    result = job.step(state, done * settings.grad_accum + k, progress)
                    state = result.state
                    micro.append(result.metrics)
                    tokens, flops = tokens + result.tokens, flops + result.flops
                done += 1
                trained = time.perf_counter() - started
                ended = settings.progress(done, trained) >= 1
                if done % settings.log_every == 0 or ended:
                    jax.block_until_ready(state)  # the steps so far are done: the interval is their time
                    interval = Interval(tokens, flops, time.perf_counter() - t0, trained)
                    last = job.record(done, jax.device_get(micro), interval)
                    append_jsonl(out / "metrics.jsonl", last)
                    bar.set_postfix_str(job.postfix(last), refresh=False)
                    tokens, flops, t0 = 0, 0.0, time.perf_counter()
                bar.update((done if settings.steps else int(min(trained, total))) - bar.n)  # whole seconds
                job.reached(done, state, bar.write)
                due = (settings.save_every and done % settings.save_every == 0) or (
                    settings.save_seconds and time.perf_counter() - saved_at > settings.save_seconds
                )
                if due or ended or stop_asked():
                    meta = {"step": done, "micro_batches": done * settings.grad_accum, "seconds": trained}
                    checkpoints.save(mgr, done, state, meta)
                    saved_at = time.perf_counter()
                if stop_asked():
                    break
        bar.close()

    exported = job.export(state, done, trained)
    png = plot_curves(out, job.curves) if (out / "metrics.jsonl").is_file() else None
    log(exported + (f"; curves in {png}" if png else ""))
    if stop_asked() and not ended:
        log(
            f"stopped at step {done}"
            + (f" of {settings.steps}" if settings.steps else "")
            + "; the same command continues the run"
        )
        raise KeyboardInterrupt
    return last


def plot_curves(out: Path, curves: Curves) -> Path | None:
    """OUT/curves.png: loss, accuracies, tau (simulated, and measured in tau.jsonl) and the measured tau against
    the tokens seen, against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(out / "metrics.jsonl")
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    panels = 1 + (curves.accuracy is not None) + 2 * curves.tau
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    loss, *axes = axes[0]
    loss.plot(steps, [r["loss"] for r in rows])
    loss.set(title=curves.loss, xlabel="step", yscale="log")
    if curves.accuracy is not None:
        panel, *axes = axes
        acc = np.asarray([r["acc"] for r in rows])
        for j in range(acc.shape[1]):
            panel.plot(steps, acc[:, j], label=curves.accuracy_label(j))
        panel.set(title=curves.accuracy, xlabel="step", ylim=(0, 1))
        panel.legend(fontsize=7)
    if curves.tau:
        _plot_tau(rows, read_jsonl(out / "tau.jsonl"), *axes)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_tau(rows: list[dict], taus: list[dict], by_step, by_tokens) -> None:
    """The simulated (in the metrics) and measured tau against the step; the measured against the tokens seen."""
    steps = [r["step"] for r in rows]
    if "tau_sim" in rows[0]:
        by_step.plot(steps, [r["tau_sim"] for r in rows], label="simulated tau")
    if taus:
        by_step.plot([t["step"] for t in taus], [t["tau"] for t in taus], "o-", label="engine tau")
    by_step.set(title="tau", xlabel="step")
    if "tau_sim" in rows[0] or taus:
        by_step.legend()
    seen = [t for t in taus if "tokens_seen" in t]
    by_tokens.plot([t["tokens_seen"] / 1e6 for t in seen], [t["tau"] for t in seen], "o-")
    by_tokens.set(title="engine tau on held-out prompts", xlabel="training tokens seen (millions)")

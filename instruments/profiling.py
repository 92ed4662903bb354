"""Where a compiled decode program spends its time: per named phase, and what it is made of.

The speculative cycle names its phases with `jax.named_scope` (context search, draft levels, rerank,
graft, tree mask, verify, sample, accept, compact, draft catch-up); XLA keeps those names in each
compiled op's metadata. `phase_times` runs a program once under `jax.profiler`, reads the time of every executed
op from the trace and adds it to the phase its metadata names. `op_census` counts the ops of a
compiled program by kind (sorts, top-k, scatters, gathers, dynamic-update-slices, loops, fusions,
dots), the usual suspects of a slow cycle.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax

PHASES = (
    "context",
    "draft_levels",
    "rerank",
    "graft",
    "tree_mask",
    "verify",
    "sample",
    "accept",
    "compact",
    "draft_catch_up",
)
CONTAINERS = ("while", "conditional", "call", "tuple", "get-tuple-element", "parameter", "constant", "bitcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^=]*?\b([a-z][\w\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its instruction lines."""
    blocks: dict[str, list[str]] = {}
    current: list[str] = []
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line.startswith(" "):
            current = blocks.setdefault(header.group(1), [])
        elif line.startswith(" "):
            current.append(line)
    return blocks


def _instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (opcode, op_name metadata) of a compiled program's text. An op XLA made without
    metadata (a fusion of ops it rewrote) takes the op_name found inside the computation it calls, else its
    first operand's."""
    blocks = _computations(hlo_text)
    first_name = {
        name: next((m.group(1) for line in lines if (m := _OP_NAME.search(line))), "") for name, lines in blocks.items()
    }
    out: dict[str, tuple[str, str]] = {}
    for lines in blocks.values():
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            named, called = _OP_NAME.search(line), _CALLS.search(line)
            op_name = named.group(1) if named else first_name.get(called.group(1), "") if called else ""
            if not op_name:
                operands = re.findall(r"%([\w.\-]+)", line[m.end() :].split(")", 1)[0])
                op_name = next((out[o][1] for o in operands if o in out and out[o][1]), "")
            out[m.group(1)] = (m.group(2), op_name)
    return out


def phase_of(op_name: str, phases: tuple[str, ...] = PHASES) -> str:
    """The phase a compiled op belongs to, from the scopes in its metadata ('other' when none)."""
    scopes = op_name.split("/")
    return next((p for p in phases if p in scopes), "other")


def phase_times(compiled: Any, run: Callable[[], Any], phases: tuple[str, ...] = PHASES) -> dict[str, float]:
    """Seconds each phase's ops executed during one `run()` of the `compiled` program (under the profiler,
    which adds a little to every op: compare shares, or scale to an untraced time)."""
    ops = _instructions(compiled.as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(run())
        finally:
            jax.profiler.stop_trace()
        with gzip.open(sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1]) as f:
            events = json.load(f)
    times: dict[str, float] = collections.defaultdict(float)
    for event in events["traceEvents"]:
        op = ops.get(event.get("name", ""))
        if event.get("ph") != "X" or op is None or op[0] in CONTAINERS:
            continue
        times[phase_of(op[1], phases)] += event["dur"] * 1e-6
    return dict(times)


def op_census(compiled: Any) -> dict[str, int]:
    """Counts of the ops a compiled program executes, by kind (fusions by kind, custom calls by target, e.g.
    top-k); the insides of fusions and of reducers are not counted."""
    blocks = _computations(compiled.as_text())
    inner = {
        m.group(1)
        for lines in blocks.values()
        for line in lines
        for m in re.finditer(r"\b(?:calls|to_apply|comparator)=%?([\w.\-]+)", line)
    }
    census: collections.Counter = collections.Counter()
    for name, lines in blocks.items():
        if name in inner:
            continue
        for line in lines:
            m = _INSTRUCTION.match(line)
            if not m or m.group(2) in CONTAINERS[2:]:
                continue
            kind = m.group(2)
            if kind == "custom-call":
                target = _CUSTOM_TARGET.search(line)
                kind = f"custom-call:{target.group(1) if target else '?'}"
            elif kind == "fusion":
                fused = re.search(r"\bkind=(\w+)", line)
                kind = f"fusion:{fused.group(1) if fused else '?'}"
            census[kind] += 1
    return dict(census.most_common())

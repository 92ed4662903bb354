"""Structured output in a request: OpenAI's `response_format` and vLLM's `structured_outputs`, read into a
`grammar.Constraint` and compiled within a time bound (off the event loop: requests are parsed on a worker)."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

from eagle_jax.decoding import grammar
from eagle_jax.decoding.grammar import Constraint, GrammarError, Grammars
from eagle_jax.errors import EagleError

FORMAT_HELP = (
    '\'response_format\' must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
    '"json_schema": {"name": ..., "schema": {...}}}'
)
PARAM = "response_format"
OUTPUTS_HELP = "'structured_outputs' must be an object with one of 'json', 'regex', 'choice' or 'grammar'"


class Refused(EagleError):
    """A constraint the request cannot have; `param` names its field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def constraint(body: dict) -> Constraint | None:
    """The constraint a request body asks for (None: free text)."""
    fmt, outputs = body.get("response_format"), body.get("structured_outputs")
    if fmt not in (None, {"type": "text"}) and outputs is not None:
        raise Refused("give either 'response_format' or 'structured_outputs', not both", "structured_outputs")
    try:
        if outputs is not None:
            return _outputs(outputs)
        return _format(fmt)
    except GrammarError as exc:
        raise Refused(str(exc), "structured_outputs" if outputs is not None else "response_format") from None


def _format(fmt: Any) -> Constraint | None:
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise Refused(FORMAT_HELP, "response_format")
    if fmt["type"] == "json_object":
        return Constraint.json_object()
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise Refused(f"'response_format.json_schema.schema' is missing or not an object; {FORMAT_HELP}", PARAM)
    return Constraint.json_schema(spec["schema"])


def _outputs(outputs: Any) -> Constraint:
    given = [k for k in ("json", "regex", "choice", "grammar") if isinstance(outputs, dict) and outputs.get(k)]
    if len(given) != 1:
        raise Refused(OUTPUTS_HELP, "structured_outputs")
    kind, value = given[0], outputs[given[0]]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise Refused(f"'structured_outputs.json' is not valid JSON: {exc}", "structured_outputs") from None
        return Constraint.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list):
            raise Refused("'structured_outputs.choice' must be a list of strings", "structured_outputs")
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise Refused(f"'structured_outputs.{kind}' must be a string", "structured_outputs")
    return Constraint.regex(value) if kind == "regex" else Constraint.grammar(value)


_COMPILER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eagle-jax-grammar")


def compile_bounded(grammars: Grammars, c: Constraint, param: str, seconds: float = grammar.COMPILE_SECONDS) -> None:
    """Compile `c` (or find it cached) in at most `seconds`; raises Refused naming the problem."""
    try:
        _COMPILER.submit(grammars.check, c).result(timeout=seconds)
    except concurrent.futures.TimeoutError:
        raise Refused(f"the {c.kind} took over {seconds:g} s to compile; simplify it", param) from None
    except GrammarError as exc:
        raise Refused(str(exc), param) from None

"""What a generation request's output must match, as the neutral `Constraint` the engine enforces token by
token (serve/engine/constraints.py): vLLM's structured-output kinds read from whichever field a wire format
gives them in (`constraint_of`), and what a tool_choice and an output format make of the output together
(`tool_or_format`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from serve.api.tool_calls import ToolPlan
from serve.engine.types import Constraint
from serve.errors import InvalidRequest


def constraint_of(kind: str, value: Any, where: str) -> Constraint:
    """vLLM's structured-output kinds (guided_* and structured_outputs.*) as a neutral constraint, whose
    errors name the field `where`."""
    return replace(_constraint_kind(kind, value, where), source=where)


def _constraint_kind(kind: str, value: Any, where: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            return Constraint.json_schema(value)
        if isinstance(value, dict | bool):
            return Constraint.json_schema(value)
        raise InvalidRequest(f"{where} must be a JSON Schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{where} must be a list of strings")
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string")
    return Constraint.regex(value) if kind == "regex" else Constraint.grammar(value)


def tool_or_format(plan: ToolPlan, constraint: Constraint | None) -> Constraint | None:
    """What a request's tool_choice and its output format (`constraint`) make of the output together, as
    OpenAI's API does, where the format applies to the turn's text and a tool call has none: a forced call
    (a named function, `required`) is that call's constraint; `auto` is calls or the format's JSON; without
    tools (or with `none`), the format's."""
    forced = plan.constraint()
    if forced is not None:
        return forced
    if plan.mode == "auto" and constraint is not None:
        return plan.calls_or(constraint)
    return constraint

"""What an OpenAI-compatible request's output must match: OpenAI's response_format (a Responses request's
text.format), vLLM's structured-output fields, and a chat's tool_choice with them, each read with
serve/api/http/constraints.py into the neutral `Constraint` the engine enforces token by token
(serve/engine/constraints.py)."""

from __future__ import annotations

from typing import Any

from serve.api.http.constraints import constraint_of, tool_or_format
from serve.api.openai.protocol import ChatCompletionRequest, SamplingRequest
from serve.api.tool_calls import ToolPlan
from serve.engine.types import Constraint
from serve.errors import InvalidRequest


def _format_type(value: Any, where: str) -> str:
    """An output format's type (`{"type": "text" | "json_object" | "json_schema", ...}`)."""
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(f"{where}.type must be text, json_object or json_schema")
    return str(value["type"])


def _schemaless(kind: str) -> Constraint | None:
    """The constraint of a format type that needs no schema: any JSON object, or any text."""
    return Constraint.json_object() if kind == "json_object" else None


def _response_format(value: Any) -> Constraint | None:
    kind = _format_type(value, "response_format")
    if kind != "json_schema":
        return _schemaless(kind)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequest('response_format.json_schema needs a schema: {"name": ..., "schema": {...}}')
    return constraint_of("json", spec["schema"], "response_format.json_schema.schema")


def text_format(text: dict[str, Any] | None) -> Constraint | None:
    """A Responses request's `text.format`: response_format's types, a json_schema's schema beside its
    type."""
    value = (text or {}).get("format")
    if value is None:
        return None
    kind = _format_type(value, "text.format")
    if kind != "json_schema":
        return _schemaless(kind)
    if "schema" not in value:
        raise InvalidRequest(
            'text.format needs a schema: {"type": "json_schema", "name": ..., "schema": {...}}'
        )
    return constraint_of("json", value["schema"], "text.format.schema")


def structured_output(body: SamplingRequest) -> Constraint | None:
    """What the output must match: OpenAI's response_format, or vLLM's guided_json / guided_regex /
    guided_choice / guided_grammar, or its newer structured_outputs {json, regex, choice, grammar}. At most
    one may be given; each is enforced token by token (serve/engine/constraints.py)."""
    extra = body.model_extra or {}
    found: list[tuple[str, Constraint]] = []
    if extra.get("response_format") is not None:
        constraint = _response_format(extra["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for kind in ("json", "regex", "choice", "grammar"):
        if extra.get(f"guided_{kind}") is not None:
            found.append((f"guided_{kind}", constraint_of(kind, extra[f"guided_{kind}"], f"guided_{kind}")))
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest('structured_outputs must be an object such as {"json": {...}}')
        for kind in ("json", "regex", "choice", "grammar"):
            if outputs.get(kind) is not None:
                where = f"structured_outputs.{kind}"
                found.append((where, constraint_of(kind, outputs[kind], where)))
    if len(found) > 1:
        raise InvalidRequest(
            f"give one structured-output constraint, not {len(found)}: {[w for w, _ in found]}"
        )
    return found[0][1] if found else None


def chat_constraint(body: ChatCompletionRequest, plan: ToolPlan) -> Constraint | None:
    """A chat's constraint: its tool_choice's and its structured output's together (`tool_or_format`)."""
    return tool_or_format(plan, structured_output(body))

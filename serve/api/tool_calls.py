"""OpenAI's `tools` and `tool_choice` on /v1/chat/completions: a tool call is a constraint and a parser.

- A named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained to a JSON
  value of the function's `parameters` schema (no schema: any JSON object) and becomes that one call's
  `arguments`.
- `required`: the output is constrained to a JSON array (at least one element; one when
  `parallel_tool_calls` is false) of `{"name": <a tool's name>, "parameters": <that tool's arguments>}`
  objects (vLLM's format); each element becomes a call.
- `auto` (the default when tools are given): the chat template receives the tools and the model decides.
  Its output is read in the tool-call format the template declares (Hermes / Qwen, Mistral, Llama 3 JSON;
  serve/api/tool_formats.py), or textgen's convention, Hermes' `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks, when it declares none.
- `none`: the template receives the tools, the output is plain content.

The engine never hears of tools: it gets a `Constraint` (or none), and this module turns text into calls.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve.api.tool_formats import DEFAULT_FORMAT, AutoStream, ToolCall, ToolCallFormat
from serve.engine.types import Constraint, ConstraintKind, lark_json
from serve.errors import InvalidRequest

ANY_OBJECT: dict[str, Any] = {"type": "object"}
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class _Open(BaseModel):
    # Fields OpenAI may add are kept: the template gets the tools as the client sent them (transformers' way).
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_Open):
    name: str = Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -, at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object")
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Open):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(_Open):
    """A call of an earlier assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of it: the template's `tools`, the constraint, how to read the output."""

    mode: Mode
    tools: tuple[Tool, ...]
    named: str | None = None  # the function of mode "named"
    parallel: bool = True  # required: more than one call allowed
    format: ToolCallFormat = DEFAULT_FORMAT  # how auto reads the calls: the chat template's format

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as transformers' apply_chat_template hands them to a template (the request's dicts)."""
        return [tool.model_dump(exclude_unset=True) for tool in self.tools] if self.tools else None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.function.name for tool in self.tools)

    @property
    def constrained(self) -> bool:
        return self.mode in ("named", "required")

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            index = self.names.index(self.named or "")
            schema = self.tools[index].function.parameters or ANY_OBJECT
            return replace(Constraint.json_schema(schema), source=f"tools[{index}].function.parameters")
        if self.mode == "required":
            schema = required_schema(self.tools, self.parallel)
            return replace(Constraint.json_schema(schema), source="tools (with tool_choice required)")
        return None

    def calls_or(self, answer: Constraint) -> Constraint:
        """`auto` beside an output format: the output is calls in the chat template's format, or the
        format's JSON (a JSON schema or any object). Another kind of constraint (vLLM's regex, choice,
        grammar) is the output's own, as without tools."""
        if answer.kind == ConstraintKind.JSON_OBJECT:
            answer_schema: dict[str, Any] = ANY_OBJECT
        elif answer.kind == ConstraintKind.JSON_SCHEMA:
            answer_schema = _schema_object(answer)
        else:
            return answer
        form = self.format
        call = calls_schema(self.tools, form.arguments_key, array=form.calls_array, parallel=self.parallel)
        grammar = (
            f"start: answer | calls\nanswer: {lark_json(answer_schema)}\ncall: {lark_json(call)}\n"
            f"calls: {form.calls_rule(self.parallel)}\n"
        )
        return replace(Constraint.grammar(grammar), source=f"tools and {answer.field_name}")


def _schema_object(constraint: Constraint) -> dict[str, Any]:
    """A JSON_SCHEMA constraint's schema as an object (`true`: any JSON value)."""
    try:
        schema = json.loads(constraint.text)
    except ValueError:
        raise InvalidRequest(f"{constraint.field_name} is not valid: not JSON") from None
    if schema is True:
        return {}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{constraint.field_name} is not valid: a schema is an object or true")
    return schema


def tool_plan(
    tools: Sequence[Tool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    form: ToolCallFormat = DEFAULT_FORMAT,
) -> ToolPlan:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` checked against each other; `form`:
    the chat template's tool-call format, which auto's output is read in."""
    tools = tuple(tools or ())
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"{len(tools)} tools given; at most {MAX_TOOLS}")
    names = [tool.function.name for tool in tools]
    duplicates = sorted(name for name, count in Counter(names).items() if count > 1)
    if duplicates:
        raise InvalidRequest(f"tools: function names must be unique; repeated: {', '.join(duplicates)}")
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools and choice != "none":
        raise InvalidRequest("tool_choice needs tools: give the functions in tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names the function {choice.function.name!r}, which tools does not define "
                f"(defined: {', '.join(names)})"
            )
        return ToolPlan("named", tools, named=choice.function.name)
    return ToolPlan(choice, tools, parallel=parallel is not False, format=form)


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """An array of {"name", "parameters"} objects, one anyOf branch per tool (vLLM's format)."""
    return calls_schema(tools, "parameters", array=True, parallel=parallel)


def calls_schema(tools: Sequence[Tool], key: str, *, array: bool, parallel: bool = True) -> dict[str, Any]:
    """One call object (`{"name": ..., key: <its arguments>}`, one anyOf branch per tool), or an array of
    them (at least one; one unless `parallel`). Each tool's `$defs` move to the root, where their
    `#/$defs/...` references point once the schema is nested (vLLM does the same)."""
    defs: dict[str, Any] = {}
    branches = []
    for index, tool in enumerate(tools):
        parameters = dict(tool.function.parameters or ANY_OBJECT)
        lifted = parameters.pop("$defs", None) or {}
        if not isinstance(lifted, dict):
            raise InvalidRequest(f"tools[{index}].function.parameters.$defs must be an object of schemas")
        for name, definition in lifted.items():
            if name in defs and defs[name] != definition:
                raise InvalidRequest(
                    f"tools[{index}].function.parameters.$defs.{name} differs from another tool's "
                    "definition of that name: where any tool may be called their $defs must agree"
                )
            defs[name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"anyOf": branches}
    if array:
        schema = {"type": "array", "minItems": 1, "items": schema}
        if not parallel:
            schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_message(
    index: int,
    role: str,
    content: str | None,
    tool_calls: Sequence[ToolCallIn] | None = None,
    tool_call_id: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """A history message as templates expect it: an assistant's calls with their arguments as
    `template_arguments` gives them, a tool's result with its id."""
    message: dict[str, Any] = {"role": role, "content": content}
    if name is not None:
        message["name"] = name
    if role == "tool":
        if tool_call_id is None:
            raise InvalidRequest(f"messages[{index}].tool_call_id is required for a tool message")
        message["tool_call_id"] = tool_call_id
    if tool_calls:
        if role != "assistant":
            raise InvalidRequest(f"messages[{index}].tool_calls: only an assistant message makes calls")
        message["tool_calls"] = [_call_for_template(call) for call in tool_calls]
        if content is None:
            message["content"] = ""  # simple templates add content to strings
    return message


def template_arguments(arguments: str | dict[str, Any] | None) -> Any:
    """A history call's arguments as the template gets them: JSON text parsed (transformers' templates
    iterate or `tojson` a mapping; vLLM parses them the same way), blank or none as {}, and text that is not
    JSON (a call cut short at max_tokens, which a client echoes back with the tool's error) as the raw
    string, as OpenAI takes it. A template that needs a mapping there refuses it (ChatTemplate.render)."""
    if not isinstance(arguments, str):
        return {} if arguments is None else arguments
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_for_template(call: ToolCallIn) -> dict[str, Any]:
    out = call.model_dump(exclude_none=True)
    out["function"] = {**out["function"], "arguments": template_arguments(call.function.arguments)}
    return out


# --- reading the output ----------------------------------------------------------------------------------


_HEADER = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


@dataclass
class CallDelta:
    """A piece of a call as it streams: `name` is set on its first piece, `arguments` holds new text."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class RequiredStream:
    """Reads `required`'s output, `[{"name": "f", "parameters": {...}}, ...]`, as it streams: each element's
    name once its header is complete, then its parameters' text as it comes (the raw text is the call's
    `arguments`, so a streamed call and a unary one are the same). The constraint guarantees the shape; a
    string-aware bracket count finds where the parameters end."""

    def __init__(self) -> None:
        self._buffer = ""  # the header being read
        self._in_arguments = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.calls: list[ToolCall] = []
        self._arguments: list[str] = []

    def feed(self, text: str) -> list[CallDelta]:
        deltas: list[CallDelta] = []
        position = 0
        while position < len(text):
            if not self._in_arguments:
                self._buffer += text[position:]
                position = len(text)
                match = _HEADER.match(self._buffer)
                if match is None:
                    break
                name = json.loads(f'"{match.group(1)}"')
                self.calls.append(ToolCall(name, ""))
                self._arguments.append("")
                deltas.append(CallDelta(len(self.calls) - 1, "", name, self.calls[-1].id))
                text, position = self._buffer[match.end() :], 0
                self._buffer = ""
                self._in_arguments = True
                continue
            end = self._scan(text, position)
            piece = text[position:end]
            if piece:
                self._arguments[-1] += piece
                deltas.append(CallDelta(len(self.calls) - 1, piece))
            if end < len(text):  # the element's closing brace: the next header follows
                self._in_arguments = False
                self.calls[-1] = ToolCall(self.calls[-1].name, self._arguments[-1], self.calls[-1].id)
                position = end + 1
            else:
                position = end
        return _merged_deltas(deltas)

    def _scan(self, text: str, position: int) -> int:
        """Where the parameters end in `text` from `position` on (the index of the element's "}"), or
        len(text) when they go on."""
        for i in range(position, len(text)):
            char = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                if self._depth == 0:
                    return i
                self._depth -= 1
        return len(text)

    def finish(self) -> list[ToolCall]:
        """The calls read (the last one's arguments as far as they came, when the output was cut short)."""
        if self._in_arguments:
            self.calls[-1] = ToolCall(self.calls[-1].name, self._arguments[-1], self.calls[-1].id)
        return list(self.calls)


def _merged_deltas(deltas: list[CallDelta]) -> list[CallDelta]:
    """A call's first piece and the arguments that follow in the same text as one delta."""
    out: list[CallDelta] = []
    for delta in deltas:
        if out and out[-1].index == delta.index and delta.name is None:
            out[-1].arguments += delta.arguments
        else:
            out.append(delta)
    return out


class Reply:
    """One choice's output read as its request's tools say: `feed` each piece of text (a stream's, or the
    whole text at once), then `finish`; `message()` is the unary response's message."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._named = ToolCall(plan.named or "", "")
        self._named_started = False
        self._required = RequiredStream()
        self._auto = AutoStream(plan.names, plan.format)

    def read(self, text: str) -> tuple[str, list[CallDelta]]:
        """This piece of text as the content that can go out now and the pieces of calls it makes."""
        mode = self._plan.mode
        if mode == "named":
            first, self._named_started = not self._named_started, True
            self._named = ToolCall(self._named.name, self._named.arguments + text, self._named.id)
            return "", [CallDelta(0, text, self._named.name, self._named.id) if first else CallDelta(0, text)]
        if mode == "required":
            return "", self._required.feed(text)
        if mode == "auto":
            text = self._auto.feed(text)
        self._content.append(text)
        return text, []

    def feed(self, text: str) -> dict[str, Any]:
        """The stream delta's fields for this piece of text ({}: nothing to send yet)."""
        content, calls = self.read(text)
        if calls:
            return {"tool_calls": [call.as_dict() for call in calls]}
        return {"content": content} if content or self._plan.mode == "none" else {}

    def end(self, reason: str) -> tuple[str, list[ToolCall], str]:
        """The content held until the end (auto's, around its calls), every call, and the finish reason from
        OpenAI's plain one ("stop" or "length"): a complete output that made calls finishes with
        "tool_calls". Auto's calls are read here; the others' went out piece by piece."""
        mode, content = self._plan.mode, ""
        if mode == "named":
            self._calls = [self._named]
        elif mode == "required":
            self._calls = self._required.finish()
        elif mode == "auto":
            held, self._calls = self._auto.finish()
            content = held or ""
            self._content.append(content)
        called = bool(self._calls) and reason == "stop"
        return content, list(self._calls), "tool_calls" if called else reason

    def finish(self, reason: str) -> tuple[dict[str, Any], str]:
        """The last delta's fields and the finish reason (`end`'s)."""
        content, calls, reason = self.end(reason)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls and self._plan.mode == "auto":
            delta["tool_calls"] = [{"index": i, **c.as_dict()} for i, c in enumerate(calls)]
        return delta, reason

    def message(self) -> dict[str, Any]:
        text = "".join(self._content)
        content: str | None = text
        if self._plan.mode != "none":
            content = (text.strip() if self._calls else text) or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self._calls:
            message["tool_calls"] = [call.as_dict() for call in self._calls]
        return message

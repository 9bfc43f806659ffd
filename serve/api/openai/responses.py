"""OpenAI's Responses API (`POST /v1/responses`) as a translation of the chat completions route.

A Responses request becomes the chat completion it means (input items and instructions as messages, function
tools and tool_choice in chat's shape, text.format as response_format, max_output_tokens as max_tokens), the
chat route serves it (same scheduler, constraints, tool-call parsing, limits and errors), and its answer comes
back in the Responses shape: output items (a message with output_text, function_call items), usage, and
for a stream Responses' typed events (response.created ... response.output_text.delta ... response.completed).
Stateless: `previous_response_id` and `store: true` are refused (nothing is kept to continue from).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from serve.api.openai.protocol import AT_LEAST_ONE
from serve.errors import InvalidRequest

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# Chat completion fields a Responses request may carry too (vLLM's sampling extras), passed on as they are.
SAMPLING_EXTRAS = (
    "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias",
)  # fmt: skip


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses request this server reads; others are ignored, as elsewhere."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    input: str | Annotated[list[dict[str, Any]], AT_LEAST_ONE] = Field(
        description="a user message, or message and function-call items"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = False
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "json_schema", ...}}')
    tools: list[dict[str, Any]] | None = Field(None, description="function tools")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = Field(None, description="refused: responses are not stored")
    store: bool | None = Field(None, description="true is refused: responses are not stored")


def chat_body(body: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request a Responses request means; InvalidRequest for what it cannot be."""
    if body.previous_response_id is not None:
        raise InvalidRequest("previous_response_id: this server stores no responses; send the whole input")
    if body.store:
        raise InvalidRequest("store: this server stores no responses; leave store unset or false")
    if body.input == []:  # nothing to answer, instructions or not (OpenAI refuses it too)
        raise InvalidRequest("input is empty: give a string or at least one item")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    messages += [_message(i, item) for i, item in enumerate(items)]
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": _merged_calls(messages),
        "stream": bool(body.stream),
    }
    for name, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("parallel_tool_calls", body.parallel_tool_calls),
    ):
        if value is not None:
            chat[name] = value
    extra = body.model_extra or {}
    chat |= {name: extra[name] for name in SAMPLING_EXTRAS if extra.get(name) is not None}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    return chat


def _message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function"}
        call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else json.dumps(output)
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": text}
    if kind != "message" or item.get("role") not in ROLES:
        raise InvalidRequest(
            f"input[{index}]: expected a message (role user, system, developer or assistant), a "
            f"function_call or a function_call_output item; got type {kind!r}, role {item.get('role')!r}"
        )
    return {"role": ROLES[item["role"]], "content": _text(index, item.get("content"))}


def _text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise InvalidRequest(f"input[{index}].content: only text parts (input_text, output_text)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise InvalidRequest(f"input[{index}].content must be a string or a list of text parts")


def _merged_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive function_call items are one assistant message with several calls, as chat has them."""
    out: list[dict[str, Any]] = []
    for message in messages:
        previous = out[-1] if out else None
        if message.get("tool_calls") and previous is not None and previous.get("tool_calls"):
            previous["tool_calls"] = previous["tool_calls"] + message["tool_calls"]
        else:
            out.append(message)
    return out


def _chat_tool(index: int, tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools[{index}].type is {tool.get('type')!r}: only function tools are served")
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text_format: Any) -> dict[str, Any]:
    if not isinstance(text_format, dict):
        raise InvalidRequest(
            'text.format must be an object: {"type": "text" | "json_object" | "json_schema"}'
        )
    if text_format.get("type") == "json_schema":
        spec = {k: v for k, v in text_format.items() if k in ("name", "schema", "strict", "description")}
        return {"type": "json_schema", "json_schema": spec}
    return {"type": text_format.get("type")}


# --- the answer ---------------------------------------------------------------------------------------------


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(TypedDict):
    """The response (`object: "response"`), whole or as the streamed events carry it."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]  # message and function_call items
    incomplete_details: dict[str, str] | None
    error: dict[str, Any] | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: str | None
    store: bool
    metadata: dict[str, str]
    usage: ResponseUsage | None


class Draft:
    """A response being written: its id, the request's echo, and what the chat route produced so far."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body = body
        self.model = model
        self.text = ""
        self.calls: dict[int, dict[str, Any]] = {}  # chat's tool-call index -> id, name, arguments
        self.finish: str | None = None
        self.usage: ResponseUsage | None = None

    def feed_message(self, message: dict[str, Any]) -> None:
        """A whole chat message (non-streamed)."""
        self.text = message.get("content") or ""
        for index, call in enumerate(message.get("tool_calls") or []):
            self.calls[index] = {
                "id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
            }

    def feed_call_delta(self, delta: dict[str, Any]) -> None:
        call = self.calls.setdefault(delta.get("index", 0), {"id": None, "name": None, "arguments": ""})
        call["id"] = delta.get("id") or call["id"]
        function = delta.get("function") or {}
        call["name"] = function.get("name") or call["name"]
        call["arguments"] += function.get("arguments") or ""

    @property
    def status(self) -> Literal["completed", "incomplete", "in_progress"]:
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def message_item(self, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": self.text, "annotations": []}
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" or self.text else [],
        }

    def call_item(self, index: int) -> dict[str, Any]:
        call = self.calls[index]
        return {
            "type": "function_call",
            "id": f"fc_{call['id']}",
            "call_id": call["id"],
            "name": call["name"],
            "arguments": call["arguments"],
            "status": "completed",
        }

    def output(self) -> list[dict[str, Any]]:
        items = [self.message_item("completed")] if self.text or not self.calls else []
        return items + [self.call_item(i) for i in sorted(self.calls)]

    def response(self, output: list[dict[str, Any]] | None = None) -> ResponseObject:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "model": self.model,
            "output": self.output() if output is None else output,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}},
            "previous_response_id": None,
            "store": False,
            "metadata": {},
            "usage": self.usage,
        }

    def take_usage(self, usage: dict[str, Any]) -> None:
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            },
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }


def from_chat(draft: Draft, completion: dict[str, Any]) -> ResponseObject:
    """The response to a non-streamed request, from the chat completion the route returned."""
    (choice,) = completion["choices"]
    draft.feed_message(choice["message"])
    draft.finish = choice["finish_reason"]
    draft.take_usage(completion["usage"])
    return draft.response()


async def events(draft: Draft, chat_stream: AsyncIterable[str | bytes | memoryview]) -> AsyncIterator[str]:
    """The Responses event stream of a streamed request, from the chat route's server-sent events."""
    writer = _EventWriter(draft)
    yield writer.event("response.created", response=draft.response([]))
    yield writer.event("response.in_progress", response=draft.response([]))
    try:
        async for raw in chat_stream:
            for chunk in _chunks(raw):
                if "error" in chunk:  # the chat stream failed after it began: say so and end
                    error = chunk["error"]
                    yield writer.event("error", code=error.get("code"), message=error["message"])
                    return
                for out in writer.chunk(chunk):
                    yield out
    finally:  # a client that left: the chat stream cancels its request now, not when collected
        close = getattr(chat_stream, "aclose", None)
        if close is not None:
            await close()
    for out in writer.closing():
        yield out


class _EventWriter:
    """Numbered Responses events for one response, from the chat chunks it is fed."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.number = 0
        self.started = False  # the message item (text) has begun
        self.where = {"item_id": draft.message_id, "output_index": 0}

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def chunk(self, chunk: dict[str, Any]) -> list[str]:
        draft, out = self.draft, []
        if chunk.get("usage"):
            draft.take_usage(chunk["usage"])
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            for call in delta.get("tool_calls") or []:
                draft.feed_call_delta(call)
            text = delta.get("content")
            if text:
                if not self.started:
                    self.started = True
                    item = draft.message_item("in_progress")
                    out.append(self.event("response.output_item.added", output_index=0, item=item))
                    part = {"type": "output_text", "text": "", "annotations": []}
                    out.append(
                        self.event("response.content_part.added", **self.where, content_index=0, part=part)
                    )
                draft.text += text
                out.append(
                    self.event("response.output_text.delta", **self.where, content_index=0, delta=text)
                )
            if choice.get("finish_reason"):
                draft.finish = choice["finish_reason"]
        return out

    def closing(self) -> list[str]:
        draft, out, where = self.draft, [], self.where
        if self.started:
            part = {"type": "output_text", "text": draft.text, "annotations": []}
            out.append(self.event("response.output_text.done", **where, content_index=0, text=draft.text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item = draft.message_item("completed")
            out.append(self.event("response.output_item.done", output_index=0, item=item))
        for position, index in enumerate(sorted(draft.calls), start=int(self.started)):
            item = draft.call_item(index)
            place = {"item_id": item["id"], "output_index": position}
            out.append(
                self.event(
                    "response.output_item.added", output_index=position, item={**item, "arguments": ""}
                )
            )
            out.append(self.event("response.function_call_arguments.delta", **place, delta=item["arguments"]))
            out.append(
                self.event("response.function_call_arguments.done", **place, arguments=item["arguments"])
            )
            out.append(self.event("response.output_item.done", output_index=position, item=item))
        draft.finish = draft.finish or "stop"  # a stream that ended without a finish reason
        final = "response.incomplete" if draft.status == "incomplete" else "response.completed"
        out.append(self.event(final, response=draft.response()))
        return out


def _chunks(raw: str | bytes | memoryview) -> list[dict[str, Any]]:
    text = raw if isinstance(raw, str) else bytes(raw).decode()
    out = []
    for block in text.split("\n\n"):
        data = block.strip().removeprefix("data:").strip()
        if data and data != "[DONE]":
            out.append(json.loads(data))
    return out

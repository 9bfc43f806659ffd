"""A /v1/responses body → its plan: the Responses request read as the chat it means (`instructions` and its
`input` items as messages, its function tools as chat's, `text.format` as the constraint), one choice; its
errors name the Responses fields (`input.N`, `max_output_tokens`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve.api.common import CallRecord, LoadedModel
from serve.api.http.constraints import tool_or_format
from serve.api.http.translate import (
    ChatPlan,
    chat_label,
    chat_prompt,
    generation_options,
    generation_requests,
    joined_text,
    model_tool_plan,
    validated,
)
from serve.api.openai.protocol import FunctionCallItem, FunctionCallOutputItem, ResponsesRequest
from serve.api.openai.structured_output import text_format
from serve.api.tool_calls import (
    CalledFunction,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCallIn,
    ToolChoice,
    ToolPlan,
    template_message,
)
from serve.api.validation import RESPONSES_FIELDS
from serve.errors import InvalidRequest


@dataclass
class ResponsesPlan(ChatPlan):
    """A Responses request served as the chat it means (one choice; logprobs when `include` asks)."""

    request: ResponsesRequest  # its fields are echoed in the response
    context_length: int  # the model's: an output cut short there is incomplete for its own reason


async def responses_plan(body: ResponsesRequest, model: LoadedModel, record: CallRecord) -> ResponsesPlan:
    """A Responses request as the chat it means: `instructions` and the `input` items as messages, function
    tools, `text.format` as the constraint, `max_output_tokens` as max_tokens; its errors name the Responses
    fields. `record.prompt` as chat_plan sets it."""
    if body.previous_response_id is not None:
        raise InvalidRequest("previous_response_id: this server stores no responses; send the whole input")
    if body.store:
        raise InvalidRequest("store: this server stores no responses; leave store unset or false")
    if body.max_output_tokens == 0:
        raise InvalidRequest(
            "max_output_tokens = 0 generates nothing: give 1 or more "
            "(or leave it out for the server's default)"
        )
    _check_metadata(body.metadata or {})
    _check_reasoning(body.reasoning)
    choice = _responses_tool_choice(body.tool_choice)
    tools = model_tool_plan(model, _function_tools(body.tools), choice, body.parallel_tool_calls)
    logprobs = _output_logprobs(body, tools)
    constraint = tool_or_format(tools, text_format(body.text))
    options = generation_options(
        body, body.max_output_tokens, constraint, logprobs=logprobs, top_logprobs=body.top_logprobs or 0
    )
    prompts = [await chat_prompt(_input_messages(body), tools, model, record)]
    stream = bool(body.stream)
    requests = generation_requests(prompts, options, 1, model, record.request_id, stream, RESPONSES_FIELDS)
    label = chat_label(constraint, tools)
    context = model.limits.context_length
    return ResponsesPlan(prompts, requests, 1, stream, False, label, tools, logprobs, body, context)


# The roles of a Responses message item, as the chat template knows them.
RESPONSES_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_MODES: dict[str, ToolChoice] = {"none": "none", "auto": "auto", "required": "required"}


def _input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and the `input` items as the chat template's messages; consecutive function_call items
    are one assistant message with several calls, as chat has them."""
    if body.input == []:  # nothing to answer, instructions or not (OpenAI refuses it too)
        raise InvalidRequest("input is empty: give a string, or at least one item")
    messages = [template_message(0, "system", body.instructions)] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for index, item in enumerate(items):
        message = _input_message(index, item)
        previous = messages[-1] if messages else None
        if "tool_calls" in message and previous is not None and "tool_calls" in previous:
            previous["tool_calls"] = previous["tool_calls"] + message["tool_calls"]
        else:
            messages.append(message)
    return messages


def _input_message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = validated(FunctionCallItem, item, f"input.{index}")
        function = CalledFunction(name=call.name, arguments=call.arguments)  # JSON or not: as chat takes it
        called = ToolCallIn(id=call.call_id, function=function)
        return template_message(index, "assistant", None, [called])
    if kind == "function_call_output":
        result = validated(FunctionCallOutputItem, item, f"input.{index}")
        text = result.output if isinstance(result.output, str) else json.dumps(result.output)
        return template_message(index, "tool", text, tool_call_id=result.call_id)
    role = item.get("role")
    if kind != "message" or not isinstance(role, str) or role not in RESPONSES_ROLES:
        raise InvalidRequest(
            f"input[{index}]: expected a message (role user, system, developer or assistant), a "
            f"function_call or a function_call_output item; got type {kind!r}, role {role!r}"
        )
    return template_message(index, RESPONSES_ROLES[role], _input_text(index, item.get("content")))


def _input_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{index}].content must be a string or a list of text parts")
    return joined_text(content, TEXT_PARTS, f"input[{index}].content")


# OpenAI's limits on a response's metadata.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# What `include` may ask for: the output text's logprobs, and reasoning's encrypted content, of which this
# model, which does not reason, has none. The others name tools and inputs this server does not take.
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"metadata has {len(metadata)} keys: at most {MAX_METADATA_KEYS}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata key {key[:20]!r}... is longer than {MAX_METADATA_KEY} characters")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE} characters")


def _check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """OpenAI's `reasoning` configures a reasoning model; this one has no reasoning to configure, so only
    what asks for none is served."""
    reasoning = reasoning or {}
    if reasoning.get("effort") not in (None, "none") or reasoning.get("summary") is not None:
        raise InvalidRequest(
            'reasoning: this model does not reason; leave reasoning out (or give {"effort": "none"})'
        )


def _output_logprobs(body: ResponsesRequest, tools: ToolPlan) -> bool:
    """Whether the output text's logprobs are served: `include` asks for them (top_logprobs alone does
    not), and there are no tools, whose calls' tokens are no text's."""
    for name in body.include or ():
        if name not in INCLUDABLE:
            raise InvalidRequest(f"include: {name!r} is not served here; this server includes {INCLUDABLE}")
    wanted = OUTPUT_LOGPROBS in (body.include or ())
    if body.top_logprobs and not wanted:
        raise InvalidRequest(f'top_logprobs needs include: ["{OUTPUT_LOGPROBS}"]')
    if wanted and tools.mode != "none":
        raise InvalidRequest(f"include {OUTPUT_LOGPROBS!r} is served without tools; leave out tools or it")
    return wanted


def _function_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Responses' function tools (`{"type": "function", "name", "parameters", ...}`) as chat's."""
    out = []
    for index, tool in enumerate(tools or ()):
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"tools[{index}].type is {tool.get('type')!r}: only function tools are served"
            )
        definition = {key: value for key, value in tool.items() if key != "type"}
        out.append(
            Tool(type="function", function=validated(FunctionDefinition, definition, f"tools.{index}"))
        )
    return out


def _responses_tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in TOOL_MODES:
        return TOOL_MODES[choice]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=FunctionName(name=choice["name"]))
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        f"got {json.dumps(choice)[:80]}"
    )

"""A /v1/messages body → its plan: Anthropic's Messages request read as the chat it means (its system
prompt, blocks and tools as chat's, `output_config.format` as Responses' text.format), one choice; its errors
name the Messages fields (`messages.N.content.M`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from serve.api.anthropic.protocol import (
    AnthropicTool,
    AnthropicToolChoice,
    MessagesInput,
    MessagesRequest,
    OutputConfig,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from serve.api.common import CallRecord, LoadedModel
from serve.api.http.constraints import constraint_of, tool_or_format
from serve.api.http.translate import (
    ChatPlan,
    Prompt,
    chat_label,
    chat_prompt,
    generation_options,
    generation_requests,
    model_tool_plan,
    validated,
)
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
from serve.api.validation import MESSAGES_FIELDS
from serve.engine.types import Constraint
from serve.errors import InvalidRequest


@dataclass
class MessagesPlan(ChatPlan):
    """A Messages request served as the chat it means (one choice, no logprobs)."""

    max_tokens: int  # asked for: an output cut short before it filled the context
    context_length: int  # the model's


async def messages_prompt(
    body: MessagesInput, model: LoadedModel, record: CallRecord
) -> tuple[Prompt, ToolPlan]:
    """A Messages request's prompt, rendered as a chat's (`system` and the blocks as its messages, the tools
    as its function tools), and its tools' plan; /v1/messages/count_tokens counts this prompt."""
    parallel = None if body.tool_choice is None else not body.tool_choice.disable_parallel_tool_use
    tools = model_tool_plan(
        model, _anthropic_tools(body.tools), _anthropic_tool_choice(body.tool_choice), parallel
    )
    return await chat_prompt(_anthropic_messages(body), tools, model, record), tools


async def messages_plan(body: MessagesRequest, model: LoadedModel, record: CallRecord) -> MessagesPlan:
    """A Messages request as the chat it means (one choice, no logprobs): a forced tool call constrained as
    chat's, `output_config.format` as Responses' text.format, `stop_sequences` beside vLLM's `stop`.
    `record.prompt` as chat_plan sets it."""
    prompt, tools = await messages_prompt(body, model, record)
    constraint = tool_or_format(tools, output_format(body.output_config))
    options = generation_options(body, body.max_tokens, constraint, logprobs=False, top_logprobs=0)
    options = replace(options, stop=[*options.stop, *(body.stop_sequences or ())])
    stream = bool(body.stream)
    requests = generation_requests([prompt], options, 1, model, record.request_id, stream, MESSAGES_FIELDS)
    label = chat_label(constraint, tools)
    context = model.limits.context_length
    return MessagesPlan([prompt], requests, 1, stream, False, label, tools, False, body.max_tokens, context)


def output_format(config: OutputConfig | None) -> Constraint | None:
    """A Messages request's `output_config.format`: its JSON schema, as text.format's."""
    if config is None or config.format is None:
        return None
    return constraint_of("json", config.format.json_schema, "output_config.format.schema")


ANTHROPIC_TOOL_MODES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def _anthropic_messages(body: MessagesInput) -> list[dict[str, Any]]:
    """`system` and the messages as the chat template's: a user message's tool_result blocks are tool
    messages (before its text, as Anthropic orders them), an assistant's tool_use blocks its calls."""
    system = body.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    messages = [template_message(0, "system", system)] if system else []
    for index, message in enumerate(body.messages):
        content = message.content
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts, calls, results = _blocks(index, blocks)
        if message.role == "assistant":
            if results:
                raise InvalidRequest(f"messages.{index}.content: tool_result blocks belong in a user message")
            messages.append(template_message(index, "assistant", "\n".join(texts) or None, calls))
            continue
        if calls:
            raise InvalidRequest(f"messages.{index}.content: tool_use blocks belong in an assistant message")
        messages += [
            template_message(index, "tool", _result_text(r), tool_call_id=r.tool_use_id) for r in results
        ]
        if texts or not results:
            messages.append(template_message(index, "user", "\n".join(texts)))
    return messages


def _blocks(
    index: int, blocks: list[dict[str, Any]]
) -> tuple[list[str], list[ToolCallIn], list[ToolResultBlock]]:
    """A message's blocks by kind: its texts, its calls, its tool results."""
    texts: list[str] = []
    calls: list[ToolCallIn] = []
    results: list[ToolResultBlock] = []
    for j, block in enumerate(blocks):
        where, kind = f"messages.{index}.content.{j}", block.get("type")
        if kind == "text":
            texts.append(validated(TextBlock, block, where).text)
        elif kind == "tool_use":
            use = validated(ToolUseBlock, block, where)
            calls.append(ToolCallIn(id=use.id, function=CalledFunction(name=use.name, arguments=use.input)))
        elif kind == "tool_result":
            results.append(validated(ToolResultBlock, block, where))
        else:
            raise InvalidRequest(
                f"{where}.type is {json.dumps(kind)[:40]}: "
                "this model takes text, tool_use and tool_result blocks"
            )
    return texts, calls, results


def _result_text(result: ToolResultBlock) -> str:
    """A tool result as a tool message's text; templates have no field for a failed call, so its text says."""
    text = result.content if isinstance(result.content, str) else "\n".join(b.text for b in result.content)
    return f"Error: {text}" if result.is_error else text


def _anthropic_tools(tools: list[AnthropicTool] | None) -> list[Tool]:
    """Anthropic's tools (`name`, `description`, `input_schema`) as chat's function tools."""
    return [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.input_schema
            ),
        )
        for tool in tools or ()
    ]


def _anthropic_tool_choice(choice: AnthropicToolChoice | None) -> ToolChoice | None:
    if choice is None:
        return None
    if choice.type != "tool":
        return ANTHROPIC_TOOL_MODES[choice.type]
    if choice.name is None:
        raise InvalidRequest('tool_choice.name is required with type "tool"')
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))

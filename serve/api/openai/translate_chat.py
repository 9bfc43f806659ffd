"""A /v1/chat/completions body → its plan: the model it names, the fields this server refuses, n against
the server's max_n, the constraint (OpenAI's response_format, vLLM's structured-output fields, or a tool call
that tool_choice forces), the sampling parameters and limits, the messages rendered by the bundle's chat
template, then one `GenerationRequest` per choice. The Responses and Messages plans are chat plans too: each
is served as the chat it means."""

from __future__ import annotations

from typing import Any

from serve.api.common import CallRecord, LoadedModel
from serve.api.http.translate import (
    ChatPlan,
    chat_label,
    chat_prompt,
    generation_options,
    generation_requests,
    joined_text,
    model_tool_plan,
)
from serve.api.openai.protocol import CHAT_ROLES, ChatCompletionRequest, ChatMessage
from serve.api.openai.refusals import check_body, include_usage
from serve.api.openai.structured_output import chat_constraint
from serve.api.tool_calls import template_message
from serve.errors import InvalidRequest


async def chat_plan(
    body: ChatCompletionRequest, model: LoadedModel, max_n: int, record: CallRecord
) -> ChatPlan:
    """`record.prompt` is set as soon as the messages are known (a refused chat is logged too)."""
    check_body(body, max_n)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    tools = model_tool_plan(model, body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = chat_constraint(body, tools)
    options = generation_options(
        body, max_tokens, constraint, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0
    )
    messages, variables = chat_messages(body.messages, model.chat_reads_parts), body.chat_template_kwargs
    prompts = [await chat_prompt(messages, tools, model, record, body.documents, variables)]
    n = body.n or 1
    requests = generation_requests(prompts, options, n, model, record.request_id, bool(body.stream))
    label = chat_label(constraint, tools)
    stream, usage = bool(body.stream), include_usage(body)
    return ChatPlan(prompts, requests, n, stream, usage, label, tools, bool(body.logprobs))


def chat_messages(messages: list[ChatMessage], parts: bool = False) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them: content given as text parts joined into one
    string, or with `parts` (a template that reads them: LoadedModel.chat_reads_parts) the parts as given;
    InvalidRequest for a role or a message the API does not take."""
    if not messages:
        raise InvalidRequest("messages is empty: give at least one message")
    out = []
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{index}].role is {message.role!r}; allowed: {', '.join(CHAT_ROLES)}"
            )
        calls = message.tool_calls
        text = None if calls and message.content is None else message_text(index, message)
        fields = template_message(index, message.role, text, calls, message.tool_call_id, message.name)
        if parts and isinstance(message.content, list):  # text parts only: message_text checked them
            fields["content"] = message.content
        # Fields beyond OpenAI's reach the template as apply_chat_template hands them over (Phi-4-mini reads
        # a system message's tools).
        out.append({**(message.model_extra or {}), **fields})
    return out


def message_text(index: int, message: ChatMessage) -> str:
    """A message's content as one string (`joined_text`)."""
    content = message.content
    if content is None:
        raise InvalidRequest(f"messages[{index}].content is required")
    if isinstance(content, str):
        return content
    return joined_text(content, ("text",), f"messages[{index}].content")

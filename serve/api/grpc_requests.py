"""A `textgen.v1.GenerateRequest` → the neutral values of `serve.api.validation`, or InvalidRequest.

The wire message's own checks (unknown fields, which input is set, the JSON text fields of a chat) live here;
every value's range is checked by the core the HTTP API shares (`validation.build_request`), and a chat is
read as /v1/chat/completions reads one (`chat_input`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve.api.http.translate import validated
from serve.api.openai.protocol import ChatCompletionRequest
from serve.api.openai.translate_chat import chat_messages
from serve.api.tool_calls import tool_plan
from serve.api.validation import (
    GenerationOptions,
    RequestLimits,
    build_request,
    text_prompt,
    token_prompt,
)
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest

# A chat's messages, tools, documents and template variables → its prompt ids (LoadedModel.chat_prompt).
ChatEncoder = Callable[
    [list[dict[str, Any]], list[dict[str, Any]] | None, list[dict[str, Any]] | None, dict[str, Any] | None],
    list[int],
]
# The ChatMessage fields that `fields` may not repeat: each has its own.
_TYPED_MESSAGE_FIELDS = frozenset(pb.ChatMessage.DESCRIPTOR.fields_by_name) - {"fields"}


def reject_unknown_fields(message: Message) -> None:
    """Fields this server does not know would be silently ignored (a newer sampling option): refuse them."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        numbers = sorted({field.field_number for field in unknown})
        raise InvalidRequest(
            f"{message.DESCRIPTOR.name} has unknown field number(s) {numbers}: "
            f"this server speaks {message.DESCRIPTOR.file.package} without them"
        )
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if field.is_repeated:
            if field.message_type.GetOptions().map_entry:
                continue
            for item in value:
                reject_unknown_fields(item)
        else:
            reject_unknown_fields(value)


def prompt_ids(
    request: pb.GenerateRequest,
    encode: Callable[[str], Sequence[int]],
    vocab_size: int,
    chat: ChatEncoder | None = None,
) -> list[int]:
    """The prompt as token ids; `encode` is the bundle tokenizer's, `chat` renders and encodes messages."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input is required: set either text or token_ids, or messages")
    if which == "text":
        return text_prompt(request.text, encode)
    if which == "messages":
        messages, tools, documents, variables = chat_input(request.messages)
        if chat is None:
            raise InvalidRequest("this model's bundle has no chat template: send text or token_ids")
        return chat(messages, tools, documents, variables)
    return token_prompt(request.token_ids.ids, vocab_size)


def chat_input(
    chat: pb.ChatMessages,
) -> tuple[
    list[dict[str, Any]], list[dict[str, Any]] | None, list[dict[str, Any]] | None, dict[str, Any] | None
]:
    """The chat's messages, tools, documents and template variables as /v1/chat/completions hands them to
    the template: the chat is read as that route's body (its types, checks and messages' translation), so
    both render one prompt from one chat."""
    if not chat.messages:
        raise InvalidRequest("messages is empty: give at least one message")
    body = {
        "messages": [_message(index, message) for index, message in enumerate(chat.messages)],
        "documents": _json(chat.documents, "messages.documents"),
        "chat_template_kwargs": _json(chat.chat_template_kwargs, "messages.chat_template_kwargs"),
        "tools": _json(chat.tools, "messages.tools"),
    }
    read = validated(ChatCompletionRequest, body, "messages")
    tools = tool_plan(read.tools, None, None).template_tools
    return chat_messages(read.messages), tools, read.documents, read.chat_template_kwargs


def _message(index: int, message: pb.ChatMessage) -> dict[str, Any]:
    """A ChatMessage as the HTTP API's JSON message: its `fields`, then its typed fields where set."""
    where = f"messages.messages[{index}]"
    fields = _json(message.fields, f"{where}.fields")
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        kind = type(fields).__name__
        raise InvalidRequest(f"{where}.fields: a JSON object of the message's fields, not a {kind}")
    typed = sorted(_TYPED_MESSAGE_FIELDS & set(fields))
    if typed:
        raise InvalidRequest(f"{where}.fields.{typed[0]}: set ChatMessage.{typed[0]} instead")
    out: dict[str, Any] = {**fields, "role": message.role, "content": message.content}
    for name in ("name", "tool_call_id", "reasoning_content"):
        if message.HasField(name):
            out[name] = getattr(message, name)
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id or None,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    return out


def _json(text: str, where: str) -> Any:
    """A JSON text field's value (None when it is empty); InvalidRequest naming it when it is not JSON."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"{where} is not valid JSON: {exc}") from None


def sampling_params(sampling: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        repetition_penalty=sampling.repetition_penalty,
        seed=sampling.seed if sampling.HasField("seed") else None,
        min_p=sampling.min_p,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        logit_bias=tuple(sorted(sampling.logit_bias.items())),
    )


def options(request: pb.GenerateRequest) -> GenerationOptions:
    stopping = request.stopping
    return GenerationOptions(
        sampling=sampling_params(request.sampling),
        max_new_tokens=stopping.max_new_tokens,
        stop=list(stopping.stop),
        ignore_eos=stopping.ignore_eos,
        stop_token_ids=list(stopping.stop_token_ids),
        min_new_tokens=stopping.min_new_tokens,
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        include_logprobs=request.include_logprobs,
        top_logprobs=request.top_logprobs,
        prompt_logprobs=request.include_prompt_logprobs,
        prompt_top_logprobs=request.prompt_top_logprobs,
        truncate_prompt_tokens=request.truncate_prompt_tokens,
        constraint=constraint(request.constraint),
        speculative_tokens=(
            request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None
        ),
        priority=request.priority,
        adapter=request.adapter,
    )


def constraint(message: pb.Constraint) -> Constraint | None:
    """The request's constraint as a neutral value (None when unset); its values are checked by
    `validation.checked_constraint`."""
    which = message.WhichOneof("kind")
    if which is None:
        return None
    if which == "json_object":
        if not message.json_object:
            raise InvalidRequest("constraint.json_object must be true when set (leave it unset for none)")
        return Constraint.json_object()
    if which == "choice":
        return Constraint.choice(message.choice.choices)
    text: str = getattr(message, which)
    if which == "json_schema":
        return Constraint.json_schema(text)
    return Constraint.regex(text) if which == "regex" else Constraint.grammar(text)


def generation_request(
    request: pb.GenerateRequest,
    *,
    request_id: str,
    prompt: list[int],
    limits: RequestLimits,
    deadline: float | None,
    stream: bool = True,
) -> GenerationRequest:
    """The scheduler's request for an already tokenized prompt (`validation.build_request`)."""
    return build_request(
        options(request),
        request_id=request_id,
        prompt=prompt,
        limits=limits,
        deadline=deadline,
        stream=stream,
    )

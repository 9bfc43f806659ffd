"""A `textgen.v1.GenerateRequest` → the neutral values of `serve.api.validation`, or InvalidRequest.

The wire message's own checks (unknown fields, which input is set) live here; every value's range is checked
by the core the HTTP API shares (`validation.build_request`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve.api.chat import check_messages
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

# A chat's (role, content) messages → its prompt ids (the bundle's chat template; None: the bundle has none).
ChatEncoder = Callable[[list[dict[str, str]]], list[int]]


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
        messages = list(check_messages([(m.role, m.content) for m in request.messages.messages]))
        if chat is None:
            raise InvalidRequest("this model's bundle has no chat template: send text or token_ids")
        return chat(messages)
    return token_prompt(request.token_ids.ids, vocab_size)


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

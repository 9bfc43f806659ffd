"""Turns a `textgen.v1.GenerateRequest` into a `GenerationRequest`, or raises InvalidRequest.

Every message names the field, the value received and the allowed range, so a client can fix its request
without reading the server's source. Nothing here blocks on the engine: it runs before the request is queued.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_TOKEN_IDS = 64  # a ban list, checked per step while min_new_tokens holds: keep it short
# A constraint's text (schema, pattern, grammar; a choice list's strings together): the compile's input is
# bounded here, its cost by the compiler's LLParserLimits (serve/engine/constraints.py).
MAX_CONSTRAINT_CHARS = 65_536
MAX_CHOICES = 256


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask for: the model's shape and the server's caps."""

    vocab_size: int
    context_length: int
    max_prompt_tokens: int  # at most context_length - 1: a prompt leaves room for one new token
    default_max_new_tokens: int
    max_new_tokens: int
    max_stop_strings: int
    max_stop_length: int


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
        if field.message_type is not None and not field.is_repeated:
            reject_unknown_fields(value)


def check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    return request_id


def token_ids(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    for position, token in enumerate(ids):
        if token >= vocab_size:
            raise InvalidRequest(
                f"{field}[{position}] = {token} is outside the vocabulary: allowed 0..{vocab_size - 1}"
            )
    return list(ids)


def prompt_ids(
    request: pb.GenerateRequest, encode: Callable[[str], Sequence[int]], vocab_size: int
) -> list[int]:
    """The prompt as token ids; `encode` is the bundle tokenizer's."""
    which = request.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input is required: set either text or token_ids")
    if which == "text":
        if not request.text:
            raise InvalidRequest("text is empty: give at least one character")
        ids = list(encode(request.text))
        if not ids:
            raise InvalidRequest("text encodes to no tokens: give at least one token of text")
        return ids
    if not request.token_ids.ids:
        raise InvalidRequest("token_ids is empty: give at least one token id")
    return token_ids(request.token_ids.ids, vocab_size, "token_ids")


def sampling_params(sampling: pb.SamplingParams) -> SamplingParams:
    params = SamplingParams(
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
    params.validate()
    return params


def stop_strings(stop: Sequence[str], limits: RequestLimits) -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(f"{len(stop)} stop strings given; at most {limits.max_stop_strings} are allowed")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest(
                f"stop[{index}] is empty: stop strings need 1..{limits.max_stop_length} characters"
            )
        if len(text) > limits.max_stop_length:
            raise InvalidRequest(
                f"stop[{index}] has {len(text)} characters; allowed 1..{limits.max_stop_length}"
            )
    return tuple(stop)


def stop_token_ids(ids: Sequence[int]) -> tuple[int, ...]:
    """Capped where the wire message is read; their range is checked by `validate_request`."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"{len(ids)} stop token ids given; at most {MAX_STOP_TOKEN_IDS} are allowed")
    return tuple(ids)


def constraint(message: pb.Constraint) -> Constraint | None:
    """The request's constraint (None when unset), checked for shape and size; whether llguidance accepts it
    is decided when it compiles (InvalidRequest with the library's message)."""
    which = message.WhichOneof("kind")
    if which is None:
        return None
    if which == "json_object":
        if not message.json_object:
            raise InvalidRequest("constraint.json_object must be true when set (leave it unset for none)")
        return Constraint.json_object()
    if which == "choice":
        choices = list(message.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(f"constraint.choice has {len(choices)} strings; allowed 1..{MAX_CHOICES}")
        for index, choice in enumerate(choices):
            if not choice:
                raise InvalidRequest(f"constraint.choice.choices[{index}] is empty: give a character or more")
        _check_size("constraint.choice", sum(len(choice) for choice in choices))
        return Constraint.choice(choices)
    text: str = getattr(message, which)
    if not text:
        raise InvalidRequest(f"constraint.{which} is empty")
    _check_size(f"constraint.{which}", len(text))
    if which == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(f"constraint.json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("constraint.json_schema must be a JSON object (or true / false)")
        return Constraint.json_schema(text)
    return Constraint.regex(text) if which == "regex" else Constraint.grammar(text)


def _check_size(field: str, chars: int) -> None:
    if chars > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{field} has {chars} characters; at most {MAX_CONSTRAINT_CHARS} are allowed")


def truncated(prompt: list[int], keep: int, limits: RequestLimits) -> list[int]:
    """The prompt's last `keep` tokens (0: all of it): TGI's `truncate`, vLLM's `truncate_prompt_tokens`."""
    if keep > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"truncate_prompt_tokens = {keep}; allowed 0..{limits.max_prompt_tokens} (0 = off)"
        )
    return prompt[-keep:] if keep else prompt


def check_prompt_length(prompt_tokens: int, limits: RequestLimits) -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {prompt_tokens} tokens; allowed 1..{limits.max_prompt_tokens} "
            f"(the context holds {limits.context_length} tokens, at least one of them generated)"
        )


def max_new_tokens(requested: int, prompt_tokens: int, limits: RequestLimits) -> int:
    """0 asks for the server's default, shortened to what the context leaves; an explicit value must fit."""
    check_prompt_length(prompt_tokens, limits)
    room = limits.context_length - prompt_tokens
    if requested == 0:
        return min(limits.default_max_new_tokens, room)
    if requested > limits.max_new_tokens:
        raise InvalidRequest(
            f"max_new_tokens = {requested} is above the server's cap: allowed 1..{limits.max_new_tokens} "
            f"(0 = default {limits.default_max_new_tokens})"
        )
    if requested > room:
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({requested}) = {prompt_tokens + requested} "
            f"exceeds the context length {limits.context_length}: "
            f"allowed max_new_tokens 1..{room} for this prompt"
        )
    return requested


def generation_request(
    request: pb.GenerateRequest,
    *,
    request_id: str,
    prompt: list[int],
    limits: RequestLimits,
    deadline: float | None,
    stream: bool = True,
) -> GenerationRequest:
    """The scheduler's request for an already tokenized prompt; raises InvalidRequest on a bad value of the
    wire message. What relates fields to each other or to the model (min_new_tokens <= max_new_tokens,
    top_logprobs, token id ranges) is checked once for every caller by
    `serve.scheduling.request.validate_request`, which `Scheduler.submit` runs."""
    stopping = request.stopping
    prompt = truncated(prompt, request.truncate_prompt_tokens, limits)
    most = max_new_tokens(stopping.max_new_tokens, len(prompt), limits)
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt,
        sampling=sampling_params(request.sampling),
        max_new_tokens=most,
        stop=stop_strings(stopping.stop, limits),
        ignore_eos=stopping.ignore_eos,
        include_logprobs=request.include_logprobs,
        deadline=deadline,
        stream=stream,
        stop_token_ids=stop_token_ids(stopping.stop_token_ids),
        min_new_tokens=stopping.min_new_tokens,
        top_logprobs=request.top_logprobs,
        include_stop_str_in_output=stopping.include_stop_str_in_output,
        prompt_logprobs=request.include_prompt_logprobs,
        prompt_top_logprobs=request.prompt_top_logprobs,
        constraint=constraint(request.constraint),
    )

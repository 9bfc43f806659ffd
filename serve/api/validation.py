"""Plain values → a `GenerationRequest`, or InvalidRequest: the protocol-neutral core both front ends use.

gRPC (`serve.api.grpc_requests`) and the OpenAI-compatible HTTP API (`serve.api.openai`) read their wire
formats into `GenerationOptions` and a prompt of token ids; `build_request` checks them against the server's
`RequestLimits` and makes the scheduler's request. Every message names the field, the value received and the
allowed range, so a client can fix its request without reading the server's source (`Fields` holds the names
each protocol gives them). Nothing here blocks on the engine: it runs before the request is queued.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serve.engine.sampling import MAX_SEED, SamplingParams
from serve.engine.types import Constraint, ConstraintKind
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest

MAX_REQUEST_ID_CHARS = 128
MAX_STOP_TOKEN_IDS = 64  # a ban list, checked per step while min_new_tokens holds: keep it short
# A constraint's text (schema, pattern, grammar; a choice list's strings together): the compile's input is
# bounded here, its cost by the compiler's LLParserLimits (serve/engine/constraints.py).
MAX_CONSTRAINT_CHARS = 65_536
MAX_CHOICES = 256
# A request's priority: gRPC's int32, so every wire takes the same range.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
PRIORITY_HEADER = "X-Request-Priority"  # for HTTP clients that cannot add a field to the body
_INTEGER = re.compile(r"[+-]?[0-9]{1,10}")


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask for: the model's shape and the server's caps."""

    vocab_size: int
    context_length: int
    max_prompt_tokens: int  # at most context_length - 1: a prompt leaves room for one new token
    default_max_new_tokens: int | None  # a request that gives none; None: what its context leaves
    max_new_tokens: int | None  # the operator's cap: a larger request is lowered to it; None: the context's
    max_stop_strings: int
    max_stop_length: int
    prompt_logprobs: bool = True  # the server scores prompts (--prompt-logprobs)

    @property
    def largest_new_tokens(self) -> int:
        """The most tokens one request can generate: the cap, or what the shortest prompt leaves."""
        room = self.context_length - 1
        return min(self.max_new_tokens or room, room)


@dataclass(frozen=True)
class Fields:
    """What a protocol calls the fields whose messages name them, and how its requests ask for the server's
    default output length (`unset`; "": they cannot)."""

    max_new_tokens: str = "max_new_tokens"
    unset: str = "0: the server's default"
    # A max_new_tokens beyond what the context leaves: refused (vLLM's way), or run until the context is
    # full (Anthropic's Messages API, whose clients must send one and send large ones).
    fills_context: bool = False
    truncate_prompt_tokens: str = "truncate_prompt_tokens"
    stop: str = "stop"
    stop_token_ids: str = "stop_token_ids"
    min_new_tokens: str = "min_new_tokens"


GRPC_FIELDS = Fields()
LEAVE_OUT = "or leave it out for the server's default"
OPENAI_FIELDS = Fields(max_new_tokens="max_tokens", min_new_tokens="min_tokens", unset=LEAVE_OUT)
RESPONSES_FIELDS = Fields(max_new_tokens="max_output_tokens", min_new_tokens="min_tokens", unset=LEAVE_OUT)
MESSAGES_FIELDS = Fields(
    max_new_tokens="max_tokens", min_new_tokens="min_tokens", unset="", fills_context=True
)


@dataclass(frozen=True)
class GenerationOptions:
    """Everything of a request but its prompt, as plain values read from either wire format.

    `max_new_tokens` 0 asks for the server's default; with `score_only` the request generates nothing and
    returns only its prompt's logprobs (`prompt_logprobs` must be set)."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 0
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    include_stop_str_in_output: bool = False
    include_logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    truncate_prompt_tokens: int = 0  # keep the prompt's last N tokens (0: all of it)
    score_only: bool = False
    constraint: Constraint | None = None  # structured output (checked by `checked_constraint`)
    speculative_tokens: int | None = None  # most tokens speculation proposes per step; None: the server's
    priority: int = 0  # under the priority policy: lower is admitted first
    adapter: str = ""  # a LoRA adapter the server loaded; "": the base model


def check_request_id(request_id: str) -> str:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(
            f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
        )
    return request_id


def header_priority(value: str) -> int:
    """The priority an `X-Request-Priority` header gives: a decimal integer in the int32 range."""
    text = value.strip()
    number = int(text) if _INTEGER.fullmatch(text) else None
    if number is None or not PRIORITY_MIN <= number <= PRIORITY_MAX:
        raise InvalidRequest(
            f"{PRIORITY_HEADER} is {value!r}; give an integer in {PRIORITY_MIN}..{PRIORITY_MAX} (lower is "
            "served first)"
        )
    return number


def token_ids(ids: Sequence[int], vocab_size: int, field: str) -> list[int]:
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"{field}[{position}] = {token} is outside the vocabulary: allowed 0..{vocab_size - 1}"
            )
    return list(ids)


def text_prompt(text: str, encode: Callable[[str], Sequence[int]], field: str = "text") -> list[int]:
    """A text prompt's token ids; `encode` is the bundle tokenizer's."""
    if not text:
        raise InvalidRequest(f"{field} is empty: give at least one character")
    ids = list(encode(text))
    if not ids:
        raise InvalidRequest(f"{field} encodes to no tokens: give at least one token of text")
    return ids


def token_prompt(ids: Sequence[int], vocab_size: int, field: str = "token_ids") -> list[int]:
    if not ids:
        raise InvalidRequest(f"{field} is empty: give at least one token id")
    return token_ids(ids, vocab_size, field)


def stop_strings(stop: Sequence[str], limits: RequestLimits, field: str = "stop") -> tuple[str, ...]:
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(f"{len(stop)} stop strings given; at most {limits.max_stop_strings} are allowed")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest(
                f"{field}[{index}] is empty: stop strings need 1..{limits.max_stop_length} characters"
            )
        if len(text) > limits.max_stop_length:
            raise InvalidRequest(
                f"{field}[{index}] has {len(text)} characters; allowed 1..{limits.max_stop_length}"
            )
    return tuple(stop)


def stop_token_ids(ids: Sequence[int]) -> tuple[int, ...]:
    """Capped where the request is read; their range is checked by `validate_request`."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"{len(ids)} stop token ids given; at most {MAX_STOP_TOKEN_IDS} are allowed")
    return tuple(ids)


def checked_constraint(constraint: Constraint | None) -> Constraint | None:
    """A request's constraint checked for shape and size; whether llguidance accepts it is decided when it
    compiles (InvalidRequest with the library's message)."""
    if constraint is None or constraint.kind is ConstraintKind.JSON_OBJECT:
        return constraint
    which = constraint.field_name
    if constraint.kind is ConstraintKind.CHOICE:
        choices = constraint.choices
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise InvalidRequest(f"{which} has {len(choices)} strings; allowed 1..{MAX_CHOICES}")
        for index, choice in enumerate(choices):
            if not choice:
                raise InvalidRequest(f"{which}.choices[{index}] is empty: give a character or more")
        _check_size(which, sum(len(choice) for choice in choices))
        return constraint
    if not constraint.text:
        raise InvalidRequest(f"{which} is empty")
    _check_size(which, len(constraint.text))
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.text)
        except ValueError as exc:
            raise InvalidRequest(f"{which} is not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(f"{which} must be a JSON object (or true / false)")
    return constraint


def _check_size(field: str, chars: int) -> None:
    if chars > MAX_CONSTRAINT_CHARS:
        raise InvalidRequest(f"{field} has {chars} characters; at most {MAX_CONSTRAINT_CHARS} are allowed")


def truncated(
    prompt: list[int], keep: int, limits: RequestLimits, field: str = "truncate_prompt_tokens"
) -> list[int]:
    """The prompt's last `keep` tokens (0: all of it): TGI's `truncate`, vLLM's `truncate_prompt_tokens`."""
    if not 0 <= keep <= limits.max_prompt_tokens:
        raise InvalidRequest(f"{field} = {keep}; allowed 0..{limits.max_prompt_tokens} (0 = off)")
    return prompt[-keep:] if keep else prompt


def check_prompt_length(prompt_tokens: int, limits: RequestLimits) -> None:
    if prompt_tokens > limits.max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {prompt_tokens} tokens; allowed 1..{limits.max_prompt_tokens} "
            f"(the context holds {limits.context_length} tokens, at least one of them generated)"
        )


def max_new_tokens(
    requested: int, prompt_tokens: int, limits: RequestLimits, fields: Fields = GRPC_FIELDS
) -> int:
    """How many tokens a request may generate, as vLLM decides it: what it asks for (0: the server's
    default, by default what the context leaves), lowered to the operator's cap if there is one. Only a
    request whose prompt + max_new_tokens cannot fit the context is refused (where `fields.fills_context`,
    not even that: it runs until the context is full)."""
    check_prompt_length(prompt_tokens, limits)
    room = limits.context_length - prompt_tokens
    if requested > room and not fields.fills_context:
        field = fields.max_new_tokens
        hint = f" ({fields.unset})" if fields.unset else ""
        raise InvalidRequest(
            f"prompt ({prompt_tokens} tokens) + {field} ({requested}) = {prompt_tokens + requested} "
            f"exceeds the context length {limits.context_length}: "
            f"allowed {field} 1..{room} for this prompt{hint}"
        )
    wanted = requested or limits.default_max_new_tokens or room
    return min(wanted, room, limits.max_new_tokens or room)


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with `seed` (n > 1): choice 0 keeps it, so n = 1 and the first
    of n choices agree; the others get a seed derived from (seed, index), so the same seed gives the same n
    choices whatever else is batched. None stays None (each choice draws from OS entropy)."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"textgen-choice:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


def build_request(
    options: GenerationOptions,
    *,
    request_id: str,
    prompt: list[int],
    limits: RequestLimits,
    deadline: float | None,
    stream: bool = True,
    fields: Fields = GRPC_FIELDS,
) -> GenerationRequest:
    """The scheduler's request for an already tokenized prompt; raises InvalidRequest on a bad value. What
    relates fields to each other or to the model (min_new_tokens <= max_new_tokens, top_logprobs, token id
    ranges) is checked once for every caller by `serve.scheduling.request_checks.validate_request`, which
    `Scheduler.submit` runs."""
    prompt = truncated(prompt, options.truncate_prompt_tokens, limits, fields.truncate_prompt_tokens)
    if options.prompt_logprobs and not limits.prompt_logprobs:
        raise InvalidRequest("this server does not score prompts (served with --no-prompt-logprobs)")
    if options.score_only:
        if not options.prompt_logprobs:
            raise InvalidRequest(f"{fields.max_new_tokens} = 0 scores the prompt only: ask for its logprobs")
        check_prompt_length(len(prompt), limits)
        most = 0
    else:
        most = max_new_tokens(options.max_new_tokens, len(prompt), limits, fields)
    if not 0 <= options.min_new_tokens <= most:
        minimum, maximum = fields.min_new_tokens, fields.max_new_tokens
        raise InvalidRequest(f"{minimum} is {options.min_new_tokens}; allowed 0..{most} ({maximum})")
    options.sampling.validate()
    return GenerationRequest(
        request_id=request_id,
        prompt_ids=prompt,
        sampling=options.sampling,
        max_new_tokens=most,
        stop=stop_strings(options.stop, limits, fields.stop),
        ignore_eos=options.ignore_eos,
        include_logprobs=options.include_logprobs,
        deadline=deadline,
        stream=stream,
        stop_token_ids=stop_token_ids(options.stop_token_ids),
        min_new_tokens=options.min_new_tokens,
        top_logprobs=options.top_logprobs,
        include_stop_str_in_output=options.include_stop_str_in_output,
        prompt_logprobs=options.prompt_logprobs,
        prompt_top_logprobs=options.prompt_top_logprobs,
        constraint=checked_constraint(options.constraint),
        speculative_tokens=options.speculative_tokens,
        priority=options.priority,
        adapter=options.adapter,
    )

"""What /v1/completions and /v1/chat/completions check of a body before its translation: the fields this
server refuses (`UNSUPPORTED`) and n against the server's max_n; and whether a stream ends with the usage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve.api.openai.protocol import SamplingRequest
from serve.errors import InvalidRequest


def check_body(body: SamplingRequest, max_n: int) -> None:
    _refuse_unsupported(body)
    n = body.n or 1
    if n > max_n:
        raise InvalidRequest(f"n = {n}; allowed 1..{max_n} (the server's max_n)")


def include_usage(body: SamplingRequest) -> bool:
    return bool(body.stream and body.stream_options is not None and body.stream_options.include_usage)


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# Fields that would change the output and that this server does not do: refused unless at their default.
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or v == 1,
    "suffix": _unset,
    "tools": _unset,  # on /v1/completions (chat declares them)
    "functions": _unset,
    "function_call": lambda v: v in (None, "none"),
    "tool_choice": lambda v: v in (None, "none"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _unset,
    "prediction": _unset,
    "use_beam_search": _unset,
    "prompt_logprobs": _unset,
    "length_penalty": lambda v: v is None or v == 1,
}


def _refuse_unsupported(body: SamplingRequest) -> None:
    fields = {
        **(body.model_extra or {}),
        **{k: getattr(body, k) for k in ("best_of", "suffix") if hasattr(body, k)},
    }
    for name, is_default in UNSUPPORTED.items():
        if name in fields and not is_default(fields[name]):
            raise InvalidRequest(f"{name} is not supported by this server; leave it out")

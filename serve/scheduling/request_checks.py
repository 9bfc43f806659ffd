"""A request checked against what an engine can serve (`validate_request`): its prompt and token ids in the
vocabulary, its lengths within the KV budget, the counts of alternatives it asks for, its adapter. Every
caller checks here, once: the scheduler, the engine process's client, and the offline API.
"""

from __future__ import annotations

from collections.abc import Collection

from serve.engine.sampling import MAX_TOP_LOGPROBS
from serve.engine.types import ConstraintKind
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest


def validate_request(
    request: GenerationRequest,
    vocab_size: int,
    max_total_tokens: int,
    *,
    stop_at_context: bool = False,
    adapters: Collection[str] | None = None,
) -> None:
    """Raise InvalidRequest unless the request fits `max_total_tokens` (prompt + max_new_tokens).

    With `stop_at_context` only the prompt must leave room for one token; generation then ends with
    finish reason `context` when the limit is reached (the offline API's behaviour).
    """
    rid = request.request_id
    if not request.prompt_ids:
        raise InvalidRequest(f"request {rid}: the prompt is empty; give at least one token")
    if request.max_new_tokens < 1 and not (request.max_new_tokens == 0 and request.prompt_logprobs):
        raise InvalidRequest(
            f"request {rid}: max_new_tokens is {request.max_new_tokens}; it must be >= 1 "
            "(0 only to score the prompt: with prompt_logprobs)"
        )
    if not 0 <= request.min_new_tokens <= request.max_new_tokens:
        raise InvalidRequest(
            f"request {rid}: min_new_tokens is {request.min_new_tokens}; "
            f"allowed 0..{request.max_new_tokens} (max_new_tokens)"
        )
    _check_top(rid, "top_logprobs", request.top_logprobs, request.include_logprobs, "include_logprobs")
    _check_adapter(request, adapters)
    constraint = request.constraint
    if constraint is not None and constraint.kind is ConstraintKind.CHOICE and not constraint.choices:
        raise InvalidRequest(f"request {rid}: constraint.choice needs at least one string")
    prompt_top = request.prompt_top_logprobs
    _check_top(rid, "prompt_top_logprobs", prompt_top, request.prompt_logprobs, "include_prompt_logprobs")
    stops = request.stop_token_ids
    if stops and not 0 <= min(stops) <= max(stops) < vocab_size:
        raise InvalidRequest(f"request {rid}: stop_token_ids must be in [0, {vocab_size - 1}]")
    biased = [token for token, _ in request.sampling.logit_bias]
    if biased and not 0 <= min(biased) <= max(biased) < vocab_size:
        raise InvalidRequest(f"request {rid}: logit_bias token ids must be in [0, {vocab_size - 1}]")
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise InvalidRequest(f"request {rid}: prompt token ids must be in [0, {vocab_size - 1}]")
    prompt = len(request.prompt_ids)
    if stop_at_context and prompt >= max_total_tokens:
        raise InvalidRequest(
            f"request {rid}: prompt of {prompt} tokens; at most {max_total_tokens - 1} leave room to generate"
        )
    total = prompt + request.max_new_tokens
    if not stop_at_context and total > max_total_tokens:
        raise InvalidRequest(
            f"request {rid}: prompt ({prompt} tokens) + max_new_tokens ({request.max_new_tokens}) = {total} "
            f"exceeds the limit of {max_total_tokens} tokens"
        )


def _check_adapter(request: GenerationRequest, adapters: Collection[str] | None) -> None:
    """InvalidRequest for an adapter the server has not loaded (`adapters`; None: not known here, the engine
    checks) and for prompt logprobs with one (the base model's graph scores prompts)."""
    if not request.adapter:
        return
    rid = request.request_id
    if adapters is not None and request.adapter not in adapters:
        loaded = ", ".join(adapters) or "none"
        raise InvalidRequest(f"request {rid}: no LoRA adapter named {request.adapter!r} is loaded ({loaded})")
    if request.prompt_logprobs:
        raise InvalidRequest(
            f"request {rid}: prompt logprobs are scored by the base model's graph, without adapters "
            f"({request.adapter!r})"
        )


def _check_top(rid: str, field: str, value: int, asked: bool, needs: str) -> None:
    """A count of most likely tokens: in range, and only beside the logprobs it adds to (as OpenAI's API)."""
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"request {rid}: {field} is {value}; allowed 0..{MAX_TOP_LOGPROBS}")
    if value and not asked:
        raise InvalidRequest(f"request {rid}: {field} needs {needs} (as OpenAI's API does)")

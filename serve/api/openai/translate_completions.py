"""A /v1/completions body → its plan: the prompts (text or token ids, tokenized off the event loop), echo
and logprobs, a request per (prompt, choice)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from serve.api.common import CallRecord, LoadedModel
from serve.api.http.translate import (
    Plan,
    Prompt,
    generation_options,
    generation_requests,
)
from serve.api.openai.protocol import MAX_PROMPTS, CompletionRequest
from serve.api.openai.refusals import check_body, include_usage
from serve.api.openai.structured_output import structured_output
from serve.api.validation import text_prompt, token_prompt
from serve.errors import InvalidRequest


@dataclass
class CompletionPlan(Plan):
    echo: bool
    logprobs: int | None  # the alternatives per token; None: no logprobs


async def completion_plan(
    body: CompletionRequest, model: LoadedModel, max_n: int, record: CallRecord
) -> CompletionPlan:
    """`record.prompt` is set as soon as the prompt is known (a refused one is logged too)."""
    check_body(body, max_n)
    k = body.logprobs
    constraint = structured_output(body)
    options = generation_options(
        body, body.max_tokens, constraint, logprobs=k is not None, top_logprobs=k or 0, echo=bool(body.echo)
    )
    prompts = await _prompts(body.prompt, model)
    record.prompt = prompts[0].text
    n = body.n or 1
    requests = generation_requests(prompts, options, n, model, record.request_id, bool(body.stream))
    label = None if constraint is None else constraint.kind.value
    return CompletionPlan(
        prompts, requests, n, bool(body.stream), include_usage(body), label, bool(body.echo), k
    )


async def _prompts(prompt: str | list[str] | list[int] | list[list[int]], model: LoadedModel) -> list[Prompt]:
    vocab_size = model.limits.vocab_size
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequest("prompt is empty: give a string, a list of strings or of token ids")
    if len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
        raise InvalidRequest(f"{len(prompt)} prompts given; at most {MAX_PROMPTS} in one request")
    decode = model.tokenizer.decode
    if isinstance(prompt[0], int):
        ids = token_prompt([int(t) for t in prompt], vocab_size, "prompt")
        return [Prompt(ids, decode(ids, skip_special_tokens=False))]
    if isinstance(prompt[0], list):
        out = []
        for i, item in enumerate(prompt):
            ids = token_prompt(item, vocab_size, f"prompt[{i}]")
            out.append(Prompt(ids, decode(ids, skip_special_tokens=False)))
        return out
    texts: list[str] = prompt
    encode = model.tokenizer.encode

    def tokenized() -> list[Prompt]:
        field = "prompt" if len(texts) == 1 else "prompt[{}]"
        return [
            Prompt(text_prompt(t, lambda s: encode(s).ids, field.format(i)), t) for i, t in enumerate(texts)
        ]

    return await asyncio.to_thread(tokenized)  # a long prompt takes milliseconds: off the event loop

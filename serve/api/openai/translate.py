"""A generation request's body → the scheduler's requests, in one pass: the whole of what the HTTP API
decides about a completion or a chat before anything is submitted.

`completion_plan` and `chat_plan` each read a body top to bottom: the model it names, the fields this server
refuses (`UNSUPPORTED`), n against the server's max_n, the constraint (OpenAI's response_format, vLLM's
structured-output fields, or a tool call that tool_choice forces), the sampling parameters and limits, the
prompt (text or token ids, tokenized off the event loop; a chat rendered by the bundle's template), and
then one `GenerationRequest` per (prompt, choice).

n > 1 is served as n requests with seeds derived from (seed, index) (`validation.choice_seed`): the same seed
gives the same n choices whatever else is batched. Choices 1..n-1 are forks of choice 0
(`GenerationRequest.fork_of`): admitted in its prefill group (the usual case), the prompt is prefilled once
and the engine copies its row (KV and first-step logits) into theirs; one left out of the group for lack of
rows is prefilled later on its own (from the prefix cache, when it keeps the prompt).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from serve.api.common import CallRecord, LoadedModel
from serve.api.openai.protocol import (
    CHAT_ROLES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingRequest,
)
from serve.api.openai.structured_output import chat_constraint, structured_output
from serve.api.state import ServingState
from serve.api.tool_calls import ToolPlan, template_message, tool_plan
from serve.api.tool_formats import tool_format
from serve.api.validation import (
    OPENAI_FIELDS,
    GenerationOptions,
    build_request,
    choice_seed,
    text_prompt,
    token_prompt,
)
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest


class NotFound(Exception):
    """An unknown model (404)."""


def named_model(state: ServingState, name: str | None) -> LoadedModel:
    """The served model, if `name` (a request's `model`) names it or is None."""
    model = state.ready_model()
    if name is not None and name != model.name:
        raise NotFound(f"the model {name!r} does not exist: this server serves {model.name!r}")
    return model


@dataclass
class Prompt:
    ids: list[int]
    text: str  # what echo returns


@dataclass
class Plan:
    """What one HTTP request submits: a request per (prompt, choice), index = prompt x n + choice."""

    prompts: list[Prompt]
    requests: list[GenerationRequest]
    n: int
    stream: bool
    include_usage: bool  # a stream's last chunk carries the usage (the others "usage": null)
    constraint_label: str | None  # the constrained-request metric's kind ("tool": a forced call)


@dataclass
class CompletionPlan(Plan):
    echo: bool
    logprobs: int | None  # the alternatives per token; None: no logprobs


@dataclass
class ChatPlan(Plan):
    tools: ToolPlan
    logprobs: bool


async def completion_plan(
    body: CompletionRequest, model: LoadedModel, max_n: int, record: CallRecord
) -> CompletionPlan:
    """`record.prompt` is set as soon as the prompt is known (a refused one is logged too)."""
    _check_body(body, max_n)
    k = body.logprobs
    constraint = structured_output(body)
    options = _options(
        body, body.max_tokens, constraint, logprobs=k is not None, top_logprobs=k or 0, echo=bool(body.echo)
    )
    prompts = await _prompts(body.prompt, model)
    record.prompt = prompts[0].text
    n = body.n or 1
    requests = _requests(prompts, options, n, model, record.request_id, bool(body.stream))
    label = None if constraint is None else constraint.kind.value
    return CompletionPlan(
        prompts, requests, n, bool(body.stream), _include_usage(body), label, bool(body.echo), k
    )


async def chat_plan(
    body: ChatCompletionRequest, model: LoadedModel, max_n: int, record: CallRecord
) -> ChatPlan:
    """`record.prompt` is set as soon as the messages are known (a refused chat is logged too)."""
    _check_body(body, max_n)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    form = tool_format(model.chat.source if model.chat is not None else None)
    tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, form)
    constraint = chat_constraint(body, tools)
    options = _options(
        body, max_tokens, constraint, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0
    )
    messages = chat_messages(body.messages)
    ids = await asyncio.to_thread(model.chat_prompt, messages, tools.template_tools)
    record.prompt = json.dumps(messages, ensure_ascii=False)
    prompts, n = [Prompt(ids, "")], body.n or 1
    requests = _requests(prompts, options, n, model, record.request_id, bool(body.stream))
    label = None if constraint is None else ("tool" if tools.constrained else constraint.kind.value)
    stream, usage = bool(body.stream), _include_usage(body)
    return ChatPlan(prompts, requests, n, stream, usage, label, tools, bool(body.logprobs))


def _check_body(body: SamplingRequest, max_n: int) -> None:
    _refuse_unsupported(body)
    n = body.n or 1
    if n > max_n:
        raise InvalidRequest(f"n = {n}; allowed 1..{max_n} (the server's max_n)")


def _include_usage(body: SamplingRequest) -> bool:
    return bool(body.stream and body.stream_options is not None and body.stream_options.include_usage)


# --- the fields of both routes ------------------------------------------------------------------------------


def _sampling(body: SamplingRequest) -> SamplingParams:
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias keys are token ids (integers, as strings); got {key!r}"
            ) from None
        bias.append((token, value))
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 0.0 if body.top_p is None or body.top_p == 1.0 else body.top_p
    if body.top_p == 0.0:  # OpenAI's top_p 0 keeps only the most likely token: greedy
        temperature, top_p = 0.0, 0.0
    return SamplingParams(
        temperature=temperature,
        top_k=max(body.top_k or 0, 0),
        top_p=top_p,
        repetition_penalty=body.repetition_penalty or 0.0,
        seed=None if body.seed is None else body.seed % 2**64,
        min_p=body.min_p or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        logit_bias=tuple(sorted(bias)),
    )


def _options(
    body: SamplingRequest,
    max_tokens: int | None,
    constraint: Constraint | None,
    *,
    logprobs: bool,
    top_logprobs: int,
    echo: bool = False,
) -> GenerationOptions:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    score_only = echo and max_tokens == 0
    if max_tokens == 0 and not score_only:
        raise InvalidRequest(
            "max_tokens = 0 generates nothing: give 1 or more (or leave it out for the server's "
            "default); with echo, /v1/completions returns the prompt and scores it"
        )
    return GenerationOptions(
        sampling=_sampling(body),
        max_new_tokens=max_tokens or 0,
        stop=stop,
        ignore_eos=bool(body.ignore_eos),
        stop_token_ids=list(body.stop_token_ids or ()),
        min_new_tokens=body.min_tokens or 0,
        include_stop_str_in_output=bool(body.include_stop_str_in_output),
        include_logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=echo and (logprobs or score_only),
        prompt_top_logprobs=top_logprobs if echo and logprobs else 0,
        truncate_prompt_tokens=body.truncate_prompt_tokens or 0,
        score_only=score_only,
        constraint=constraint,
        speculative_tokens=body.num_speculative_tokens,
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


def _requests(
    prompts: list[Prompt],
    options: GenerationOptions,
    n: int,
    model: LoadedModel,
    request_id: str,
    stream: bool,
) -> list[GenerationRequest]:
    """A request per (prompt, choice); `prompts` is updated to what truncate_prompt_tokens kept."""
    requests = []
    total = len(prompts) * n
    for p, prompt in enumerate(prompts):
        for c in range(n):
            index = p * n + c
            sampling = replace(options.sampling, seed=choice_seed(options.sampling.seed, c))
            requests.append(
                build_request(
                    replace(options, sampling=sampling),
                    request_id=request_id if total == 1 else f"{request_id}-{index}",
                    prompt=prompt.ids,
                    limits=model.limits,
                    deadline=None,
                    stream=stream,
                    fields=OPENAI_FIELDS,
                )
            )
    # Choices 1..n-1 fork choice 0's prefilled row when admitted with it (the engine copies its KV row and
    # first-step logits instead of computing the prompt again).
    for p in range(len(prompts)):
        for c in range(1, n):
            requests[p * n + c] = replace(requests[p * n + c], fork_of=requests[p * n].request_id)
    # What truncate_prompt_tokens kept is what was served (and what echo returns).
    for p, prompt in enumerate(prompts):
        kept = requests[p * n].prompt_ids
        if len(kept) != len(prompt.ids):
            prompts[p] = Prompt(kept, model.tokenizer.decode(kept, skip_special_tokens=False))
    return requests


# --- refusals and messages ---------------------------------------------------------------------------------


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


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them; InvalidRequest for a role or a message the
    API does not take."""
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
        out.append(template_message(index, message.role, text, calls, message.tool_call_id, message.name))
    return out


def message_text(index: int, message: ChatMessage) -> str:
    """A message's content as one string: text parts are joined with newlines (vLLM's way for templates
    that take string content); any other part is refused."""
    content = message.content
    if content is None:
        raise InvalidRequest(f"messages[{index}].content is required")
    if isinstance(content, str):
        return content
    texts = []
    for part, item in enumerate(content):
        if item.get("type") != "text" or not isinstance(item.get("text"), str):
            raise InvalidRequest(
                f"messages[{index}].content[{part}] is not a text part: this model takes text only "
                '({"type": "text", "text": "..."})'
            )
        texts.append(item["text"])
    return "\n".join(texts)

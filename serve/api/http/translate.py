"""What every generation route's translation shares: a body's fields → the scheduler's requests, in one pass.

Each wire protocol's translation is a module of its own (serve/api/openai/translate_completions.py,
translate_chat.py, translate_responses.py, and serve/api/anthropic/translate.py): it reads a body top to
bottom and makes a `Plan` (a `ChatPlan` for a chat, which the Responses and Messages requests are served
as). They share what is here: the model a body names (a served name or a LoRA adapter), the sampling
parameters and limits every route takes (`generation_options`), a chat's prompt rendered by the bundle's
template (tokenized off the event loop) and its tools read in the template's tool-call format, and the
requests, one `GenerationRequest` per (prompt, choice).

n > 1 is served as n requests with seeds derived from (seed, index) (`validation.choice_seed`): the same seed
gives the same n choices whatever else is batched. Choices 1..n-1 are forks of choice 0
(`GenerationRequest.fork_of`): admitted in its prefill group (the usual case), the prompt is prefilled once
and the engine copies its row (KV and first-step logits) into theirs; one left out of the group for lack of
rows is prefilled later on its own (from the prefix cache, when it keeps the prompt).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from serve.api.common import CallRecord, LoadedModel
from serve.api.http.fields import SamplingFields
from serve.api.state import ServingState
from serve.api.tool_calls import Tool, ToolChoice, ToolPlan, tool_plan
from serve.api.tool_formats import tool_format
from serve.api.validation import OPENAI_FIELDS, Fields, GenerationOptions, build_request, choice_seed
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint
from serve.errors import InvalidRequest, NotFound
from serve.scheduling.request import GenerationRequest


def named_model(state: ServingState, name: str | None) -> LoadedModel:
    """The served model, if `name` (a request's `model`) is one of its served names, one of its LoRA
    adapters, or None."""
    model = state.ready_model()
    if name is not None and name not in model.names and name not in model.info.adapters:
        served = ", ".join(repr(n) for n in model.names)
        adapters = f" and its adapters {', '.join(model.info.adapters)}" if model.info.adapters else ""
        raise NotFound(f"the model {name!r} does not exist: this server serves {served}{adapters}")
    return model


def with_adapter(plan: Plan, model: LoadedModel, name: str | None) -> str:
    """Run the plan's requests with the adapter `name` names (None or a served name: none); returns the
    name its answers give as their `model`: the one asked for, else the first served name (vLLM's way)."""
    if name is None or name in model.names:
        return name or model.name
    plan.requests[:] = [replace(request, adapter=name) for request in plan.requests]
    return name


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
class ChatPlan(Plan):
    tools: ToolPlan
    logprobs: bool


def model_tool_plan(
    model: LoadedModel, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan:
    """The request's tools, read in the tool-call format of the model's chat template."""
    form = tool_format(model.chat.source if model.chat is not None else None)
    return tool_plan(tools, choice, parallel, form)


async def chat_prompt(
    messages: list[dict[str, Any]],
    tools: ToolPlan,
    model: LoadedModel,
    record: CallRecord,
    documents: list[dict[str, Any]] | None = None,
    variables: dict[str, Any] | None = None,
) -> Prompt:
    """The messages rendered by the chat template (with the request's documents and template variables) and
    tokenized (off the event loop)."""
    ids = await asyncio.to_thread(model.chat_prompt, messages, tools.template_tools, documents, variables)
    record.prompt = json.dumps(messages, ensure_ascii=False)
    return Prompt(ids, "")


def chat_label(constraint: Constraint | None, tools: ToolPlan) -> str | None:
    return None if constraint is None else ("tool" if tools.constrained else constraint.kind.value)


# --- the fields of every route ------------------------------------------------------------------------------


def _sampling(body: SamplingFields) -> SamplingParams:
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


def generation_options(
    body: SamplingFields,
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
        priority=body.priority or 0,
    )


def generation_requests(
    prompts: list[Prompt],
    options: GenerationOptions,
    n: int,
    model: LoadedModel,
    request_id: str,
    stream: bool,
    fields: Fields = OPENAI_FIELDS,
) -> list[GenerationRequest]:
    """A request per (prompt, choice); `prompts` is updated to what truncate_prompt_tokens kept; `fields`:
    the route's names of the fields its errors name."""
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
                    fields=fields,
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


def joined_text(parts: list[Any], kinds: tuple[str, ...], where: str) -> str:
    """Content parts as one string: text parts (of a type in `kinds`) joined with newlines, vLLM's way for
    templates that take string content; any other part is refused."""
    texts = []
    for index, part in enumerate(parts):
        if (
            not isinstance(part, dict)
            or part.get("type") not in kinds
            or not isinstance(part.get("text"), str)
        ):
            raise InvalidRequest(
                f"{where}[{index}] is not a text part: this model takes text only "
                f'({{"type": "{kinds[0]}", "text": "..."}})'
            )
        texts.append(part["text"])
    return "\n".join(texts)


M = TypeVar("M", bound=BaseModel)


def validated(model: type[M], value: Any, where: str) -> M:
    """`value` as a `model`; InvalidRequest naming its first wrong field under `where`, as FastAPI names
    the body's."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join([where, *(str(part) for part in first["loc"])])
        raise InvalidRequest(f"{field}: {first['msg']}") from None

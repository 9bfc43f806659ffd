"""A generation request's body → the scheduler's requests, in one pass: the whole of what the HTTP API
decides about a completion, a chat or a response before anything is submitted.

`completion_plan` and `chat_plan` each read a body top to bottom: the model it names, the fields this server
refuses (`UNSUPPORTED`), n against the server's max_n, the constraint (OpenAI's response_format, vLLM's
structured-output fields, or a tool call that tool_choice forces), the sampling parameters and limits, the
prompt (text or token ids, tokenized off the event loop; a chat rendered by the bundle's template), and
then one `GenerationRequest` per (prompt, choice). `responses_plan` reads a Responses request as the chat it
means (its input items as messages, its function tools as chat's, text.format as the constraint), one
choice, and its errors name the Responses fields (`input.N`, `max_output_tokens`). `messages_plan` reads
Anthropic's Messages request the same way (its system prompt, blocks and tools as chat's, one choice).

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
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from serve.api.anthropic.protocol import (
    AnthropicTool,
    AnthropicToolChoice,
    MessagesInput,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from serve.api.common import CallRecord, LoadedModel
from serve.api.openai.protocol import (
    CHAT_ROLES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionCallItem,
    FunctionCallOutputItem,
    ResponsesRequest,
    SamplingFields,
    SamplingRequest,
)
from serve.api.openai.structured_output import (
    chat_constraint,
    output_format,
    structured_output,
    text_format,
    tool_or_format,
)
from serve.api.state import ServingState
from serve.api.tool_calls import (
    CalledFunction,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolCallIn,
    ToolChoice,
    ToolPlan,
    template_message,
    tool_plan,
)
from serve.api.tool_formats import tool_format
from serve.api.validation import (
    MESSAGES_FIELDS,
    OPENAI_FIELDS,
    RESPONSES_FIELDS,
    Fields,
    GenerationOptions,
    build_request,
    choice_seed,
    text_prompt,
    token_prompt,
)
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
class CompletionPlan(Plan):
    echo: bool
    logprobs: int | None  # the alternatives per token; None: no logprobs


@dataclass
class ChatPlan(Plan):
    tools: ToolPlan
    logprobs: bool


@dataclass
class ResponsesPlan(ChatPlan):
    """A Responses request served as the chat it means (one choice; logprobs when `include` asks)."""

    request: ResponsesRequest  # its fields are echoed in the response
    context_length: int  # the model's: an output cut short there is incomplete for its own reason


@dataclass
class MessagesPlan(ChatPlan):
    """A Messages request served as the chat it means (one choice, no logprobs)."""

    max_tokens: int  # asked for: an output cut short before it filled the context
    context_length: int  # the model's


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
    tools = _tool_plan(model, body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = chat_constraint(body, tools)
    options = _options(
        body, max_tokens, constraint, logprobs=bool(body.logprobs), top_logprobs=body.top_logprobs or 0
    )
    prompts, n = [await _chat_prompt(chat_messages(body.messages), tools, model, record)], body.n or 1
    requests = _requests(prompts, options, n, model, record.request_id, bool(body.stream))
    label = _chat_label(constraint, tools)
    stream, usage = bool(body.stream), _include_usage(body)
    return ChatPlan(prompts, requests, n, stream, usage, label, tools, bool(body.logprobs))


async def responses_plan(body: ResponsesRequest, model: LoadedModel, record: CallRecord) -> ResponsesPlan:
    """A Responses request as the chat it means: `instructions` and the `input` items as messages, function
    tools, `text.format` as the constraint, `max_output_tokens` as max_tokens; its errors name the Responses
    fields. `record.prompt` as chat_plan sets it."""
    if body.previous_response_id is not None:
        raise InvalidRequest("previous_response_id: this server stores no responses; send the whole input")
    if body.store:
        raise InvalidRequest("store: this server stores no responses; leave store unset or false")
    if body.max_output_tokens == 0:
        raise InvalidRequest(
            "max_output_tokens = 0 generates nothing: give 1 or more "
            "(or leave it out for the server's default)"
        )
    _check_metadata(body.metadata or {})
    _check_reasoning(body.reasoning)
    choice = _responses_tool_choice(body.tool_choice)
    tools = _tool_plan(model, _function_tools(body.tools), choice, body.parallel_tool_calls)
    logprobs = _output_logprobs(body, tools)
    constraint = tool_or_format(tools, text_format(body.text))
    options = _options(
        body, body.max_output_tokens, constraint, logprobs=logprobs, top_logprobs=body.top_logprobs or 0
    )
    prompts = [await _chat_prompt(_input_messages(body), tools, model, record)]
    stream = bool(body.stream)
    requests = _requests(prompts, options, 1, model, record.request_id, stream, RESPONSES_FIELDS)
    label = _chat_label(constraint, tools)
    context = model.limits.context_length
    return ResponsesPlan(prompts, requests, 1, stream, False, label, tools, logprobs, body, context)


async def messages_prompt(
    body: MessagesInput, model: LoadedModel, record: CallRecord
) -> tuple[Prompt, ToolPlan]:
    """A Messages request's prompt, rendered as a chat's (`system` and the blocks as its messages, the tools
    as its function tools), and its tools' plan; /v1/messages/count_tokens counts this prompt."""
    parallel = None if body.tool_choice is None else not body.tool_choice.disable_parallel_tool_use
    tools = _tool_plan(
        model, _anthropic_tools(body.tools), _anthropic_tool_choice(body.tool_choice), parallel
    )
    return await _chat_prompt(_anthropic_messages(body), tools, model, record), tools


async def messages_plan(body: MessagesRequest, model: LoadedModel, record: CallRecord) -> MessagesPlan:
    """A Messages request as the chat it means (one choice, no logprobs): a forced tool call constrained as
    chat's, `output_config.format` as Responses' text.format, `stop_sequences` beside vLLM's `stop`.
    `record.prompt` as chat_plan sets it."""
    prompt, tools = await messages_prompt(body, model, record)
    constraint = tool_or_format(tools, output_format(body.output_config))
    options = _options(body, body.max_tokens, constraint, logprobs=False, top_logprobs=0)
    options = replace(options, stop=[*options.stop, *(body.stop_sequences or ())])
    stream = bool(body.stream)
    requests = _requests([prompt], options, 1, model, record.request_id, stream, MESSAGES_FIELDS)
    label = _chat_label(constraint, tools)
    context = model.limits.context_length
    return MessagesPlan([prompt], requests, 1, stream, False, label, tools, False, body.max_tokens, context)


def _tool_plan(
    model: LoadedModel, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None
) -> ToolPlan:
    """The request's tools, read in the tool-call format of the model's chat template."""
    form = tool_format(model.chat.source if model.chat is not None else None)
    return tool_plan(tools, choice, parallel, form)


async def _chat_prompt(
    messages: list[dict[str, Any]], tools: ToolPlan, model: LoadedModel, record: CallRecord
) -> Prompt:
    """The messages rendered by the chat template and tokenized (off the event loop)."""
    ids = await asyncio.to_thread(model.chat_prompt, messages, tools.template_tools)
    record.prompt = json.dumps(messages, ensure_ascii=False)
    return Prompt(ids, "")


def _chat_label(constraint: Constraint | None, tools: ToolPlan) -> str | None:
    return None if constraint is None else ("tool" if tools.constrained else constraint.kind.value)


def _check_body(body: SamplingRequest, max_n: int) -> None:
    _refuse_unsupported(body)
    n = body.n or 1
    if n > max_n:
        raise InvalidRequest(f"n = {n}; allowed 1..{max_n} (the server's max_n)")


def _include_usage(body: SamplingRequest) -> bool:
    return bool(body.stream and body.stream_options is not None and body.stream_options.include_usage)


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


def _options(
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
    """A message's content as one string (`_joined_text`)."""
    content = message.content
    if content is None:
        raise InvalidRequest(f"messages[{index}].content is required")
    if isinstance(content, str):
        return content
    return _joined_text(content, ("text",), f"messages[{index}].content")


def _joined_text(parts: list[Any], kinds: tuple[str, ...], where: str) -> str:
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


# --- a Responses request's input and tools ------------------------------------------------------------------

# The roles of a Responses message item, as the chat template knows them.
RESPONSES_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
TOOL_MODES: dict[str, ToolChoice] = {"none": "none", "auto": "auto", "required": "required"}

M = TypeVar("M", bound=BaseModel)


def _input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and the `input` items as the chat template's messages; consecutive function_call items
    are one assistant message with several calls, as chat has them."""
    if body.input == []:  # nothing to answer, instructions or not (OpenAI refuses it too)
        raise InvalidRequest("input is empty: give a string, or at least one item")
    messages = [template_message(0, "system", body.instructions)] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for index, item in enumerate(items):
        message = _input_message(index, item)
        previous = messages[-1] if messages else None
        if "tool_calls" in message and previous is not None and "tool_calls" in previous:
            previous["tool_calls"] = previous["tool_calls"] + message["tool_calls"]
        else:
            messages.append(message)
    return messages


def _input_message(index: int, item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = _validated(FunctionCallItem, item, f"input.{index}")
        function = CalledFunction(name=call.name, arguments=call.arguments)  # JSON or not: as chat takes it
        called = ToolCallIn(id=call.call_id, function=function)
        return template_message(index, "assistant", None, [called])
    if kind == "function_call_output":
        result = _validated(FunctionCallOutputItem, item, f"input.{index}")
        text = result.output if isinstance(result.output, str) else json.dumps(result.output)
        return template_message(index, "tool", text, tool_call_id=result.call_id)
    role = item.get("role")
    if kind != "message" or not isinstance(role, str) or role not in RESPONSES_ROLES:
        raise InvalidRequest(
            f"input[{index}]: expected a message (role user, system, developer or assistant), a "
            f"function_call or a function_call_output item; got type {kind!r}, role {role!r}"
        )
    return template_message(index, RESPONSES_ROLES[role], _input_text(index, item.get("content")))


def _input_text(index: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{index}].content must be a string or a list of text parts")
    return _joined_text(content, TEXT_PARTS, f"input[{index}].content")


# OpenAI's limits on a response's metadata.
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# What `include` may ask for: the output text's logprobs, and reasoning's encrypted content, of which this
# model, which does not reason, has none. The others name tools and inputs this server does not take.
INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequest(f"metadata has {len(metadata)} keys: at most {MAX_METADATA_KEYS}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(f"metadata key {key[:20]!r}... is longer than {MAX_METADATA_KEY} characters")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(f"metadata[{key!r}] is longer than {MAX_METADATA_VALUE} characters")


def _check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """OpenAI's `reasoning` configures a reasoning model; this one has no reasoning to configure, so only
    what asks for none is served."""
    reasoning = reasoning or {}
    if reasoning.get("effort") not in (None, "none") or reasoning.get("summary") is not None:
        raise InvalidRequest(
            'reasoning: this model does not reason; leave reasoning out (or give {"effort": "none"})'
        )


def _output_logprobs(body: ResponsesRequest, tools: ToolPlan) -> bool:
    """Whether the output text's logprobs are served: `include` asks for them (top_logprobs alone does
    not), and there are no tools, whose calls' tokens are no text's."""
    for name in body.include or ():
        if name not in INCLUDABLE:
            raise InvalidRequest(f"include: {name!r} is not served here; this server includes {INCLUDABLE}")
    wanted = OUTPUT_LOGPROBS in (body.include or ())
    if body.top_logprobs and not wanted:
        raise InvalidRequest(f'top_logprobs needs include: ["{OUTPUT_LOGPROBS}"]')
    if wanted and tools.mode != "none":
        raise InvalidRequest(f"include {OUTPUT_LOGPROBS!r} is served without tools; leave out tools or it")
    return wanted


def _function_tools(tools: list[dict[str, Any]] | None) -> list[Tool]:
    """Responses' function tools (`{"type": "function", "name", "parameters", ...}`) as chat's."""
    out = []
    for index, tool in enumerate(tools or ()):
        if tool.get("type") != "function":
            raise InvalidRequest(
                f"tools[{index}].type is {tool.get('type')!r}: only function tools are served"
            )
        definition = {key: value for key, value in tool.items() if key != "type"}
        out.append(
            Tool(type="function", function=_validated(FunctionDefinition, definition, f"tools.{index}"))
        )
    return out


def _responses_tool_choice(choice: str | dict[str, Any] | None) -> ToolChoice | None:
    if choice is None:
        return None
    if isinstance(choice, str) and choice in TOOL_MODES:
        return TOOL_MODES[choice]
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return NamedToolChoice(type="function", function=FunctionName(name=choice["name"]))
    raise InvalidRequest(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        f"got {json.dumps(choice)[:80]}"
    )


def _validated(model: type[M], value: Any, where: str) -> M:
    """`value` as a `model`; InvalidRequest naming its first wrong field under `where`, as FastAPI names
    the body's."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join([where, *(str(part) for part in first["loc"])])
        raise InvalidRequest(f"{field}: {first['msg']}") from None


# --- an Anthropic Messages request's messages and tools -----------------------------------------------------

ANTHROPIC_TOOL_MODES: dict[str, ToolChoice] = {"auto": "auto", "any": "required", "none": "none"}


def _anthropic_messages(body: MessagesInput) -> list[dict[str, Any]]:
    """`system` and the messages as the chat template's: a user message's tool_result blocks are tool
    messages (before its text, as Anthropic orders them), an assistant's tool_use blocks its calls."""
    system = body.system
    if isinstance(system, list):
        system = "\n".join(block.text for block in system)
    messages = [template_message(0, "system", system)] if system else []
    for index, message in enumerate(body.messages):
        content = message.content
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        texts, calls, results = _blocks(index, blocks)
        if message.role == "assistant":
            if results:
                raise InvalidRequest(f"messages.{index}.content: tool_result blocks belong in a user message")
            messages.append(template_message(index, "assistant", "\n".join(texts) or None, calls))
            continue
        if calls:
            raise InvalidRequest(f"messages.{index}.content: tool_use blocks belong in an assistant message")
        messages += [
            template_message(index, "tool", _result_text(r), tool_call_id=r.tool_use_id) for r in results
        ]
        if texts or not results:
            messages.append(template_message(index, "user", "\n".join(texts)))
    return messages


def _blocks(
    index: int, blocks: list[dict[str, Any]]
) -> tuple[list[str], list[ToolCallIn], list[ToolResultBlock]]:
    """A message's blocks by kind: its texts, its calls, its tool results."""
    texts: list[str] = []
    calls: list[ToolCallIn] = []
    results: list[ToolResultBlock] = []
    for j, block in enumerate(blocks):
        where, kind = f"messages.{index}.content.{j}", block.get("type")
        if kind == "text":
            texts.append(_validated(TextBlock, block, where).text)
        elif kind == "tool_use":
            use = _validated(ToolUseBlock, block, where)
            calls.append(ToolCallIn(id=use.id, function=CalledFunction(name=use.name, arguments=use.input)))
        elif kind == "tool_result":
            results.append(_validated(ToolResultBlock, block, where))
        else:
            raise InvalidRequest(
                f"{where}.type is {json.dumps(kind)[:40]}: "
                "this model takes text, tool_use and tool_result blocks"
            )
    return texts, calls, results


def _result_text(result: ToolResultBlock) -> str:
    """A tool result as a tool message's text; templates have no field for a failed call, so its text says."""
    text = result.content if isinstance(result.content, str) else "\n".join(b.text for b in result.content)
    return f"Error: {text}" if result.is_error else text


def _anthropic_tools(tools: list[AnthropicTool] | None) -> list[Tool]:
    """Anthropic's tools (`name`, `description`, `input_schema`) as chat's function tools."""
    return [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.input_schema
            ),
        )
        for tool in tools or ()
    ]


def _anthropic_tool_choice(choice: AnthropicToolChoice | None) -> ToolChoice | None:
    if choice is None:
        return None
    if choice.type != "tool":
        return ANTHROPIC_TOOL_MODES[choice.type]
    if choice.name is None:
        raise InvalidRequest('tool_choice.name is required with type "tool"')
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))

"""OpenAI's request bodies (pydantic) and response objects, for /v1/completions and /v1/chat/completions.

Requests follow OpenAI's API reference, with vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
truncate_prompt_tokens). Ranges are OpenAI's: temperature 0..2, top_p 0..1, the penalties -2..2, n >= 1,
top_logprobs (and the completions' logprobs) 0..20, max_tokens >= 0. Chat takes `tools`, `tool_choice` and
`parallel_tool_calls` (serve/api/tool_calls.py) and the history's tool calls and tool results. Unknown
fields that do not change the output (user, metadata, store, ...) are accepted and ignored; those that would
and are not supported here (`UNSUPPORTED`) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders

from serve.api.tool_calls import Tool, ToolCallIn, ToolChoice, ToolPlan, template_message
from serve.engine.sampling import MAX_TOP_LOGPROBS, Alternatives
from serve.engine.types import Constraint
from serve.errors import InvalidRequest

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each takes n rows)
CHAT_ROLES = ("system", "user", "assistant", "tool")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # see UNSUPPORTED: the rest is ignored


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Request(_Body):
    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    max_tokens: int | None = Field(None, ge=0, description="default: the server's default_max_new_tokens")
    temperature: float | None = Field(None, ge=0, le=2, description="default 1; 0: greedy")
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(1, ge=1, description="choices per prompt (at most the server's max_n)")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in -100..100"
    )
    user: str | None = None
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, description="1: off")
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    truncate_prompt_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, token ids, or a list of token-id lists"
    )
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a text prompt, or chat messages tokenized as a chat completion's prompt is."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    prompt: str | None = Field(None, description="text to tokenize (give this or messages)")
    messages: list[ChatMessage] | None = Field(
        None,
        description="a chat, rendered by the model's chat template with the assistant's generation prompt",
    )
    add_special_tokens: bool | None = Field(
        None, description="a prompt's special tokens (BOS), as a completion adds them; default true"
    )
    return_token_strs: bool | None = Field(False, description="each id's vocabulary entry too")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    tokens: list[int] = Field(description="token ids, each in the model's vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or a named function'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice required makes one call")


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


def _constraint_of(kind: str, value: Any, where: str) -> Constraint:
    """vLLM's structured-output kinds (guided_* and structured_outputs.*) as a neutral constraint, whose
    errors name the field `where`."""
    return replace(_constraint_kind(kind, value, where), source=where)


def _constraint_kind(kind: str, value: Any, where: str) -> Constraint:
    if kind == "json":
        if isinstance(value, str):
            return Constraint.json_schema(value)
        if isinstance(value, dict | bool):
            return Constraint.json_schema(value)
        raise InvalidRequest(f"{where} must be a JSON Schema (an object, or its JSON text)")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"{where} must be a list of strings")
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string")
    return Constraint.regex(value) if kind == "regex" else Constraint.grammar(value)


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("response_format.type must be text, json_object or json_schema")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return Constraint.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequest('response_format.json_schema needs a schema: {"name": ..., "schema": {...}}')
    return _constraint_of("json", spec["schema"], "response_format.json_schema.schema")


def structured_output(body: _Request) -> Constraint | None:
    """What the output must match: OpenAI's response_format, or vLLM's guided_json / guided_regex /
    guided_choice / guided_grammar, or its newer structured_outputs {json, regex, choice, grammar}. At most
    one may be given; each is enforced token by token (serve/engine/constraints.py)."""
    extra = body.model_extra or {}
    found: list[tuple[str, Constraint]] = []
    if extra.get("response_format") is not None:
        constraint = _response_format(extra["response_format"])
        if constraint is not None:
            found.append(("response_format", constraint))
    for kind in ("json", "regex", "choice", "grammar"):
        if extra.get(f"guided_{kind}") is not None:
            found.append((f"guided_{kind}", _constraint_of(kind, extra[f"guided_{kind}"], f"guided_{kind}")))
    outputs = extra.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise InvalidRequest('structured_outputs must be an object such as {"json": {...}}')
        for kind in ("json", "regex", "choice", "grammar"):
            if outputs.get(kind) is not None:
                where = f"structured_outputs.{kind}"
                found.append((where, _constraint_of(kind, outputs[kind], where)))
    if len(found) > 1:
        raise InvalidRequest(
            f"give one structured-output constraint, not {len(found)}: {[w for w, _ in found]}"
        )
    return found[0][1] if found else None


def chat_constraint(body: ChatCompletionRequest, plan: ToolPlan) -> Constraint | None:
    """A chat's constraint: a forced tool call's, or the structured output asked for (not both)."""
    constraint = structured_output(body)
    forced = plan.constraint()
    if forced is None:
        return constraint
    if constraint is not None:
        raise InvalidRequest(
            f"tool_choice {plan.named or plan.mode!r} constrains the output to a tool call: leave out "
            "response_format (and vLLM's structured-output fields)"
        )
    return forced


def refuse_unsupported(body: _Request) -> None:
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


def finish_reason(reason: str) -> str:
    """textgen's finish reason as OpenAI's: EOS and stop sequences are "stop", the limits "length"."""
    return "stop" if reason in ("eos", "stop") else "length"


# --- tokens as OpenAI shows them ----------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet backwards: each printable stand-in character -> its byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Vocabulary:
    """Each token id's text (decoded alone, special tokens kept) and bytes, cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self._bytes_of = _byte_decoder()
        self._special = {
            token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special
        }
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            piece = self._tokenizer.id_to_token(token_id)
            if self._byte_level and piece is not None and piece not in self._special:
                raw = [self._bytes_of[c] for c in piece if c in self._bytes_of]
            else:
                raw = list(text.encode("utf-8"))
            cached = self._cache[token_id] = (text, raw)
        return cached

    def text(self, token_id: int) -> str:
        return self.token(token_id)[0]


# --- logprobs in the two formats ----------------------------------------------------------------------------


def completion_logprobs(
    vocab: Vocabulary,
    token_ids: list[int],
    logprobs: list[float | None],
    tops: list[Alternatives | None],
    offset: int,
) -> tuple[dict[str, Any], int]:
    """The legacy completions `logprobs` object for some tokens, their text starting at `offset` of the
    choice's text; returns it and the offset after them."""
    tokens, offsets, top_dicts = [], [], []
    for token_id, top in zip(token_ids, tops, strict=True):
        text = vocab.text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top_dicts.append(
            None
            if top is None
            else {vocab.text(t): lp for t, lp in zip(top.token_ids, top.logprobs, strict=True)}
        )
    body = {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top_dicts, "text_offset": offsets}
    return body, offset


def chat_logprobs(
    vocab: Vocabulary, token_ids: list[int], logprobs: list[float], tops: list[Alternatives]
) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries for some tokens."""
    out = []
    for index, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text, raw = vocab.token(token_id)
        top = tops[index] if index < len(tops) else None
        alternatives = (
            []
            if top is None
            else [
                {"token": vocab.token(t)[0], "logprob": lp, "bytes": vocab.token(t)[1]}
                for t, lp in zip(top.token_ids, top.logprobs, strict=True)
            ]
        )
        out.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return out


ObjectKind = Literal["text_completion", "chat.completion", "chat.completion.chunk"]

"""The HTTP API's wire objects: OpenAI's request bodies (pydantic) and the response objects (typed dicts
whose schemas pydantic writes into /openapi.json), for every route.

Requests follow OpenAI's API reference, with vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
truncate_prompt_tokens). Ranges are OpenAI's: temperature 0..2, top_p 0..1, the penalties -2..2, n >= 1,
top_logprobs (and the completions' logprobs) 0..20, max_tokens >= 0. Chat takes `tools`, `tool_choice` and
`parallel_tool_calls` (serve/api/tool_calls.py) and the history's tool calls and tool results. /v1/responses
takes OpenAI's Responses request with the same sampling fields (`SamplingFields`), its `input` items and
function tools in their own shape, and `max_output_tokens` (>= 0) for max_tokens. Unknown
fields that do not change the output (user, safety_identifier, ...) are accepted and ignored; those that would
and are not supported here are refused (serve/api/openai/refusals.py).

Responses are typed dicts, not models: a stream sends one object per token, and a dict is serialized as it
is built (no model to construct and dump on that path), while the schema still says every field. A key
that is sometimes absent (a chat message's `tool_calls`, a chunk's `usage`) is `NotRequired`; one that is
always sent, null or not, is required.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import NotRequired, TypedDict

from serve.api.http.fields import AT_LEAST_ONE, SamplingFields, _Body
from serve.api.tool_calls import Tool, ToolCallIn, ToolChoice
from serve.engine.sampling import MAX_TOP_LOGPROBS

MAX_PROMPTS = 64  # prompts in one /v1/completions request (each takes n rows)
CHAT_ROLES = ("system", "user", "assistant", "tool")

# What /openapi.json says of lengths the routes check themselves (translate_*.py, validation.py), so a client
# or a fuzzer generated from the schema knows them. Said in the schema only: pydantic would refuse them first
# in its own words (for the prompt, once per member of its union), not with the routes' messages, which name
# the empty field.
NOT_EMPTY = Field(json_schema_extra={"minLength": 1})
PROMPT_COUNT = Field(json_schema_extra={"minItems": 1, "maxItems": MAX_PROMPTS})
Text = Annotated[str, NOT_EMPTY]
TokenIds = Annotated[list[int], AT_LEAST_ONE]
Prompt = Text | Annotated[list[Text], PROMPT_COUNT] | TokenIds | Annotated[list[TokenIds], PROMPT_COUNT]

# --- requests -----------------------------------------------------------------------------------------------


class StreamOptions(_Body):
    include_usage: bool | None = False


# What a request that gives no output length gets (serve/api/validation.py, max_new_tokens).
DEFAULT_OUTPUT = "default: until the context is full (or the server's --default-max-new-tokens)"


class SamplingRequest(SamplingFields):
    """What /v1/completions and /v1/chat/completions take besides."""

    max_tokens: int | None = Field(None, ge=0, description=DEFAULT_OUTPUT)
    n: int | None = Field(1, ge=1, description="choices per prompt (at most the server's max_n)")
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingRequest):
    prompt: Prompt = Field(description="a string, a list of strings, token ids, or a list of token-id lists")
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
    messages: Annotated[list[ChatMessage], AT_LEAST_ONE] | None = Field(
        None,
        description="a chat, rendered by the model's chat template with the assistant's generation prompt",
    )
    add_special_tokens: bool | None = Field(
        None, description="a prompt's special tokens (BOS), as a completion adds them; default true"
    )
    tools: list[Tool] | None = Field(None, description="with messages: the tools the chat declares")
    documents: list[dict[str, Any]] | None = Field(None, description="with messages: the chat's documents")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="with messages: more variables for the chat template"
    )
    return_token_strs: bool | None = Field(False, description="each id's vocabulary entry too")


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = Field(None, description="the served model's name (GET /v1/models); default: it")
    tokens: list[int] = Field(description="token ids, each in the model's vocabulary")


class LoadLoraAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter (served with --lora-runtime-updates)."""

    lora_name: str = Field(
        description="the name requests give as their model to run with it: 1 to 128 letters, digits and "
        "._:/- starting with a letter or digit"
    )
    lora_path: str = Field(
        description="the adapter's folder as peft saves it, under the server's --lora-root (relative to it, "
        "or absolute within it)"
    )


class UnloadLoraAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter (served with --lora-runtime-updates)."""

    lora_name: str = Field(description="a loaded adapter's name")


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], AT_LEAST_ONE]
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        None, description='"none", "auto" (the default with tools), "required" or a named function'
    )
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice required makes one call")
    documents: list[dict[str, Any]] | None = Field(
        None, description="vLLM's: documents for a chat template that takes them (Granite's)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="vLLM's: more variables for the chat template, as apply_chat_template's keyword "
        "arguments (SmolLM3's enable_thinking and xml_tools, ...)",
    )


class ResponsesRequest(SamplingFields):
    """OpenAI's Responses request, stateless: nothing is stored, so nothing can be continued."""

    input: str | Annotated[list[dict[str, Any]], AT_LEAST_ONE] = Field(
        description="a user message, or message, function_call and function_call_output items"
    )
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=0, description=DEFAULT_OUTPUT)
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "json_schema", ...}}')
    tools: list[dict[str, Any]] | None = Field(None, description="function tools")
    tool_choice: str | dict[str, Any] | None = Field(
        None,
        description='"none", "auto" (the default with tools), "required" or {"type": "function", "name"}',
    )
    parallel_tool_calls: bool | None = Field(None, description="false: tool_choice required makes one call")
    previous_response_id: str | None = Field(None, description="refused: responses are not stored")
    store: bool | None = Field(None, description="true is refused: responses are not stored")
    metadata: dict[str, str] | None = Field(
        None, description="echoed: up to 16 keys of up to 64 characters, values of up to 512"
    )
    include: list[str] | None = Field(
        None, description='"message.output_text.logprobs": the output text\'s logprobs (without tools)'
    )
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token, with the included logprobs"
    )
    reasoning: dict[str, Any] | None = Field(
        None, description='this model does not reason: only {"effort": "none"} (or null) is served'
    )


# The items of a Responses `input` that are not messages, each validated on its own, so that an error names
# `input.N` (messages are read by hand: their content is a string or text parts).
class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = ""


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Any = Field(description="the call's result: text, or JSON sent as its text")


# --- responses ----------------------------------------------------------------------------------------------


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    """Prompts are counted once per prompt, not once per choice (as OpenAI does)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(TypedDict):
    """The legacy completions `logprobs`: each token's text, logprob (none for an echoed prompt's first),
    alternatives (text -> logprob) and where its text begins in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(TypedDict):
    """/v1/completions' answer; a stream sends it in chunks of one choice each, `usage` only on the last
    (null on the others) when `stream_options.include_usage` asks for it."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: NotRequired[Usage | None]


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
    content: list[TokenLogprob]


class CalledFunctionOut(TypedDict):
    name: NotRequired[str | None]
    arguments: str


class ToolCallOut(TypedDict):
    """A call as the answer gives it; a stream's later pieces of a call carry its `index` and new
    `arguments` only."""

    index: NotRequired[int]
    id: NotRequired[str | None]
    type: NotRequired[Literal["function"]]
    function: CalledFunctionOut


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCallOut]]


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletionResponse(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(TypedDict):
    """What a chunk adds to a choice's message: the role on its first chunk, then text or call pieces."""

    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCallOut]]


class ChatChunkChoice(TypedDict):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(TypedDict):
    """One server-sent event of a streamed chat completion (`data: {...}`, then `data: [DONE]`); `usage`
    as a completion's chunks have it."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: None
    choices: list[ChatChunkChoice]
    usage: NotRequired[Usage | None]


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str  # the base model's name, or an adapter's own (vLLM's field)
    parent: str | None  # a LoRA adapter's base model; None for the base model


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(TypedDict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(TypedDict):
    prompt: str


class ErrorObject(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(TypedDict):
    """Every error, in OpenAI's shape (serve/api/http_status.py maps each kind to its status and type)."""

    error: ErrorObject


# --- /v1/responses' answer ----------------------------------------------------------------------------------

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob]  # empty unless `include` asks for them


class OutputMessage(TypedDict):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class FunctionCallOut(TypedDict):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class IncompleteDetails(TypedDict):
    """Why an incomplete response stopped: its max_output_tokens (or the server's default for it), or the
    model's context, full before that."""

    reason: Literal["max_output_tokens", "context_length"]


class ResponseError(TypedDict):
    code: str  # OpenAI's error type: server_error, invalid_request_error, ...
    message: str


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(TypedDict):
    """The response (`object: "response"`), whole or as the streamed events carry it; the request's fields
    are echoed."""

    id: str
    object: Literal["response"]
    created_at: int
    status: ResponseStatus
    model: str
    output: list[OutputMessage | FunctionCallOut]
    incomplete_details: IncompleteDetails | None
    error: ResponseError | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    previous_response_id: None
    store: Literal[False]
    metadata: dict[str, str]
    reasoning: dict[str, str | None]  # effort: the request's ("none" or null), summary: null
    usage: ResponseUsage | None

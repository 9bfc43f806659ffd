"""Anthropic's Messages API on the wire: its request bodies (pydantic) and its answer (typed dicts), as
serve/api/openai/protocol.py has OpenAI's.

A request takes Anthropic's fields (`system`, `messages` of text, tool_use and tool_result blocks,
`max_tokens`, required, `stop_sequences`, `tools` with an `input_schema`, `tool_choice` auto / any / tool /
none, `output_config.format`, a JSON schema the text must match) and the sampling fields every route takes
(`SamplingFields`: temperature, top_p, top_k, vLLM's extras).
A message's blocks are read by hand (translate.py), so that an error names `messages.N.content.M`; their
models are here. Fields that do not change the output (`metadata`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field
from typing_extensions import TypedDict

from serve.api.http.fields import AT_LEAST_ONE, SamplingFields, _Body
from serve.api.tool_calls import NAME_PATTERN

# --- requests -----------------------------------------------------------------------------------------------


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    """An assistant's call in the history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    """A user's answer to a call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]] = Field(
        description="a string, or text, tool_use and tool_result blocks"
    )


class AnthropicTool(_Body):
    name: str = Field(pattern=NAME_PATTERN, description="a-z, A-Z, 0-9, _ and -, at most 64")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="a JSON Schema of the tool's input object")


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description='the tool that type "tool" forces')
    disable_parallel_tool_use: bool | None = Field(None, description='true: "any" makes one call')


class OutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON Schema the text must match")


class OutputConfig(_Body):
    format: OutputFormat | None = Field(None, description="the text is one JSON value of this schema")
    effort: str | None = Field(None, description="accepted and ignored: the model does not reason at length")


class MessagesInput(_Body):
    """What makes a Messages prompt: /v1/messages/count_tokens takes this alone."""

    model: str = Field(description="the served model's name (GET /v1/models)")
    messages: Annotated[list[Message], AT_LEAST_ONE]
    system: str | list[TextBlock] | None = Field(None, description="a system prompt, a string or text blocks")
    tools: list[AnthropicTool] | None = Field(None, description="tools the model may call")
    tool_choice: AnthropicToolChoice | None = Field(None, description='default: "auto" with tools')


class MessagesRequest(MessagesInput, SamplingFields):  # MessagesInput's `model` (required) comes first
    max_tokens: int = Field(ge=1, description="the most tokens to generate")
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = Field(None, description="accepted and ignored")
    output_config: OutputConfig | None = None


# --- the answer ---------------------------------------------------------------------------------------------


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"]


class TextOut(TypedDict):
    type: Literal["text"]
    text: str


class ToolUseOut(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessagesUsage(TypedDict):
    input_tokens: int  # the prompt's tokens computed, not read from the prefix cache (Anthropic's sense)
    cache_creation_input_tokens: int  # 0: the prefix cache is written as it goes, at no extra cost
    cache_read_input_tokens: int
    output_tokens: int


class MessageObject(TypedDict):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    content: list[TextOut | ToolUseOut]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(TypedDict):
    input_tokens: int


class AnthropicErrorObject(TypedDict):
    type: str
    message: str


class AnthropicError(TypedDict):
    type: Literal["error"]
    error: AnthropicErrorObject

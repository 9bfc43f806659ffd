"""Tool calls on /v1/chat/completions with the openai client, against a server of the tiny bundle whose chat
template declares tools (tests/support/chat_templates.py: compact, for its 128-token context). The engine
runs in its own process, so the constraint metrics cross the pipe as the server's do."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from chat_templates import COMPACT_LLAMA, COMPACT_MISTRAL, COMPACT_TOOLS
from running_server import RunningServer, serve_with_template
from server_tools import LoopThread

from serve.api.chat import ChatTemplate

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
USER = [{"role": "user", "content": "Oslo?"}]
NAMED: Any = {"type": "function", "function": {"name": "weather"}}


@pytest.fixture(scope="module")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = serve_with_template(
        loop, tiny_bundle, tmp_path_factory.mktemp("tools"), COMPACT_TOOLS, engine_process=True
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    """A greedy chat completion of the served model (the first one the server lists)."""
    model = client.models.list().data[0].id
    return client.chat.completions.create(
        model=model, messages=fields.pop("messages", USER), temperature=0, **fields
    )


def test_a_named_function_is_one_call_whose_arguments_validate(client: openai.OpenAI) -> None:
    reply = chat(client, tools=TOOLS, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_streamed_named_call_reassembles_into_the_unary_arguments(client: openai.OpenAI) -> None:
    unary = chat(client, tools=TOOLS, tool_choice=NAMED).choices[0].message.tool_calls[0]
    chunks = list(chat(client, tools=TOOLS, tool_choice=NAMED, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    first = deltas[0].tool_calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "weather" and len(deltas) > 1
    assert all(d.tool_calls[0].id is None and d.tool_calls[0].function.name is None for d in deltas[1:])
    arguments = "".join(d.tool_calls[0].function.arguments or "" for d in deltas)
    assert arguments == unary.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_required_calls_name_a_tool_and_validate_against_its_schema(client: openai.OpenAI) -> None:
    reply = chat(client, tools=TOOLS, tool_choice="required", max_tokens=48)
    choice = reply.choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.message.content is None
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # "length": the last is cut
    assert choice.finish_reason in ("tool_calls", "length") and len({c.id for c in calls}) == len(calls)
    for call in complete:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    one = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert one.choices[0].finish_reason == "tool_calls" and len(one.choices[0].message.tool_calls) == 1
    # Streamed, the same calls arrive piece by piece.
    streamed: dict[int, dict[str, str]] = {}
    for chunk in chat(client, tools=TOOLS, tool_choice="required", max_tokens=48, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = streamed.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
    assert [streamed[i] for i in sorted(streamed)] == expected


# An output format as frameworks send one (openai-agents' output_type, pydantic-ai's NativeOutput): it says
# nothing of other keys.
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
ANSWER_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}


def test_a_forced_call_beside_an_output_format_is_the_call(client: openai.OpenAI) -> None:
    """The format applies to the turn's text; a forced turn is a call, whose arguments are the tool's."""
    named = chat(client, tools=TOOLS, tool_choice=NAMED, response_format=ANSWER_FORMAT).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    required = chat(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, response_format=ANSWER_FORMAT
    ).choices[0]
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    call = required.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_forced_call_beside_an_output_format_on_responses_and_messages(server: RunningServer) -> None:
    client, model = server.openai_client(), server.model.name
    response = client.responses.create(
        model=model,
        input="Oslo?",
        tools=[{"type": "function", "name": "weather", "parameters": WEATHER, "strict": False}],
        tool_choice={"type": "function", "name": "weather"},
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER}},
        temperature=0,
    )
    (item,) = response.output
    assert item.type == "function_call" and item.name == "weather"
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    messages = anthropic.Anthropic(base_url=server.http_base, api_key="unused", max_retries=0)
    fields: Any = {
        "messages": USER,
        "tools": [{"name": "weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "weather"},
        "output_config": {"format": {"type": "json_schema", "schema": ANSWER}},
    }
    message = messages.messages.create(model=model, max_tokens=48, **fields)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "weather"
    jsonschema.validate(use.input, WEATHER)


def call_or_answer(choice: Any) -> str:
    """A choice of `auto` beside ANSWER_FORMAT, checked: one call of a tool with valid arguments, or the
    format's JSON with no other key; which of the two it is."""
    assert choice.finish_reason in ("tool_calls", "stop"), choice
    if choice.message.tool_calls:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return "call"
    jsonschema.validate(json.loads(choice.message.content), {**ANSWER, "additionalProperties": False})
    return "answer"


def test_auto_beside_an_output_format_is_a_call_or_the_formats_json(
    client: openai.OpenAI, server: RunningServer
) -> None:
    """Either is allowed: what the model writes first decides (a +100 bias on a first character makes it).
    The clock's call alone fits the 64 tokens the server allows (the tiny tokenizer spends a token a byte)."""
    fields: dict[str, Any] = {
        "tools": TOOLS[1:],
        "parallel_tool_calls": False,
        "response_format": ANSWER_FORMAT,
        "max_tokens": 64,
    }
    call_or_answer(chat(client, **fields).choices[0])
    (less,) = server.model.tokenizer.encode("<", add_special_tokens=False).ids
    (brace,) = server.model.tokenizer.encode("{", add_special_tokens=False).ids
    assert call_or_answer(chat(client, logit_bias={str(less): 100}, **fields).choices[0]) == "call"
    assert call_or_answer(chat(client, logit_bias={str(brace): 100}, **fields).choices[0]) == "answer"
    streamed = [c.choices[0] for c in chat(client, logit_bias={str(less): 100}, stream=True, **fields)]
    assert [t.function.name for c in streamed for t in c.delta.tool_calls or []] and (
        streamed[-1].finish_reason == "tool_calls"
    )


def rendered_tokens(server: RunningServer, messages: list[Any], tools: list[Any] | None) -> int:
    text = ChatTemplate(COMPACT_TOOLS, {}).render(messages, tools=tools)
    return len(server.model.tokenizer.encode(text, add_special_tokens=False).ids)


def test_auto_gives_the_template_the_tools_and_none_makes_no_call(
    client: openai.OpenAI, server: RunningServer
) -> None:
    without = chat(client, max_tokens=4)
    auto = chat(client, tools=TOOLS, max_tokens=4)
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert without.usage.prompt_tokens == rendered_tokens(server, USER, None)
    assert auto.usage.prompt_tokens == rendered_tokens(server, USER, TOOLS) > without.usage.prompt_tokens
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens
    for reply in (auto, none):  # the random model writes no <tool_call>: plain content
        choice = reply.choices[0]
        assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in chat(client, tools=TOOLS, max_tokens=4, stream=True)
        if c.choices
    )
    assert streamed == auto.choices[0].message.content


def test_auto_reads_tool_call_blocks_out_of_the_output_streamed_or_not(client: openai.OpenAI) -> None:
    # The random model never writes a <tool_call> by itself: a regex makes it write one after some content.
    block = re.escape('ok<tool_call>{"name":"clock","arguments":{}}</tool_call>')
    fields: dict[str, Any] = {"tools": TOOLS, "max_tokens": 64, "extra_body": {"guided_regex": block}}
    unary = chat(client, **fields).choices[0]
    assert unary.finish_reason == "tool_calls" and unary.message.content == "ok"
    (call,) = unary.message.tool_calls
    assert call.function.name == "clock" and json.loads(call.function.arguments) == {}
    chunks = [c.choices[0] for c in chat(client, stream=True, **fields) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "ok"
    calls = [t for c in chunks for t in c.delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [(0, "clock", "{}")]
    assert calls[0].id.startswith("call_") and chunks[-1].finish_reason == "tool_calls"


# Each family's compact template, an output in its format that a regex makes the random model write (after
# some content, where the format has a marker), the content around the call and the call's arguments.
FAMILIES = [
    (COMPACT_MISTRAL, 'ok[TOOL_CALLS][{"name":"clock","arguments":{}}]', "ok", {}),
    (COMPACT_MISTRAL, '[TOOL_CALLS]clock{"zone":"UTC"}', None, {"zone": "UTC"}),
    (COMPACT_LLAMA, '{"name":"clock","parameters":{"zone":"UTC"}}', None, {"zone": "UTC"}),
]


@pytest.mark.parametrize(
    ("template", "output", "content", "arguments"), FAMILIES, ids=["mistral", "mistral-v11", "llama"]
)
def test_auto_reads_the_calls_in_the_templates_own_format(
    loop: LoopThread,
    tiny_bundle: Path,
    tmp_path: Path,
    template: str,
    output: str,
    content: str | None,
    arguments: dict[str, str],
) -> None:
    running = serve_with_template(loop, tiny_bundle, tmp_path, template, engine_process=False)
    try:
        client = running.openai_client()
        guided = {"guided_regex": re.escape(output)}
        fields: dict[str, Any] = {"tools": TOOLS, "max_tokens": 64, "extra_body": guided}
        unary = chat(client, **fields).choices[0]
        assert unary.finish_reason == "tool_calls" and unary.message.content == content
        (call,) = unary.message.tool_calls
        assert call.function.name == "clock" and json.loads(call.function.arguments) == arguments
        chunks = [c.choices[0] for c in chat(client, stream=True, **fields) if c.choices]
        assert ("".join(c.delta.content or "" for c in chunks) or None) == content
        calls = [t for c in chunks for t in c.delta.tool_calls or []]
        assert [(t.function.name, t.function.arguments) for t in calls] == [
            (call.function.name, call.function.arguments)
        ]
        # The Hermes convention is not this template's: a <tool_call> block is content here.
        block = re.escape('<tool_call>{"name":"clock","arguments":{}}</tool_call>')
        hermes = chat(client, tools=TOOLS, max_tokens=64, extra_body={"guided_regex": block}).choices[0]
        assert hermes.finish_reason == "stop" and hermes.message.tool_calls is None
    finally:
        running.stop()


def test_a_history_of_calls_and_tool_results_reaches_the_template(
    client: openai.OpenAI, server: RunningServer
) -> None:
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'},
    }
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": '{"celsius": -3}'},
    ]
    reply = chat(client, messages=history, tools=TOOLS, max_tokens=2)
    as_template_sees_it: list[dict[str, Any]] = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "function": {"name": "weather", "arguments": {"city": "Oslo", "days": 2}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": '{"celsius": -3}'},
    ]
    text = ChatTemplate(COMPACT_TOOLS, {}).render(as_template_sees_it, tools=TOOLS)
    assert '<tool_call>{"city": "Oslo", "days": 2}</tool_call>' in text and 't:{"celsius": -3}' in text
    assert reply.usage.prompt_tokens == rendered_tokens(server, as_template_sees_it, TOOLS)


def test_history_arguments_that_are_not_json_reach_the_template_as_they_are(
    client: openai.OpenAI, server: RunningServer
) -> None:
    # A call cut short at max_tokens, echoed back with the tool's error (as openai-agents does).
    cut = '{"city": "Os'
    call = {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": cut}}
    history: list[dict[str, Any]] = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "error: arguments are not JSON"},
    ]
    reply = chat(client, messages=history, tools=TOOLS, max_tokens=2)
    as_template_sees_it = [*history[:1], {**history[1], "content": ""}, *history[2:]]
    text = ChatTemplate(COMPACT_TOOLS, {}).render(as_template_sees_it, tools=TOOLS)
    assert f"<tool_call>{json.dumps(cut)}</tool_call>" in text  # tojson of the string itself
    assert reply.usage.prompt_tokens == rendered_tokens(server, as_template_sees_it, TOOLS)


def test_by_default_a_request_may_fill_its_context_and_only_one_that_cannot_fit_is_refused(
    loop: LoopThread, tiny_bundle: Path, tmp_path: Path
) -> None:
    # The server's defaults (no --default-max-new-tokens, no --max-new-tokens), as vLLM's.
    running = serve_with_template(
        loop,
        tiny_bundle,
        tmp_path,
        COMPACT_TOOLS,
        engine_process=False,
        max_new_tokens=None,
        default_max_new_tokens=None,
    )
    try:
        client, context = running.openai_client(), running.model.limits.context_length
        endless: Any = {"extra_body": {"ignore_eos": True}}
        full = chat(client, **endless)  # no max_tokens: until the context is full
        assert full.choices[0].finish_reason == "length" and full.usage.total_tokens == context
        room = context - full.usage.prompt_tokens
        assert chat(client, max_tokens=room, **endless).usage.total_tokens == context
        with pytest.raises(openai.BadRequestError) as refused:  # vLLM's one refusal
            chat(client, max_tokens=room + 1, **endless)
        assert (
            f"+ max_tokens ({room + 1}) = {context + 1} exceeds the context length {context}: allowed "
            f"max_tokens 1..{room} for this prompt (or leave it out for the server's default)"
        ) in str(refused.value)
        # Anthropic's clients must send max_tokens and send large ones: it runs until the context is full.
        messages = anthropic.Anthropic(base_url=running.http_base, api_key="unused", max_retries=0)
        model = running.model.name
        message = messages.messages.create(
            model=model, max_tokens=4096, messages=USER, extra_body={"ignore_eos": True}
        )
        assert message.usage.input_tokens + message.usage.output_tokens == context
        assert message.stop_reason == "model_context_window_exceeded"  # Anthropic's, not max_tokens
    finally:
        running.stop()


CHAT = "/v1/chat/completions"
ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"tool_choice": "auto"}, "tool_choice needs tools"),
    ({"tool_choice": NAMED}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not define"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "function names must be unique; repeated: weather"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required",
        },
        "tools (with tool_choice required) is not valid",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tools[0].function.parameters is not valid",
    ),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nope"}},
            }
        },
        "response_format.json_schema.schema is not valid",  # a refusal names the field it came from
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id is required"),
    (
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
        "only an assistant message makes calls",
    ),
]


@pytest.mark.parametrize(("fields", "message"), ERRORS, ids=[e[1][:40] for e in ERRORS])
def test_bad_tools_are_400_in_openais_shape(
    server: RunningServer, fields: dict[str, Any], message: str
) -> None:
    for stream in (False, True):
        body = {"messages": USER, "max_tokens": 4, "stream": stream, **fields}
        response = httpx.post(f"{server.http_base}{CHAT}", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["type"] == "invalid_request_error"


def test_constrained_requests_and_their_masks_are_counted(
    client: openai.OpenAI, server: RunningServer
) -> None:
    sample = server.metric
    before = {
        kind: sample("textgen_constrained_requests_total", kind=kind) for kind in ("tool", "json_object")
    }
    masks = sample("textgen_constraint_masks_total")
    reply = chat(client, tools=TOOLS, tool_choice=NAMED)
    chat(client, response_format={"type": "json_object"}, max_tokens=8)
    assert sample("textgen_constrained_requests_total", kind="tool") == before["tool"] + 1
    assert sample("textgen_constrained_requests_total", kind="json_object") == before["json_object"] + 1
    # A step's metric calls are recorded before its outcomes are delivered (the engine process sends them in
    # the same message, replayed first): the reply's steps are counted by now.
    assert sample("textgen_constraint_masks_total") >= masks + reply.usage.completion_tokens
    assert sample("textgen_constraint_mask_seconds_total") > 0
    assert sample("textgen_constraint_compile_seconds_count") >= 1

"""serve/api/tool_formats.py on texts: which format each family's template declares, each format's calls read
out of whole outputs, and the same output fed a character at a time giving the same calls and content."""

from __future__ import annotations

import json
from typing import Any

import pytest
from chat_templates import (
    COMPACT_LLAMA,
    COMPACT_MISTRAL,
    COMPACT_TOOLS,
    HERMES_TOOLS,
    LLAMA_TOOLS,
    MISTRAL_TOOLS,
)

from export.demo import DEMO_CHAT_TEMPLATE
from serve.api.tool_formats import (
    DEFAULT_FORMAT,
    HERMES,
    LLAMA_JSON,
    MISTRAL,
    AutoStream,
    ToolCallFormat,
    parse_auto,
    tool_format,
)

NAMES = ("weather", "time")
# Qwen3's instruction, as its template writes it.
QWEN3 = (
    "{%- if tools %}For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>{% endif %}'
)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (HERMES_TOOLS, HERMES),
        (QWEN3, HERMES),
        (COMPACT_TOOLS, HERMES),
        (MISTRAL_TOOLS, MISTRAL),
        (COMPACT_MISTRAL, MISTRAL),
        (LLAMA_TOOLS, LLAMA_JSON),
        (COMPACT_LLAMA, LLAMA_JSON),
        (DEMO_CHAT_TEMPLATE, DEFAULT_FORMAT),  # declares no format: textgen's convention
        (None, DEFAULT_FORMAT),
    ],
)
def test_the_template_declares_its_format(template: str | None, expected: ToolCallFormat) -> None:
    assert tool_format(template) is expected
    assert DEFAULT_FORMAT is HERMES


Call = tuple[str, dict[str, Any]]
WEATHER_OSLO: Call = ("weather", {"city": "Oslo"})
TIME: Call = ("time", {})
BOTH = [TIME, WEATHER_OSLO]

# (format, output, content, calls): each format's forms, and outputs that stay content.
OUTPUTS: list[tuple[ToolCallFormat, str, str | None, list[Call]]] = [
    (
        HERMES,
        'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "Sure.",
        [WEATHER_OSLO],
    ),
    (
        HERMES,
        '<tool_call>{"name": "time", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>',
        "and",
        BOTH,
    ),
    (HERMES, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', None, []),
    (HERMES, "<tool_call>{oops</tool_call> plain < text", None, []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]', None, [WEATHER_OSLO]),
    (
        MISTRAL,
        'Checking. [TOOL_CALLS][{"name": "time", "arguments": {}}, '
        '{"name": "weather", "arguments": {"city": "Oslo"}}]',
        "Checking.",
        BOTH,
    ),
    (MISTRAL, '[TOOL_CALLS]time{}[TOOL_CALLS]weather{"city": "Oslo"}', None, BOTH),  # v11
    (MISTRAL, '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', None, [WEATHER_OSLO]),
    (
        MISTRAL,
        ' [{"name": "weather", "arguments": {"city": "Oslo"}}]',
        None,
        [WEATHER_OSLO],
    ),  # marker dropped
    (MISTRAL, "[1] is a citation, [TOOL_C", None, []),
    (MISTRAL, "Said: [TOOL_CALLS]weather is fine", None, []),
    (MISTRAL, '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]', None, []),
    (LLAMA_JSON, '{"name": "weather", "parameters": {"city": "Oslo"}}', None, [WEATHER_OSLO]),
    (
        LLAMA_JSON,
        '<|python_tag|>{"name": "time", "arguments": {}}; '
        '{"name": "weather", "parameters": {"city": "Oslo"}}',
        None,
        BOTH,
    ),
    (LLAMA_JSON, '\n {"name": "time", "parameters": {}}', None, [TIME]),
    (LLAMA_JSON, '{"answer": 42}', None, []),  # JSON, but no call: content
    (LLAMA_JSON, 'Here: {"name": "time", "parameters": {}}', None, []),  # calls only at the start
    (LLAMA_JSON, '{"name": "time", "parameters": {}} and more', None, []),
]


@pytest.mark.parametrize(("form", "text", "content", "calls"), OUTPUTS)
def test_each_format_reads_its_calls(
    form: ToolCallFormat, text: str, content: str | None, calls: list[Call]
) -> None:
    got_content, got_calls = parse_auto(text, NAMES, form)
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert got_content == (content if calls else text)  # no calls: the whole output is content
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("form", "text", "content", "calls"), OUTPUTS)
def test_fed_a_character_at_a_time_the_output_reads_as_the_whole(
    form: ToolCallFormat, text: str, content: str | None, calls: list[Call]
) -> None:
    stream = AutoStream(NAMES, form)
    sent = "".join(stream.feed(char) for char in text)
    rest, got_calls = stream.finish()
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    if calls:  # the content went out, or comes at the end; nothing of the calls went out
        assert (sent + (rest or "")).strip() == (content or "") and '"name"' not in sent
    else:
        assert sent + (rest or "") == text
    whole = AutoStream(NAMES, form)
    assert whole.feed(text) + (whole.finish()[0] or "") == sent + (rest or "")


def test_content_streams_at_once_until_the_calls_may_begin() -> None:
    hermes = AutoStream(NAMES, HERMES)
    assert hermes.feed("Sure <tool") == "Sure " and hermes.feed("s are") == "<tools are"
    llama = AutoStream(NAMES, LLAMA_JSON)
    assert llama.feed("  ") == "" and llama.feed("Hi {") == "  Hi {"  # decided at its first characters
    assert llama.feed('"name": "time"}') == '"name": "time"}'
    waiting = AutoStream(NAMES, LLAMA_JSON)
    assert waiting.feed("<|python") == "" and waiting.feed("_tag|>") == ""
    mistral = AutoStream(NAMES, MISTRAL)
    assert mistral.feed("ok [TOOL") == "ok " and mistral.feed("_CALLS]") == ""

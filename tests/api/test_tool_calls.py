"""serve/api/tool_calls.py without a server: the tool plan's checks and constraints, textgen's <tool_call>
convention, and reading a `required` array piece by piece as a stream does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from scheduler_fakes import letter_tokenizer

from serve.api.http.constraints import tool_or_format
from serve.api.tool_calls import (
    NamedToolChoice,
    Reply,
    RequiredStream,
    Tool,
    ToolChoice,
    required_schema,
    tool_plan,
)
from serve.api.tool_formats import HERMES, LLAMA_JSON, MISTRAL, AutoStream, ToolCallFormat, parse_auto
from serve.engine.constraints import ConstraintCompiler
from serve.engine.types import Constraint, ConstraintKind
from serve.errors import InvalidRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def tool(name: str, parameters: dict[str, Any] | None = None) -> Tool:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return Tool.model_validate({"type": "function", "function": function})


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


TOOLS = [tool("weather", WEATHER), tool("time")]


def test_the_plan_follows_tool_choice() -> None:
    assert tool_plan(None, None, None).mode == "none" and tool_plan(TOOLS, None, None).mode == "auto"
    assert tool_plan(TOOLS, "none", None).constraint() is None
    forced = tool_plan(TOOLS, named("weather"), None).constraint()
    assert forced is not None and forced.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(forced.text) == WEATHER and forced.source == "tools[0].function.parameters"
    no_parameters = tool_plan(TOOLS, named("time"), None).constraint()
    assert no_parameters is not None and json.loads(no_parameters.text) == {"type": "object"}
    sent = {"type": "function", "function": {"name": "f", "description": None, "x-extra": [1]}}
    assert tool_plan([Tool.model_validate(sent)], "auto", None).template_tools == [sent]  # as sent


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        (None, "auto", "tool_choice needs tools"),
        (None, named("weather"), "tool_choice needs tools"),
        (TOOLS, named("nope"), "does not define"),
        ([tool("a"), tool("a"), tool("b")], "auto", "repeated: a"),
        ([tool(f"f{i}") for i in range(129)], "auto", "129 tools given; at most 128"),
    ],
)
def test_inconsistent_tools_are_refused(tools: list[Tool] | None, choice: ToolChoice, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        tool_plan(tools, choice, None)


def test_the_required_schema_takes_one_branch_per_tool_and_lifts_defs() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    with_defs = tool(
        "draw", {"type": "object", "properties": {"at": {"$ref": "#/$defs/point"}}, "$defs": {"point": point}}
    )
    schema = required_schema([with_defs, TOOLS[0]], parallel=True)
    assert schema["$defs"] == {"point": point} and "maxItems" not in schema
    valid = [
        {"name": "draw", "parameters": {"at": {"x": 1}}},
        {"name": "weather", "parameters": {"city": "Oslo"}},
    ]
    jsonschema.validate(valid, schema)
    for bad in (
        [],
        [{"name": "draw", "parameters": {"at": {"x": "one"}}}],
        [{"name": "weather", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    clash = tool("other", {"type": "object", "$defs": {"point": {"type": "string"}}})
    with pytest.raises(InvalidRequest, match="differs from another tool's"):
        required_schema([with_defs, clash], parallel=True)
    with pytest.raises(InvalidRequest, match=r"\$defs must be an object"):
        required_schema([tool("listed", {"$defs": [1]})], parallel=True)


NAMES = ("weather", "time")


def test_the_tool_call_convention() -> None:
    text = 'Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
    content, calls = parse_auto(text, NAMES)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"})
    ]
    rome = json.dumps({"name": "weather", "arguments": json.dumps({"city": "Rome"})})
    two = f'<tool_call>{{"name": "time", "arguments": {{}}}}</tool_call><tool_call>{rome}</tool_call>'
    content, calls = parse_auto(two, NAMES)
    assert content is None and [c.name for c in calls] == ["time", "weather"]
    assert json.loads(calls[1].arguments) == {"city": "Rome"} and calls[0].id != calls[1].id
    for plain in (
        "no calls here",
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        "<tool_call>{oops</tool_call>",
    ):
        assert parse_auto(plain, NAMES) == (plain, [])


@pytest.mark.parametrize(
    "text",
    [
        "plain text, with a < and <tool in it",
        'Sure. <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call> done',
        "<tool_c",
    ],
)
def test_auto_streamed_in_pieces_reads_as_the_whole(text: str) -> None:
    stream = AutoStream(NAMES)
    sent = "".join(stream.feed(char) for char in text)
    rest, calls = stream.finish()
    _, whole_calls = parse_auto(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert "<tool_call>" not in sent and (calls or sent + (rest or "") == text)
    plan = tool_plan(TOOLS, "auto", None)
    streamed, whole = Reply(plan), Reply(plan)
    for char in text:
        streamed.feed(char)
    whole.feed(text)
    reasons = streamed.finish("stop")[1], whole.finish("stop")[1]
    assert reasons == (("tool_calls",) * 2 if calls else ("stop",) * 2)
    one, other = streamed.message(), whole.message()
    assert one["content"] == other["content"]
    assert [c["function"] for c in one.get("tool_calls", [])] == [
        c["function"] for c in other.get("tool_calls", [])
    ]


def test_auto_reads_the_output_in_the_plans_format() -> None:
    text = '{"name": "time", "parameters": {}}'
    llama, hermes = Reply(tool_plan(TOOLS, "auto", None, LLAMA_JSON)), Reply(tool_plan(TOOLS, "auto", None))
    assert llama.feed(text) == {} and hermes.feed(text) == {"content": text}
    assert llama.finish("stop")[1] == "tool_calls" and hermes.finish("stop")[1] == "stop"
    assert llama.message()["tool_calls"][0]["function"] == {"name": "time", "arguments": "{}"}


REQUIRED_OUTPUTS = [
    '[{"name":"weather","parameters":{"city":"a}\\"]{"}}]',
    '[{"name":"time","parameters":{}},{"name":"weather","parameters":{"city":"Oslo","n":[1,{"x":2}]}}]',
    '[{"name":"time","parameters":7}]',
]


@pytest.mark.parametrize("text", REQUIRED_OUTPUTS)
def test_required_output_streamed_or_whole_gives_the_same_calls(text: str) -> None:
    expected = [(e["name"], e["parameters"]) for e in json.loads(text)]
    whole = RequiredStream()
    assert whole.feed(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.finish()] == expected
    streamed = RequiredStream()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for char in text:
        for delta in streamed.feed(char):
            if delta.name is not None:
                names[delta.index] = delta.name
            arguments[delta.index] = arguments.get(delta.index, "") + delta.arguments
    assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == expected
    assert [c.arguments for c in streamed.finish()] == [c.arguments for c in whole.calls]


def test_a_reply_cut_short_keeps_what_came_and_says_length() -> None:
    reply = Reply(tool_plan(TOOLS, "required", None))
    reply.feed('[{"name":"weather","parameters":{"ci')
    _, reason = reply.finish("length")
    message = reply.message()
    assert reason == "length" and message["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"ci',
    }
    done = Reply(tool_plan(TOOLS, named("weather"), None))
    first = done.feed('{"city":')
    assert first["tool_calls"][0]["function"] == {"name": "weather", "arguments": '{"city":'}
    assert done.feed('"x"}') == {"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}
    assert done.finish("stop")[1] == "tool_calls" and done.message()["content"] is None
    plain = Reply(tool_plan(TOOLS, "none", None))
    assert plain.feed("<tool_call>") == {"content": "<tool_call>"} and plain.finish("stop")[1] == "stop"
    assert plain.message() == {"role": "assistant", "content": "<tool_call>"}


# --- auto beside an output format: calls in the template's format, or the format's JSON ---------------------

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}
CALL = '{"name":"clock","arguments":{"zone":"UTC"}}'  # compact, as the constraint writes JSON
LLAMA_CALL = '{"name":"clock","parameters":{"zone":"UTC"}}'
# Each format, one call as it writes it, and two.
CALLS = {
    HERMES: (
        f"<tool_call>\n{CALL}\n</tool_call>",
        f"<tool_call>{CALL}</tool_call>" * 2,
    ),
    MISTRAL: (f"[TOOL_CALLS][{CALL}]", f"[{CALL},{CALL}]"),
    LLAMA_JSON: (LLAMA_CALL, f"{LLAMA_CALL};{LLAMA_CALL}"),
}


@pytest.fixture(scope="module")
def compiler() -> Iterator[ConstraintCompiler]:
    tokenizer = letter_tokenizer()
    compiler = ConstraintCompiler(tokenizer, tokenizer.get_vocab_size(), [0])
    yield compiler
    compiler.shutdown()


def matches(compiler: ConstraintCompiler, constraint: Constraint, text: str) -> bool:
    matcher = compiler.compile(constraint).matcher()
    ids = compiler.tokenizer.tokenize_str(text)
    return all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()


@pytest.mark.parametrize("form", list(CALLS), ids=lambda form: form.name)
@pytest.mark.parametrize("parallel", [True, False])
def test_auto_beside_a_format_allows_the_templates_calls_or_the_formats_json(
    compiler: ConstraintCompiler, form: ToolCallFormat, parallel: bool
) -> None:
    plan = tool_plan([tool("weather", WEATHER), tool("clock", CLOCK)], "auto", parallel, form)
    constraint = tool_or_format(plan, Constraint.json_schema(ANSWER))
    assert constraint is not None and constraint.kind == ConstraintKind.GRAMMAR
    one, two = CALLS[form]
    assert matches(compiler, constraint, '{"answer":"yes"}')
    assert not matches(compiler, constraint, '{"answer":"yes","more":1}')  # closed, as a schema alone is
    assert not matches(compiler, constraint, "plain text")
    assert matches(compiler, constraint, one) and matches(compiler, constraint, two) == parallel
    # What the grammar allows is what the format's reader reads as calls.
    for text in (one, two) if parallel else (one,):
        content, calls = parse_auto(text, plan.names, form)
        assert content is None and calls and all(json.loads(c.arguments) == {"zone": "UTC"} for c in calls)
    any_object = tool_or_format(plan, Constraint.json_object())  # json_object: any object, or calls
    assert any_object is not None and matches(compiler, any_object, '{"x":[1]}')
    assert matches(compiler, any_object, one)


def test_a_forced_call_beside_a_format_is_the_call_and_none_keeps_the_format() -> None:
    answer = Constraint.json_schema(ANSWER)
    for choice in (named("weather"), "required"):
        plan = tool_plan(TOOLS, choice, None)
        assert tool_or_format(plan, answer) == plan.constraint()
    assert tool_or_format(tool_plan(TOOLS, "none", None), answer) == answer
    regex = Constraint.regex("a+")  # vLLM's other fields constrain the whole output, tools or not
    assert tool_or_format(tool_plan(TOOLS, "auto", None), regex) == regex

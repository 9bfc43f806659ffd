"""POST /v1/responses with the openai SDK's `client.responses.create`, streamed and not, against the tiny
bundle whose chat template declares tools: the same tokens as the chat completion it translates to,
function tools and their outputs, text.format json_schema, usage, and refusals in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from chat_templates import COMPACT_TOOLS
from running_server import RunningServer
from server_tools import LoopThread
from test_http_tools import WEATHER, serve_with_template

TOOL: Any = {"type": "function", "name": "weather", "description": "A forecast", "parameters": WEATHER}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER},
}
INSTRUCTIONS = "You answer briefly."


@pytest.fixture(scope="module")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The tools template's server, its engine in this process (the tool tests run it in its own)."""
    where = tmp_path_factory.mktemp("responses")
    running = serve_with_template(loop, tiny_bundle, where, COMPACT_TOOLS, engine_process=False)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def chat_reply(client: openai.OpenAI, model: str, **fields: Any) -> Any:
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Oslo?"}]
    return client.chat.completions.create(
        model=model, messages=fields.pop("messages", messages), temperature=0, **fields
    )


def test_a_response_is_the_chat_completion_it_translates_to(client: openai.OpenAI, model: str) -> None:
    expected = chat_reply(client, model, max_tokens=12)
    response = client.responses.create(
        model=model, input="Oslo?", instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text == expected.choices[0].message.content
    assert response.usage is not None
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == 12 == expected.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + 12

    as_items = client.responses.create(
        model=model,
        input=[
            {"role": "developer", "content": INSTRUCTIONS},
            {"role": "user", "content": [{"type": "input_text", "text": "Oslo?"}]},
        ],
        max_output_tokens=12,
        temperature=0,
    )
    assert as_items.output_text == response.output_text  # developer is the system role


def test_a_streamed_response_has_the_events_and_the_text_of_the_unary_one(
    client: openai.OpenAI, model: str
) -> None:
    unary = client.responses.create(
        model=model, input="Oslo?", instructions=INSTRUCTIONS, max_output_tokens=10, temperature=0
    )
    events = list(
        client.responses.create(
            model=model,
            input="Oslo?",
            instructions=INSTRUCTIONS,
            max_output_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # max_output_tokens reached
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == unary.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == deltas
    final = events[-1].response
    assert final.output_text == deltas and final.usage is not None and final.usage.output_tokens == 10
    assert final.id == events[0].response.id


def test_function_tools_calls_and_their_outputs(client: openai.OpenAI, model: str) -> None:
    named: Any = {"type": "function", "name": "weather"}
    response = client.responses.create(
        model=model, input="Oslo?", tools=[TOOL], tool_choice=named, temperature=0
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    expected = chat_reply(
        client,
        model,
        messages=[{"role": "user", "content": "Oslo?"}],
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "weather"}},
    )
    assert json.loads(call.arguments) == json.loads(
        expected.choices[0].message.tool_calls[0].function.arguments
    )

    streamed = list(
        client.responses.create(
            model=model, input="Oslo?", tools=[TOOL], tool_choice=named, temperature=0, stream=True
        )
    )
    (args,) = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert args.arguments == call.arguments
    assert streamed[-1].type == "response.completed"

    follow_up = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Oslo?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": "weather",
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
        ],
        tools=[TOOL],
        tool_choice="none",
        max_output_tokens=6,
        temperature=0,
    )
    assert follow_up.output[0].type == "message" and follow_up.usage is not None
    assert follow_up.usage.input_tokens > response.usage.input_tokens  # type: ignore[union-attr]


def test_text_format_json_schema_constrains_the_output(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=64,
        temperature=0,
    )
    spec = {"name": "answer", "schema": schema}
    expected = chat_reply(
        client,
        model,
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": spec},
    )
    assert response.output_text == expected.choices[0].message.content
    if response.status == "completed":  # else cut short by max_output_tokens: a prefix of a match
        jsonschema.validate(json.loads(response.output_text), schema)
    else:
        assert response.output_text.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, 400, "stores no responses"),
        ({"input": "x", "store": True}, 400, "stores no responses"),
        ({"input": [{"type": "image", "role": "user"}]}, 400, "input[0]: expected a message"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "only function tools"),
        ({"input": "x", "model": "gpt-5"}, 404, "the model 'gpt-5' does not exist"),
        ({"input": "x", "temperature": 9}, 400, "temperature"),
        ({}, 400, "input: Field required"),
        ({"input": [], "instructions": "Be brief."}, 400, "input is empty: give a string or at least one"),
    ],
)
def test_refusals_in_openais_shape(server: RunningServer, body: Any, status: int, message: str) -> None:
    reply = httpx.post(f"{server.http_base}/v1/responses", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_responses_are_counted_under_their_route(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    before = server.metric("textgen_requests_total", rpc="/v1/responses", code="OK")
    client.responses.create(model=model, input="x", max_output_tokens=2)
    assert server.metric("textgen_requests_total", rpc="/v1/responses", code="OK") == before + 1

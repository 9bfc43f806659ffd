"""POST /v1/responses with the openai SDK's `client.responses.create` and `client.responses.stream`, against
the tiny bundle whose chat template declares tools: the same tokens as the chat completion it translates
to, function tools and their outputs (the arguments streamed piece by piece), text.format json_schema,
usage, why a response is incomplete, the stream's events (response.created before the first token, and
response.failed when the engine fails), and refusals in OpenAI's shape naming the Responses fields.

The server decodes one request at a time, slowly for ids "slow-...", and fails the requests whose ids begin
"doomed" (a decode step) or "fails-to-join" (the prefill) (tests/support/engine_faults.py)."""

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
from engine_faults import InjectedFaults
from running_server import RunningServer
from server_tools import LoopThread
from test_http_tools import WEATHER, serve_with_template

TOOL: Any = {"type": "function", "name": "weather", "description": "A forecast", "parameters": WEATHER}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER},
}
INSTRUCTIONS = "You answer briefly."
CALL: Any = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"}
NAMED: Any = {"type": "function", "name": "weather"}


@pytest.fixture(scope="module")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """The tools template's server, its engine in this process (the tool tests run it in its own)."""
    where = tmp_path_factory.mktemp("responses")
    running = serve_with_template(
        loop,
        tiny_bundle,
        where,
        COMPACT_TOOLS,
        engine_process=False,
        engine_wrap=InjectedFaults(),
        max_batch_size=1,
    )
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
    response = client.responses.create(
        model=model, input="Oslo?", tools=[TOOL], tool_choice=NAMED, temperature=0
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
            model=model, input="Oslo?", tools=[TOOL], tool_choice=NAMED, temperature=0, stream=True
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


def test_function_call_arguments_that_are_not_json_are_served_as_chat_serves_them(
    client: openai.OpenAI, model: str
) -> None:
    cut = '{"city": "Os'  # a call cut short at max_output_tokens, echoed back with the tool's error
    result = "error: the arguments are not JSON"
    response = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Oslo?"},
            CALL | {"arguments": cut},
            {"type": "function_call_output", "call_id": CALL["call_id"], "output": result},
        ],
        max_output_tokens=2,
        temperature=0,
    )
    call = {"id": CALL["call_id"], "type": "function", "function": {"name": "weather", "arguments": cut}}
    expected = chat_reply(
        client,
        model,
        messages=[
            {"role": "user", "content": "Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": CALL["call_id"], "content": result},
        ],
        max_tokens=2,
    )
    assert response.usage is not None and response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == expected.choices[0].message.content


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
        ({"input": [], "instructions": "Be brief."}, 400, "input is empty: give a string, or at least one"),
        ({"input": []}, 400, "input is empty"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens = 0 generates nothing"),
        ({"input": "x", "max_output_tokens": 500}, 400, "+ max_output_tokens (500) = "),
        (
            {"input": [{"role": "user", "content": "x"}, CALL | {"name": 5}]},
            400,
            "input.1.name: Input should",
        ),
        (
            {"input": [{"type": "function_call_output", "output": "x"}]},
            400,
            "input.0.call_id: Field required",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            400,
            "input[0].content[0] is not",
        ),
        ({"input": "x", "tools": [TOOL | {"name": "no spaces"}]}, 400, "tools.0.name: String should match"),
        ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "file_search"}}, 400, "tool_choice must be"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, 400, "text.format needs a schema"),
        ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata has 17 keys"),
        ({"input": "x", "metadata": {"k" * 65: "v"}}, 400, "longer than 64 characters"),
        ({"input": "x", "metadata": {"k": "v" * 513}}, 400, "metadata['k'] is longer than 512"),
        ({"input": "x", "metadata": {"k": 1}}, 400, "metadata.k: Input should be a valid string"),
        ({"input": "x", "include": ["file_search_call.results"]}, 400, "include: 'file_search_call.results'"),
        ({"input": "x", "top_logprobs": 2}, 400, "top_logprobs needs include"),
        ({"input": "x", "top_logprobs": 21}, 400, "top_logprobs"),
        (
            {"input": "x", "tools": [TOOL], "include": ["message.output_text.logprobs"]},
            400,
            "served without tools",
        ),
        ({"input": "x", "reasoning": {"effort": "low"}}, 400, "this model does not reason"),
        ({"input": "x", "reasoning": {"summary": "auto"}}, 400, "this model does not reason"),
    ],
)
def test_refusals_in_openais_shape(server: RunningServer, body: Any, status: int, message: str) -> None:
    reply = httpx.post(f"{server.http_base}/v1/responses", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert "messages" not in error["message"] and "max_tokens" not in error["message"]


def test_a_response_echoes_the_sampling_it_used_and_its_metadata(client: openai.OpenAI, model: str) -> None:
    defaults = client.responses.create(model=model, input="x", max_output_tokens=2)
    assert (defaults.temperature, defaults.top_p, defaults.metadata) == (1.0, 1.0, {})
    metadata = {"user": "u-1", "k" * 64: "v" * 512}
    fields: Any = {"temperature": 0.5, "top_p": 0.75, "metadata": metadata, "reasoning": {"effort": "none"}}
    given = client.responses.create(model=model, input="x", max_output_tokens=2, **fields)
    assert (given.temperature, given.top_p, given.metadata) == (0.5, 0.75, metadata)
    *_, last = client.responses.create(model=model, input="x", max_output_tokens=2, stream=True, **fields)
    final = last.response  # response.incomplete's (max_output_tokens reached)
    assert (final.temperature, final.top_p, final.metadata) == (0.5, 0.75, metadata)


def test_the_output_texts_logprobs_when_include_asks(client: openai.OpenAI, model: str) -> None:
    include: Any = ["message.output_text.logprobs"]
    fields: Any = {"model": model, "input": "Oslo?", "max_output_tokens": 4, "temperature": 0}
    plain = client.responses.create(**fields)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    response = client.responses.create(**fields, include=include, top_logprobs=3)
    (part,) = response.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert "".join(entry.token for entry in part.logprobs) == response.output_text == plain.output_text
    assert all(len(entry.top_logprobs) == 3 for entry in part.logprobs)
    events = list(client.responses.create(**fields, include=include, top_logprobs=3, stream=True))
    streamed = [e for e in events if e.type == "response.output_text.delta" for e in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]


def test_responses_have_ids_of_their_own(client: openai.OpenAI, model: str) -> None:
    """Not the client's X-Request-Id (two clients may send the same one), which names the request."""
    headers = {"X-Request-Id": "same-id"}
    replies = [
        client.responses.with_raw_response.create(
            model=model, input="x", max_output_tokens=2, extra_headers=headers
        )
        for _ in range(2)
    ]
    assert all(reply.headers["X-Request-Id"] == "same-id" for reply in replies)
    ids = [reply.parse().id for reply in replies]
    assert ids[0] != ids[1] and all(i.startswith("resp_") and "same-id" not in i for i in ids)


def test_responses_are_counted_under_their_route(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    before = server.metric("textgen_requests_total", rpc="/v1/responses", code="OK")
    client.responses.create(model=model, input="x", max_output_tokens=2)
    assert server.metric("textgen_requests_total", rpc="/v1/responses", code="OK") == before + 1


def test_text_parts_are_joined_as_the_chat_route_joins_them(client: openai.OpenAI, model: str) -> None:
    parts = ["Oslo?", "Rome?"]
    response = client.responses.create(
        model=model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": t} for t in parts]}],
        max_output_tokens=8,
        temperature=0,
    )
    expected = chat_reply(
        client,
        model,
        messages=[{"role": "user", "content": [{"type": "text", "text": t} for t in parts]}],
        max_tokens=8,
    )
    assert response.usage is not None and response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.output_text == expected.choices[0].message.content


def test_an_incomplete_response_has_an_incomplete_message(client: openai.OpenAI, model: str) -> None:
    fields: Any = {
        "model": model,
        "input": "Oslo?",
        "max_output_tokens": 3,
        "extra_body": {"ignore_eos": True},
    }
    unary = client.responses.create(**fields)
    assert unary.status == "incomplete" and unary.incomplete_details is not None
    assert unary.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in unary.output] == ["incomplete"]
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    (done,) = [e for e in events if e.type == "response.output_item.done"]
    assert done.item.status == "incomplete" and events[-1].type == "response.incomplete"
    assert [item.status for item in events[-1].response.output] == ["incomplete"]


def test_the_full_context_is_its_own_incomplete_reason(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    limit = server.model.limits.context_length
    room = server.model.limits.default_max_new_tokens - 8  # the default output would not fit after it
    text = input_of_length(server, limit - room)
    full = client.responses.create(model=model, input=text, extra_body={"ignore_eos": True})
    assert full.status == "incomplete" and full.incomplete_details is not None
    assert full.incomplete_details.reason == "context_length"
    assert full.usage is not None and full.usage.total_tokens == limit
    cut = client.responses.create(
        model=model, input=text, max_output_tokens=2, extra_body={"ignore_eos": True}
    )
    assert cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"


def input_of_length(server: RunningServer, tokens: int) -> str:
    """A user message whose chat prompt has at least `tokens` tokens, and fewer than the context holds."""

    def count(words: int) -> int:
        messages = [{"role": "user", "content": "Oslo? " * words}]
        reply = httpx.post(f"{server.http_base}/tokenize", json={"messages": messages})
        return int(reply.json()["count"])

    low, high = 1, 1
    while count(high) < tokens:
        low, high = high, high * 2
    while low < high:  # the fewest words that reach `tokens`
        middle = (low + high) // 2
        low, high = (middle + 1, high) if count(middle) < tokens else (low, middle)
    assert count(low) < server.model.limits.context_length, "the prompt must leave room to generate"
    return "Oslo? " * low


def test_function_call_arguments_stream_piece_by_piece(client: openai.OpenAI, model: str) -> None:
    unary = client.responses.create(
        model=model, input="Oslo?", tools=[TOOL], tool_choice=NAMED, temperature=0
    )
    with client.responses.stream(
        model=model,
        input="Oslo?",
        tools=[TOOL],
        tool_choice=NAMED,
        temperature=0,
        extra_headers={"X-Request-Id": "slow-arguments"},  # a token per event
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "function_call" and events[added].item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    assert kinds.index("response.function_call_arguments.delta") > added
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == done.arguments
    assert call.arguments == unary.output[0].arguments  # type: ignore[union-attr]


def test_response_created_goes_out_before_the_first_token(
    client: openai.OpenAI, model: str, server: RunningServer
) -> None:
    holder = client.responses.create(
        model=model,
        input="Oslo?",
        max_output_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "slow-holder"},
    )
    server.wait_for(lambda s: s.running == 1)  # the server's one row, decoding slowly
    with client.responses.stream(model=model, input="Oslo?", max_output_tokens=4, temperature=0) as stream:
        first = next(iter(stream))
        assert first.type == "response.created" and first.response.status == "in_progress"
        server.wait_for(lambda s: s.waiting == 1)  # the request is queued still: it has no token yet
        holder.close()  # frees the row
        last = list(stream)[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.usage is not None and last.response.usage.output_tokens > 0


@pytest.mark.parametrize("request_id", ["doomed-in-decode", "fails-to-join-in-prefill"])
def test_a_failed_stream_ends_with_response_failed(
    client: openai.OpenAI, model: str, server: RunningServer, request_id: str
) -> None:
    fields: Any = {"model": model, "input": "Oslo?", "max_output_tokens": 8, "temperature": 0}
    expected = f"request {request_id}: the engine failed.*injected ONNX Runtime failure"
    with (
        pytest.raises(openai.APIError, match=expected) as raised,
        client.responses.stream(**fields, extra_headers={"X-Request-Id": request_id}) as stream,
    ):
        stream.get_final_response()
    assert raised.value.body["type"] == "server_error"  # type: ignore[index]

    reply = httpx.post(
        f"{server.http_base}/v1/responses",
        json={**fields, "stream": True},
        headers={"X-Request-Id": f"{request_id}-raw"},
    )
    events = [
        json.loads(line[len("data: ") :]) for line in reply.text.splitlines() if line.startswith("data: ")
    ]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert f"{request_id}-raw" in failed["response"]["error"]["message"]
    assert all(item["status"] == "incomplete" for item in failed["response"]["output"])
    assert server.wait_idle(5.0).running == 0

"""POST /v1/messages and /v1/messages/count_tokens with Anthropic's SDK (`anthropic.Anthropic`), against the
tiny bundle whose chat template declares tools, behind an auth token: the same tokens as the chat completion
it translates to, the stream's events and its final message, a tool use round trip, output_config's JSON
schema, stop sequences, the prompt's count, and errors in Anthropic's shape (x-api-key and a bearer token
both carry the token).

The server decodes one request at a time, and fails the requests whose ids begin "doomed" (a decode step)
(tests/support/engine_faults.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest
from chat_templates import COMPACT_TOOLS
from engine_faults import InjectedFaults
from running_server import RunningServer
from server_tools import LoopThread
from test_http_tools import WEATHER, serve_with_template

from serve.api.anthropic.messages import MessagesRenderer

TOKEN = "s3cret"
SYSTEM = "You answer briefly."
TOOL: Any = {"name": "weather", "description": "A forecast", "input_schema": WEATHER}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {"name": "weather", "description": "A forecast", "parameters": WEATHER},
}
OSLO: Any = [{"role": "user", "content": "Oslo?"}]
GREEDY: Any = {"temperature": 0}  # the SDK has no sampling parameters: sent as the body's extra fields
ANSWER: Any = {
    "type": "object",
    "properties": {"answer": {"type": "boolean"}},
    "required": ["answer"],
    "additionalProperties": False,
}


class Answer(pydantic.BaseModel):
    answer: bool


@pytest.fixture(scope="module")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = serve_with_template(
        loop,
        tiny_bundle,
        tmp_path_factory.mktemp("messages"),
        COMPACT_TOOLS,
        engine_process=False,
        engine_wrap=InjectedFaults(),
        max_batch_size=1,
        auth_token=TOKEN,
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    """Anthropic's SDK (no retries: a test sees each response); it sends its key as a bearer token."""
    return anthropic.Anthropic(base_url=server.http_base, api_key=TOKEN, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def chat(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_base}/v1", api_key=TOKEN, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def model(chat: openai.OpenAI) -> str:
    return chat.models.list().data[0].id


def test_a_message_is_the_chat_completion_it_translates_to(
    client: anthropic.Anthropic, chat: openai.OpenAI, model: str
) -> None:
    messages: Any = [{"role": "system", "content": SYSTEM}, *OSLO]
    expected = chat.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    message = client.messages.create(
        model=model, system=SYSTEM, messages=OSLO, max_tokens=12, extra_body=GREEDY, metadata={"user_id": "u"}
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == model
    (block,) = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert expected.usage is not None
    usage = message.usage
    assert (usage.input_tokens or 0) + (usage.cache_read_input_tokens or 0) == expected.usage.prompt_tokens
    assert usage.output_tokens == 12 == expected.usage.completion_tokens

    as_blocks = client.messages.create(
        model=model,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Oslo?"}]}],
        max_tokens=12,
        extra_body=GREEDY,
    )
    assert as_blocks.content == message.content


def test_a_streamed_message_is_the_unary_one(client: anthropic.Anthropic, model: str) -> None:
    fields: Any = {"model": model, "system": SYSTEM, "messages": OSLO, "max_tokens": 10, "extra_body": GREEDY}
    unary = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text == unary.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == unary.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10
    total = (final.usage.input_tokens or 0) + (final.usage.cache_read_input_tokens or 0)
    assert total == (unary.usage.input_tokens or 0) + (unary.usage.cache_read_input_tokens or 0)


def test_the_stream_is_anthropics_events_in_order(server: RunningServer, model: str) -> None:
    body = {"model": model, "messages": OSLO, "max_tokens": 6, "temperature": 0, "stream": True}
    reply = httpx.post(
        f"{server.http_base}/v1/messages",
        json=body,
        headers={"x-api-key": TOKEN, "anthropic-version": "2023-06-01"},
        timeout=30,
    )
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = []
    for message in reply.text.strip().split("\n\n"):
        kind, data = message.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6


def test_a_waiting_stream_pings(
    client: anthropic.Anthropic, server: RunningServer, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MessagesRenderer, "keepalive_seconds", 0.01)  # each slow step takes 0.05 s
    body = {"model": model, "messages": OSLO, "max_tokens": 4, "temperature": 0, "stream": True}
    headers = {"x-api-key": TOKEN, "X-Request-Id": "slow-pings"}
    reply = httpx.post(f"{server.http_base}/v1/messages", json=body, headers=headers, timeout=30)
    kinds = [line.removeprefix("event: ") for line in reply.text.splitlines() if line.startswith("event: ")]
    first_delta = kinds.index("content_block_delta")
    assert kinds.count("ping") > 2 and "ping" in kinds[first_delta:]  # between the tokens too
    assert kinds[-2:] == ["message_delta", "message_stop"]
    with client.messages.stream(
        model=model,
        messages=OSLO,
        max_tokens=4,
        extra_body=GREEDY,
        extra_headers={"X-Request-Id": "slow-sdk"},
    ) as stream:
        assert stream.get_final_message().usage.output_tokens == 4  # the SDK skips the pings


def test_a_tool_use_round_trip(client: anthropic.Anthropic, chat: openai.OpenAI, model: str) -> None:
    forced: Any = {"type": "tool", "name": "weather"}
    message = client.messages.create(
        model=model, messages=OSLO, tools=[TOOL], tool_choice=forced, max_tokens=48, extra_body=GREEDY
    )
    (use,) = message.content
    assert use.type == "tool_use" and use.name == "weather" and use.id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    expected = chat.chat.completions.create(
        model=model,
        messages=OSLO,
        tools=[CHAT_TOOL],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=48,
        temperature=0,
    )
    called = expected.choices[0].message.tool_calls
    assert called is not None and json.loads(called[0].function.arguments) == use.input  # type: ignore[union-attr]

    with client.messages.stream(
        model=model, messages=OSLO, tools=[TOOL], tool_choice=forced, max_tokens=48, extra_body=GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"  # type: ignore[union-attr]

    result: Any = {"type": "tool_result", "tool_use_id": use.id, "content": '{"sky": "clear"}'}
    history: Any = [
        *OSLO,
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [result]},
    ]
    answer = client.messages.create(
        model=model,
        messages=history,
        tools=[TOOL],
        tool_choice={"type": "none"},
        max_tokens=6,
        extra_body=GREEDY,
    )
    assert [block.type for block in answer.content] == ["text"]
    assert answer.usage.input_tokens > message.usage.input_tokens  # the call and its result are in the prompt
    counted = client.messages.count_tokens(model=model, messages=history, tools=[TOOL])
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)


def test_output_config_format_constrains_the_text(client: anthropic.Anthropic, model: str) -> None:
    config: Any = {"format": {"type": "json_schema", "schema": ANSWER}}
    fields: Any = {"model": model, "messages": OSLO, "max_tokens": 48, "extra_body": GREEDY}
    message = client.messages.create(**fields, output_config=config)
    (block,) = message.content
    assert block.type == "text" and message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(block.text), ANSWER)
    with client.messages.stream(**fields, output_config=config) as stream:
        assert stream.get_final_message().content[0].text == block.text  # type: ignore[union-attr]
    parsed = client.messages.parse(**fields, output_format=Answer)  # the SDK's schema of a pydantic type
    assert isinstance(parsed.parsed_output, Answer)

    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(**fields, output_config={"format": {"type": "json_schema"}})
    assert anthropic_error(refused.value)["message"].startswith("output_config.format.schema: Field required")


def test_count_tokens_is_the_prompts_count(
    client: anthropic.Anthropic, server: RunningServer, model: str
) -> None:
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=OSLO, tools=[TOOL])
    message = client.messages.create(
        model=model, system=SYSTEM, messages=OSLO, tools=[TOOL], max_tokens=2, extra_body=GREEDY
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)
    messages = [{"role": "system", "content": SYSTEM}, *OSLO]
    tokenized = httpx.post(
        f"{server.http_base}/tokenize",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()
    without_tools = client.messages.count_tokens(model=model, system=SYSTEM, messages=OSLO)
    assert without_tools.input_tokens == tokenized["count"] < counted.input_tokens


def test_a_stop_sequence_ends_the_message(client: anthropic.Anthropic, model: str) -> None:
    seeded = {"seed": 5}  # sampled: greedy, the tiny model repeats one character
    fields: Any = {"model": model, "messages": OSLO, "max_tokens": 12, "extra_body": seeded}
    text = client.messages.create(**fields).content[0].text  # type: ignore[union-attr]
    # two characters the text first has after its start: the message stops before them
    sequence = next(text[i : i + 2] for i in range(1, len(text) - 1) if text.index(text[i : i + 2]) == i)
    stopped = client.messages.create(**fields, stop_sequences=["never said", sequence])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == sequence
    assert stopped.content[0].text == text[: text.index(sequence)]  # type: ignore[union-attr]


def anthropic_error(raised: anthropic.APIStatusError) -> dict[str, Any]:
    body = raised.response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    return body["error"]  # type: ignore[no-any-return]


def test_a_messages_priority_from_the_body_or_the_header(
    client: anthropic.Anthropic, server: RunningServer, model: str
) -> None:
    answer = client.messages.create(model=model, messages=OSLO, max_tokens=2, extra_body={"priority": -1})
    # Served: the random model may end at once (EOS) or fill max_tokens, whichever its weights pick.
    assert answer.type == "message" and answer.stop_reason in ("end_turn", "max_tokens")
    reply = httpx.post(
        f"{server.http_base}/v1/messages",
        json={"model": model, "messages": OSLO, "max_tokens": 2},
        headers={"x-api-key": TOKEN, "X-Request-Priority": "urgent"},
    )
    assert reply.status_code == 400
    error = anthropic_error(anthropic.BadRequestError("", response=reply, body=None))
    assert error["type"] == "invalid_request_error" and "X-Request-Priority is 'urgent'" in error["message"]


def test_errors_are_in_anthropics_shape(
    client: anthropic.Anthropic, server: RunningServer, model: str
) -> None:
    missing = httpx.post(
        f"{server.http_base}/v1/messages",
        json={"model": model, "messages": OSLO},
        headers={"x-api-key": TOKEN},
    )
    assert missing.status_code == 400
    error = anthropic_error(anthropic.BadRequestError("", response=missing, body=None))
    assert error["type"] == "invalid_request_error" and error["message"].startswith(
        "max_tokens: Field required"
    )

    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", messages=OSLO, max_tokens=4)
    error = anthropic_error(unknown.value)
    assert error["type"] == "not_found_error" and "'nope'" in error["message"]

    wrong = anthropic.Anthropic(base_url=server.http_base, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:  # the SDK sends its key as a bearer token
        wrong.messages.count_tokens(model=model, messages=OSLO)
    assert anthropic_error(refused.value)["type"] == "authentication_error"
    body = {"model": model, "messages": OSLO}
    for headers in ({"x-api-key": "nope"}, {}):
        reply = httpx.post(f"{server.http_base}/v1/messages/count_tokens", json=body, headers=headers)
        assert reply.status_code == 401
        error = anthropic_error(anthropic.AuthenticationError("", response=reply, body=None))
        assert error["type"] == "authentication_error" and "x-api-key" in error["message"]

    get = httpx.get(f"{server.http_base}/v1/messages", headers={"x-api-key": TOKEN})
    assert get.status_code == 405
    error = anthropic_error(anthropic.APIStatusError("", response=get, body=None))
    assert error["type"] == "invalid_request_error"  # the client's error, whatever its status

    with pytest.raises(anthropic.BadRequestError) as misplaced:
        client.messages.count_tokens(
            model=model, messages=[{"role": "assistant", "content": [{"type": "image", "source": {}}]}]
        )
    assert anthropic_error(misplaced.value)["message"].startswith('messages.0.content.0.type is "image"')


def test_the_token_is_accepted_as_x_api_key(server: RunningServer, model: str) -> None:
    reply = httpx.post(
        f"{server.http_base}/v1/messages/count_tokens",
        json={"model": model, "messages": OSLO},
        headers={"x-api-key": TOKEN, "anthropic-version": "2023-06-01"},
    )
    assert reply.status_code == 200 and reply.json()["input_tokens"] > 0


def test_a_failed_stream_ends_with_an_error_event(client: anthropic.Anthropic, model: str) -> None:
    fields: Any = {"model": model, "messages": OSLO, "max_tokens": 8, "extra_body": GREEDY}
    with (
        pytest.raises(anthropic.APIStatusError, match="injected ONNX Runtime failure") as raised,
        client.messages.stream(**fields, extra_headers={"X-Request-Id": "doomed-in-decode"}) as stream,
    ):
        stream.get_final_message()
    assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]


def test_messages_are_counted_under_their_route(
    client: anthropic.Anthropic, server: RunningServer, model: str
) -> None:
    before = server.metric("textgen_requests_total", rpc="/v1/messages/count_tokens", code="OK")
    client.messages.count_tokens(model=model, messages=OSLO)
    assert server.metric("textgen_requests_total", rpc="/v1/messages/count_tokens", code="OK") == before + 1


LOOKBEHIND: Any = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {
                "tools": [{**TOOL, "input_schema": LOOKBEHIND}],
                "tool_choice": {"type": "tool", "name": "weather"},
            },
            "",
        ),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": LOOKBEHIND}}},
            "output_config.format",
        ),
    ],
)
def test_a_schema_llguidance_rejects_is_a_400_before_the_stream(
    client: anthropic.Anthropic,
    model: str,
    extra: dict[str, Any],
    field: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused at its compile, before the first token: the status says so, not an error event on a 200."""
    monkeypatch.setattr(MessagesRenderer, "keepalive_seconds", 600.0)  # the stream waits for the refusal
    fields: Any = {"model": model, "messages": OSLO, "max_tokens": 8, **extra}
    with pytest.raises(anthropic.BadRequestError) as refused, client.messages.stream(**fields) as stream:
        stream.get_final_message()
    assert refused.value.status_code == 400
    error = anthropic_error(refused.value)
    assert error["type"] == "invalid_request_error" and "look-around" in error["message"]
    assert field in error["message"]


def test_a_failed_prefill_is_a_500_before_the_stream(
    client: anthropic.Anthropic, model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(MessagesRenderer, "keepalive_seconds", 600.0)  # the stream waits for the failure
    fields: Any = {"model": model, "messages": OSLO, "max_tokens": 8, "extra_body": GREEDY}
    with (
        pytest.raises(anthropic.InternalServerError) as raised,
        client.messages.stream(**fields, extra_headers={"X-Request-Id": "fails-to-join-1"}) as stream,
    ):
        stream.get_final_message()
    assert raised.value.status_code == 500 and anthropic_error(raised.value)["type"] == "api_error"


def test_the_request_id_is_anthropics_request_id_header(client: anthropic.Anthropic, model: str) -> None:
    headers = {"X-Request-Id": "req-messages-1"}
    message = client.messages.create(
        model=model, messages=OSLO, max_tokens=2, extra_body=GREEDY, extra_headers=headers
    )
    assert message._request_id == "req-messages-1"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client.messages.create(model="nope", messages=OSLO, max_tokens=2, extra_headers=headers)
    assert unknown.value.request_id == "req-messages-1"


def test_a_streams_usage_is_the_same_at_its_start_and_end(server: RunningServer, model: str) -> None:
    """The same prompt twice: the second reads it from the prefix cache; its stream's two ends say so."""
    long: Any = [{"role": "user", "content": "Oslo or Rome? " * 8}]  # over prefix_cache_min_tokens
    body = {"model": model, "messages": long, "max_tokens": 3, "temperature": 0, "stream": True}
    for _ in range(2):
        reply = httpx.post(
            f"{server.http_base}/v1/messages", json=body, headers={"x-api-key": TOKEN}, timeout=30
        )
        events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    start, delta = events[0]["message"]["usage"], events[-2]["usage"]
    assert start == {**delta, "output_tokens": 0} and delta["output_tokens"] == 3
    assert delta["cache_creation_input_tokens"] == 0 and delta["cache_read_input_tokens"] > 0

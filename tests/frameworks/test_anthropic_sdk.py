"""The anthropic SDK's own helpers against /v1/messages, as its README uses them with a `base_url`: the
tool runner with a `@beta_tool` function, `messages.stream`'s text and final message, `count_tokens`, and
`messages.parse` (structured output sent as `output_config.format`)."""

from __future__ import annotations

from typing import Literal

import anthropic
import pytest
from anthropic import beta_tool
from framework_server import MODEL, Forecast
from running_server import RunningServer

OSLO: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Oslo?"}]
# The SDK has no sampling parameters (the server samples at temperature 1 without them): greedy decoding,
# for answers to compare, goes in the body's extra fields.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.http_base, api_key="unused", max_retries=0, timeout=30)


def test_the_tool_runner_runs_a_forced_tool_each_turn(client: anthropic.Anthropic) -> None:
    zones: list[str] = []

    @beta_tool
    def clock(zone: Literal["UTC", "CET"]) -> str:
        """The time.

        Args:
            zone: the time zone
        """
        zones.append(zone)  # the SDK validated the input against the signature first
        return "noon"

    # thread=False: the runner sends the whole history each turn (a thread would keep it on the server).
    runner = client.beta.messages.tool_runner(
        model=MODEL,
        max_tokens=40,
        tools=[clock],
        tool_choice={"type": "tool", "name": "clock"},
        max_iterations=2,
        thread=False,
        messages=[{"role": "user", "content": "Oslo?"}],
    )
    replies = list(runner)
    assert [reply.stop_reason for reply in replies] == ["tool_use", "tool_use"]
    assert len(zones) == 2


def test_a_stream_adds_up_to_its_message_and_the_count_to_its_usage(client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=MODEL, max_tokens=12, messages=OSLO, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    message = client.messages.create(model=MODEL, max_tokens=12, messages=OSLO, extra_body=GREEDY)
    assert text
    assert [text] == texts(final) == texts(message)
    count = client.messages.count_tokens(model=MODEL, messages=OSLO)
    assert count.input_tokens == message.usage.input_tokens == final.usage.input_tokens


def test_parse_returns_the_output_format_parsed(client: anthropic.Anthropic) -> None:
    parsed = client.messages.parse(model=MODEL, max_tokens=40, messages=OSLO, output_format=Forecast)
    assert isinstance(parsed.parsed_output, Forecast)


def texts(message: anthropic.types.Message) -> list[str]:
    return [block.text for block in message.content if block.type == "text"]

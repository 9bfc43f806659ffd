"""openai-agents against the server, as its documentation sets up "a local OpenAI-compatible server" (an
`AsyncOpenAI` client with a `base_url`, given to `OpenAIChatCompletionsModel` or `OpenAIResponsesModel`):
a forced function tool runs with arguments its schema validated, an `output_type` comes back parsed (alone,
streamed, and beside a forced tool), and a tool's error reaches the model in the next turn's request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import pydantic
import pytest
from agents import (
    Agent,
    FunctionTool,
    Model,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RawResponsesStreamEvent,
    RunContextWrapper,
    Runner,
    StreamEvent,
    ToolsToFinalOutputResult,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallOutputItem
from framework_server import MODEL, Bodies
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from running_server import RunningServer

set_tracing_disabled(True)  # the SDK would otherwise upload traces to OpenAI
ROOM = 64  # the server's output cap: room for a forced call of the tools below


class Answer(pydantic.BaseModel):
    answer: bool


@pytest.fixture(params=["chat", "responses"])
def model(request: pytest.FixtureRequest, server: RunningServer) -> Iterator[tuple[Model, Bodies]]:
    """Each of the SDK's two OpenAI models on the server, and the request bodies its client sends."""
    bodies = Bodies()
    http = DefaultAsyncHttpxClient(event_hooks={"request": [bodies.record]})
    client = AsyncOpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, http_client=http)
    kind = OpenAIChatCompletionsModel if request.param == "chat" else OpenAIResponsesModel
    yield kind(model=MODEL, openai_client=client), bodies


def test_a_forced_function_tool_runs_with_valid_arguments(loop: Any, model: tuple[Model, Bodies]) -> None:
    calls: list[tuple[str, int]] = []

    @function_tool
    def weather(city: Literal["Oslo", "Rome"], days: int) -> str:
        """A forecast."""
        calls.append((city, days))  # the SDK validated the arguments against the signature first
        return f"sun in {city}"

    agent = Agent(
        name="forecaster",
        instructions="Be brief.",
        model=model[0],
        tools=[weather],
        model_settings=ModelSettings(tool_choice="weather", max_tokens=ROOM, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = loop.run(Runner.run(agent, "Oslo?"))
    assert len(calls) == 1
    assert result.final_output == f"sun in {calls[0][0]}"


def test_output_type_comes_back_parsed(loop: Any, model: tuple[Model, Bodies]) -> None:
    agent = Agent(
        name="judge",
        model=model[0],
        output_type=Answer,
        model_settings=ModelSettings(max_tokens=16, temperature=0),
    )
    result = loop.run(Runner.run(agent, "Oslo?"))
    assert isinstance(result.final_output, Answer)


def test_a_forced_tool_beside_output_type_runs_then_the_output_parses(
    loop: Any, model: tuple[Model, Bodies]
) -> None:
    cities: list[str] = []

    @function_tool
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """A forecast."""
        cities.append(city)
        return "sun"

    # The first request forces the tool and carries the output's format; the next ones (tool_choice back to
    # auto) let the model call again or answer in the format, so the run ends in an Answer either way.
    agent = Agent(
        name="forecaster",
        model=model[0],
        tools=[weather],
        output_type=Answer,
        model_settings=ModelSettings(tool_choice="weather", max_tokens=ROOM, temperature=0),
    )
    result = loop.run(Runner.run(agent, "Oslo?"))
    assert cities
    assert isinstance(result.final_output, Answer)


def test_a_streamed_run_adds_up_to_its_output(loop: Any, model: tuple[Model, Bodies]) -> None:
    settings = ModelSettings(max_tokens=16, temperature=0)
    agent = Agent(name="judge", model=model[0], output_type=Answer, model_settings=settings)

    async def stream() -> tuple[list[str], Any]:
        run = Runner.run_streamed(agent, "Oslo?")
        deltas = [delta async for delta in text_deltas(run.stream_events())]
        return deltas, run.final_output

    deltas, output = loop.run(stream())
    assert isinstance(output, Answer)
    assert Answer.model_validate_json("".join(deltas)) == output


async def text_deltas(events: AsyncIterator[StreamEvent]) -> AsyncIterator[str]:
    """The text deltas of a run's raw model events (the SDK turns chat chunks into Responses events)."""
    async for event in events:
        if isinstance(event, RawResponsesStreamEvent) and event.data.type == "response.output_text.delta":
            yield event.data.delta


def test_a_tool_error_reaches_the_next_turn(loop: Any, model: tuple[Model, Bodies]) -> None:
    weather = failing_tool()
    runs = 0

    def stop_on_second(context: RunContextWrapper[Any], results: list[Any]) -> ToolsToFinalOutputResult:
        nonlocal runs
        runs += 1
        return ToolsToFinalOutputResult(is_final_output=runs == 2, final_output="gave up")

    # Turn two is forced too (reset_tool_choice off), so both turns end in a call, whatever the weights.
    agent = Agent(
        name="forecaster",
        model=model[0],
        tools=[weather],
        model_settings=ModelSettings(tool_choice="required", max_tokens=ROOM, temperature=0),
        tool_use_behavior=stop_on_second,
        reset_tool_choice=False,
    )
    result = loop.run(Runner.run(agent, "Oslo?", max_turns=2))
    assert result.final_output == "gave up"
    first = next(item for item in result.new_items if isinstance(item, ToolCallOutputItem))
    bodies = model[1]
    assert len(bodies) == 2
    assert tool_output(bodies[1], call_id(first)) == first.output
    assert str(first.output).startswith("failed: no forecast for ")


def failing_tool() -> FunctionTool:
    def no_forecast(city: Literal["Oslo", "Rome"]) -> str:
        """A forecast."""
        raise RuntimeError(f"no forecast for {city}")

    return function_tool(no_forecast, failure_error_function=lambda _, error: f"failed: {error}")


def call_id(item: ToolCallOutputItem) -> str:
    raw: Any = item.raw_item
    return str(raw["call_id"] if isinstance(raw, dict) else raw.call_id)


def tool_output(body: dict[str, Any], call: str) -> Any:
    """The output a request body carries for the call `call` (chat: a tool message; responses: an item)."""
    if "messages" in body:
        return next(m["content"] for m in body["messages"] if m.get("tool_call_id") == call)
    outputs = (i for i in body["input"] if i.get("type") == "function_call_output")
    return next(i["output"] for i in outputs if i["call_id"] == call)

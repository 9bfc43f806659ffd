"""pydantic-ai against the server, as its documentation sets up an OpenAI-compatible provider
(`OpenAIChatModel` with an `OpenAIProvider(base_url=...)`): a function tool forced on the first step runs
with validated arguments before a `ToolOutput` or a `NativeOutput` comes back as its model, and streamed
text and output add up to what the unstreamed run gives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pytest
from framework_server import MODEL, Forecast
from pydantic_ai import Agent, NativeOutput, RunContext, ToolOutput
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from running_server import RunningServer

ROOM: ModelSettings = {"max_tokens": 60, "temperature": 0}  # room for a forced call of the tools below


class ClockFirst(AbstractCapability[Any]):
    """Forces the clock tool on the first step only, as pydantic-ai's tool-choice guide does per step."""

    def get_model_settings(self) -> Callable[[RunContext[Any]], ModelSettings]:
        return lambda context: {"tool_choice": ["clock"]} if context.run_step == 1 else {}


@pytest.fixture(scope="module")
def model(server: RunningServer) -> OpenAIChatModel:
    return OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=f"{server.http_base}/v1", api_key="unused")
    )


def test_a_tool_runs_then_the_tool_output_ends_the_run(loop: Any, model: OpenAIChatModel) -> None:
    zones: list[str] = []
    agent = Agent(model, output_type=ToolOutput(Forecast), model_settings=ROOM, capabilities=[ClockFirst()])

    @agent.tool_plain
    def clock(zone: Literal["UTC", "CET"]) -> str:
        """The time."""
        zones.append(zone)  # pydantic-ai validated the arguments first
        return "noon"

    result = loop.run(agent.run("Oslo?"))
    assert len(zones) == 1
    assert isinstance(result.output, Forecast)


def test_a_tool_runs_then_the_native_output_ends_the_run(loop: Any, model: OpenAIChatModel) -> None:
    """The first request forces the tool and carries the output's JSON schema as its response_format."""
    zones: list[str] = []
    agent = Agent(model, output_type=NativeOutput(Forecast), model_settings=ROOM, capabilities=[ClockFirst()])

    @agent.tool_plain
    def clock(zone: Literal["UTC", "CET"]) -> str:
        """The time."""
        zones.append(zone)
        return "noon"

    result = loop.run(agent.run("Oslo?"))
    assert zones
    assert isinstance(result.output, Forecast)


def test_streamed_text_adds_up_to_the_run(loop: Any, model: OpenAIChatModel) -> None:
    agent = Agent(model, model_settings={"max_tokens": 12, "temperature": 0})

    async def stream() -> tuple[list[str], str]:
        async with agent.run_stream("Oslo?") as run:
            deltas = [delta async for delta in run.stream_text(delta=True)]
            return deltas, await run.get_output()

    deltas, output = loop.run(stream())
    assert "".join(deltas) == output == loop.run(agent.run("Oslo?")).output
    assert output


def test_a_streamed_tool_output_ends_as_its_model(loop: Any, model: OpenAIChatModel) -> None:
    agent = Agent(model, output_type=ToolOutput(Forecast), model_settings=ROOM)

    async def stream() -> tuple[list[Forecast], Forecast]:
        async with agent.run_stream("Oslo?") as run:
            return [partial async for partial in run.stream_output()], await run.get_output()

    partials, output = loop.run(stream())
    assert isinstance(output, Forecast)
    assert partials[-1] == output
    assert output == loop.run(agent.run("Oslo?")).output

"""instructor against the server, as its documentation patches an OpenAI client pointed at another endpoint
(`instructor.from_openai(AsyncOpenAI(base_url=...), mode=...)`): in TOOLS mode the model comes back from a
forced function call, in JSON_SCHEMA mode from a `response_format` JSON schema; a model written as people
write them (extra keys not forbidden) ends when sampled; streamed partials end as the unstreamed model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import instructor
import pydantic
import pytest
from framework_server import MODEL, Bodies, Forecast
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from running_server import RunningServer

ROOM = 60  # room for a forced call of Forecast
PROMPT = [{"role": "user", "content": "Oslo?"}]


class City(pydantic.BaseModel):
    """instructor's usual model: its schema leaves additionalProperties out (not strict)."""

    city: Literal["Oslo", "Rome"]


def request_for(model: type[pydantic.BaseModel], temperature: float) -> dict[str, Any]:
    """The arguments of instructor's create for `model`, instructor's own retries off."""
    return {
        "model": MODEL,
        "messages": PROMPT,
        "response_model": model,
        "max_tokens": ROOM,
        "temperature": temperature,
        "max_retries": 0,
    }


@pytest.fixture(params=[instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA], ids=["tools", "json_schema"])
def client(request: pytest.FixtureRequest, server: RunningServer) -> Iterator[tuple[Any, Bodies]]:
    """A patched client in each mode, and the request bodies it sends."""
    bodies = Bodies()
    http = DefaultAsyncHttpxClient(event_hooks={"request": [bodies.record]})
    openai = AsyncOpenAI(base_url=f"{server.http_base}/v1", api_key="unused", max_retries=0, http_client=http)
    yield instructor.from_openai(openai, mode=request.param), bodies


def test_the_model_comes_back_by_the_modes_own_request(loop: Any, client: tuple[Any, Bodies]) -> None:
    patched, bodies = client
    forecast = loop.run(patched.chat.completions.create(**request_for(Forecast, temperature=0)))
    assert isinstance(forecast, Forecast)
    [body] = bodies
    if patched.mode == instructor.Mode.TOOLS:
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Forecast"}}
        assert "response_format" not in body
    else:
        assert body["response_format"]["type"] == "json_schema"
        assert "tools" not in body


def test_a_sampled_non_strict_model_ends(loop: Any, client: tuple[Any, Bodies]) -> None:
    """The server reads a schema that leaves additionalProperties out as closed, so sampled output ends."""
    patched, _ = client
    for _ in range(3):
        city = loop.run(patched.chat.completions.create(**request_for(City, temperature=1)))
        assert isinstance(city, City)


def test_streamed_partials_end_as_the_model(loop: Any, client: tuple[Any, Bodies]) -> None:
    patched, _ = client
    kwargs = request_for(Forecast, temperature=0)

    async def partials() -> list[Any]:
        return [partial async for partial in patched.chat.completions.create_partial(**kwargs)]

    streamed = loop.run(partials())
    whole = loop.run(patched.chat.completions.create(**kwargs))
    assert len(streamed) > 1
    assert isinstance(whole, Forecast)
    assert streamed[-1].model_dump() == whole.model_dump()

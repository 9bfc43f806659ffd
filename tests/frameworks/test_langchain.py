"""LangChain's chat models against the server, each as its documentation points it at another endpoint:
`ChatOpenAI(base_url=.../v1)` and `ChatAnthropic(base_url=...)`. A tool forced by `bind_tools` comes back
with arguments that validate, `with_structured_output` parses into the model by JSON schema and by function
calling, and a stream (text, or a forced tool call) adds up to the unstreamed answer."""

from __future__ import annotations

import functools
import operator
from typing import Literal

import pydantic
import pytest
from framework_server import MODEL, Forecast
from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from running_server import RunningServer

ROOM = 60  # room for a forced call of Forecast
PROMPT = "Oslo?"


class City(pydantic.BaseModel):
    """A model as people write them: its schema leaves additionalProperties out (not strict)."""

    city: Literal["Oslo", "Rome"]


@pytest.fixture(params=["openai", "anthropic"])
def chat_model(request: pytest.FixtureRequest, server: RunningServer) -> BaseChatModel:
    """Greedy, no retries, an output limit that leaves room for a forced Forecast call."""
    if request.param == "openai":
        return ChatOpenAI(
            model=MODEL,
            base_url=f"{server.http_base}/v1",
            api_key="unused",
            max_tokens=ROOM,
            temperature=0,
            max_retries=0,
        )
    return ChatAnthropic(
        model=MODEL,
        base_url=server.http_base,
        api_key="unused",
        max_tokens=ROOM,
        temperature=0,
        max_retries=0,
    )


def test_a_forced_tool_comes_back_with_valid_arguments(chat_model: BaseChatModel) -> None:
    reply = chat_model.bind_tools([Forecast], tool_choice="Forecast").invoke(PROMPT)
    assert isinstance(reply, AIMessage)
    [call] = reply.tool_calls
    assert call["name"] == "Forecast"
    Forecast.model_validate(call["args"])


def test_a_sampled_call_of_a_non_strict_schema_ends(chat_model: BaseChatModel) -> None:
    """The server reads a schema that leaves additionalProperties out as closed, so a sampled call ends."""
    sampled = chat_model.bind(temperature=1).bind_tools([City], tool_choice="City")
    for _ in range(3):
        reply = sampled.invoke(PROMPT)
        assert isinstance(reply, AIMessage)
        [call] = reply.tool_calls
        City.model_validate(call["args"])


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_parses_into_the_model(chat_model: BaseChatModel, method: str) -> None:
    assert isinstance(chat_model.with_structured_output(Forecast, method=method).invoke(PROMPT), Forecast)


def test_streamed_text_adds_up_to_the_answer(chat_model: BaseChatModel) -> None:
    short = chat_model.bind(max_tokens=12)
    streamed = functools.reduce(operator.add, short.stream(PROMPT))
    assert streamed.text
    assert streamed.text == short.invoke(PROMPT).text


def test_a_streamed_forced_tool_call_adds_up_to_the_call(chat_model: BaseChatModel) -> None:
    forced = chat_model.bind_tools([Forecast], tool_choice="Forecast")
    streamed = functools.reduce(operator.add, forced.stream(PROMPT))
    assert isinstance(streamed, AIMessage)
    reply = forced.invoke(PROMPT)
    assert isinstance(reply, AIMessage)
    [call] = streamed.tool_calls
    assert [(call["name"], call["args"])] == [(c["name"], c["args"]) for c in reply.tool_calls]
    Forecast.model_validate(call["args"])

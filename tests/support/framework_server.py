"""What the client-framework tests (tests/frameworks/) share: the chat template that fits the frameworks'
prompts into the tiny bundle's context, the name it is served under, and a record of request bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Protocol

import pydantic
from running_server import RunningServer, serve_with_template
from server_tools import LoopThread

# Frameworks add system prompts, instructions and schemas that alone outgrow the tiny bundle's 128-token
# context: this template keeps what the tests look at, each message's role letter, its text cut short (text
# sent as content parts is left out) and an assistant's call arguments, also cut short.
FRAMEWORK_TEMPLATE = (
    "{%- for m in messages if m.role != 'system' %}{{ m.role[0] }}:"
    "{%- if m.content is string %}{{ m.content[:16] }}{% endif %}"
    "{%- for call in m.tool_calls or [] %}({{ (call.function.arguments | tojson)[:12] }}){% endfor %}"
    "\n{% endfor %}a:"
)
MODEL = "tiny"  # the frameworks ask for the model by the name the server publishes (--served-model-name)


class Forecast(pydantic.BaseModel):
    """The structured output the tests ask for: its schema forbids extra keys and lists every value, so
    the constrained output ends within a few tokens even when sampled (an unbounded integer may run to
    max_tokens; the anthropic SDK drops `minimum` and `maximum` from the schemas it sends, enums stay)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Oslo", "Rome"]
    days: Literal[1, 2, 3]


class Request(Protocol):
    """What the hooks read of an httpx request (the SDKs use httpx or its fork httpx2)."""

    @property
    def content(self) -> bytes: ...


class Bodies(list[dict[str, Any]]):
    """The JSON bodies an async client sent, in order: give `record` to its httpx client as a request hook."""

    async def record(self, request: Request) -> None:
        if request.content:
            self.append(json.loads(request.content))


def serve_for_frameworks(loop: LoopThread, tiny_bundle: Path, where: Path) -> RunningServer:
    """A server of a copy of the tiny bundle with FRAMEWORK_TEMPLATE, published as MODEL."""
    return serve_with_template(
        loop, tiny_bundle, where, FRAMEWORK_TEMPLATE, engine_process=False, served_model_name=[MODEL]
    )

"""Anthropic's Messages API, a router of the HTTP application (serve/api/http/app.py), answering errors in
Anthropic's shape:

    POST /v1/messages               the assistant's next message, served as the chat it means
    POST /v1/messages/count_tokens  the tokens of a Messages request's prompt
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from serve.api.anthropic.messages import MessagesRenderer
from serve.api.anthropic.protocol import (
    AnthropicError,
    MessageObject,
    MessagesInput,
    MessagesRequest,
    TokenCount,
)
from serve.api.anthropic.translate import messages_plan, messages_prompt
from serve.api.common import CallRecord, LoadedModel
from serve.api.http.app import STREAMED, HttpApi
from serve.api.http.paths import COUNT_TOKENS, MESSAGES
from serve.api.http.serving import Renderer
from serve.api.http.translate import named_model, with_adapter

# The error statuses of /v1/messages and count_tokens, in Anthropic's shape (529: draining or loading).
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError} for status in (400, 401, 404, 413, 429, 500, 504, 529)
}


def anthropic_routes(api: HttpApi) -> APIRouter:
    """The routes, their handlers on `api`."""
    router = APIRouter()

    async def message(body: MessagesRequest, model: LoadedModel, record: CallRecord) -> Renderer[Any]:
        plan = await messages_plan(body, model, record)
        name = with_adapter(plan, model, body.model)
        return MessagesRenderer(plan, name, record.request_id, api.vocabulary(model))

    @router.post(
        MESSAGES,
        summary="Anthropic's Messages API: the assistant's next message",
        response_model=MessageObject,
        responses=STREAMED | ANTHROPIC_ERRORS,
    )
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await api.generate(MESSAGES, body, request, message)

    async def counted(body: MessagesInput, request: Request) -> TokenCount:
        model = named_model(api.state, body.model)
        record = api.record(COUNT_TOKENS, request)  # the prompt's; `answer` accounts the call
        prompt, _ = await messages_prompt(body, model, record)
        return {"input_tokens": len(prompt.ids)}

    @router.post(
        COUNT_TOKENS,
        summary="the tokens of a Messages request's prompt",
        response_model=TokenCount,
        responses=ANTHROPIC_ERRORS,
    )
    async def count_tokens(body: MessagesInput, request: Request) -> Response:
        return await api.answer(COUNT_TOKENS, request, counted(body, request))

    return router


__all__ = ["ANTHROPIC_ERRORS", "anthropic_routes"]

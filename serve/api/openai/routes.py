"""The OpenAI-compatible API's routes (vLLM's where OpenAI has none), a router of the HTTP application
(serve/api/http/app.py), answering errors in OpenAI's shape:

    GET  /v1/models              the served model (each of its served names) and its max_model_len
    POST /v1/completions         prompt(s) as text or token ids; echo, logprobs, n, stream, ...
    POST /v1/chat/completions    messages rendered with the bundle's chat template (serve/api/chat.py)
    POST /v1/responses           OpenAI's Responses API, stateless: served as the chat it means (responses.py)
    POST /tokenize, /detokenize  a prompt's or a chat's token ids, and back
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter  vLLM's, with --lora-runtime-updates (else 404)

Each generation route passes its body's translation (translate_*.py) and its renderer (completions.py,
chat.py, responses.py) to the shared handler.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serve.api.adapters import load_adapter, unload_adapter
from serve.api.common import CallRecord, LoadedModel
from serve.api.http.app import STREAMED, HttpApi
from serve.api.http.paths import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    LOAD_LORA,
    MODELS,
    RESPONSES,
    TOKENIZE,
    UNLOAD_LORA,
)
from serve.api.http.serving import Renderer
from serve.api.http.translate import named_model, with_adapter
from serve.api.openai.chat import ChatRenderer
from serve.api.openai.completions import CompletionRenderer
from serve.api.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelList,
    ResponseObject,
    ResponsesRequest,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoraAdapterRequest,
)
from serve.api.openai.responses import ResponsesRenderer
from serve.api.openai.translate_chat import chat_messages, chat_plan
from serve.api.openai.translate_completions import completion_plan
from serve.api.openai.translate_responses import responses_plan
from serve.api.validation import token_ids
from serve.errors import InvalidRequest

# The error statuses a route may answer with, each in OpenAI's error shape (/openapi.json says so).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503, 504)
}


def openai_routes(api: HttpApi) -> APIRouter:
    """The routes, their handlers on `api`; the adapter routes only with --lora-runtime-updates."""
    router = APIRouter()
    max_n = api.settings.max_n

    @router.get(
        MODELS,
        summary="the served model and its LoRA adapters",
        response_model=ModelList,
        responses=ERRORS,
    )
    async def models(request: Request) -> Response:
        record = api.record(MODELS, request)
        try:
            model = api.state.ready_model()
        except Exception as exc:
            return api.accounting.failed(record, exc)
        record.status = 200
        api.accounting.account(record)
        cards = [_model_card(model, name) for name in (*model.names, *model.info.adapters)]
        return JSONResponse({"object": "list", "data": cards})

    async def completion(body: CompletionRequest, model: LoadedModel, record: CallRecord) -> Renderer[Any]:
        plan = await completion_plan(body, model, max_n, record)
        name = with_adapter(plan, model, body.model)
        return CompletionRenderer(plan, name, record.request_id, api.vocabulary(model))

    @router.post(
        COMPLETIONS,
        summary="completions of one or more prompts",
        response_model=CompletionResponse,
        responses=STREAMED | ERRORS,
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.generate(COMPLETIONS, body, request, completion)

    async def chat_completion(
        body: ChatCompletionRequest, model: LoadedModel, record: CallRecord
    ) -> Renderer[Any]:
        plan = await chat_plan(body, model, max_n, record)
        return ChatRenderer(
            plan, with_adapter(plan, model, body.model), record.request_id, api.vocabulary(model)
        )

    @router.post(
        CHAT,
        summary="the assistant's next message in a chat",
        response_model=ChatCompletionResponse,
        responses=STREAMED | ERRORS,
    )
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.generate(CHAT, body, request, chat_completion)

    async def response(body: ResponsesRequest, model: LoadedModel, record: CallRecord) -> Renderer[Any]:
        plan = await responses_plan(body, model, record)
        name = with_adapter(plan, model, body.model)
        return ResponsesRenderer(plan, name, record.request_id, api.vocabulary(model))

    @router.post(
        RESPONSES,
        summary="OpenAI's Responses API, stateless: a chat completion in its shape",
        response_model=ResponseObject,
        responses=STREAMED | ERRORS,
    )
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await api.generate(RESPONSES, body, request, response)

    @router.post(
        TOKENIZE,
        summary="a prompt's or a chat's token ids",
        response_model=TokenizeResponse,
        responses=ERRORS,
    )
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        return await api.answer(TOKENIZE, request, _tokenize(api, body))

    @router.post(
        DETOKENIZE, summary="the text of token ids", response_model=DetokenizeResponse, responses=ERRORS
    )
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        return await api.answer(DETOKENIZE, request, _detokenize(api, body))

    if api.settings.lora_runtime_updates:
        _adapter_routes(api, router)
    return router


def _adapter_routes(api: HttpApi, router: APIRouter) -> None:
    """vLLM's routes that change the served LoRA adapters; each answers as vLLM does, in plain text."""

    @router.post(LOAD_LORA, summary="load a LoRA adapter (a peft folder) while serving", responses=ERRORS)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
        name = body.lora_name

        async def update(model: LoadedModel) -> str:
            await load_adapter(model, name, body.lora_path, api.settings)
            return f"Success: LoRA adapter {name!r} added successfully."

        return await _updated(api, LOAD_LORA, request, update)

    @router.post(
        UNLOAD_LORA,
        summary="unload a LoRA adapter: at once, or once the requests using it end",
        responses=ERRORS,
    )
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, request: Request) -> Response:
        name = body.lora_name

        async def update(model: LoadedModel) -> str:
            deferred = (await unload_adapter(model, name)).deferred
            if not deferred:
                return f"Success: LoRA adapter {name!r} removed successfully."
            return (
                f"Success: LoRA adapter {name!r} will be removed once the {deferred} running or queued "
                "requests using it finish; new requests for it are refused."
            )

        return await _updated(api, UNLOAD_LORA, request, update)


async def _updated(
    api: HttpApi, route: str, request: Request, update: Callable[[LoadedModel], Awaitable[str]]
) -> Response:
    """An adapter update's answer: vLLM's success text, or the error that left the adapters unchanged."""
    record = api.record(route, request)
    try:
        done = await update(api.state.ready_model())
    except Exception as exc:
        return api.accounting.failed(record, exc)
    record.status = 200
    api.accounting.account(record)
    headers = {"X-Request-Id": record.request_id}
    return PlainTextResponse(done, headers=headers)


def _model_card(model: LoadedModel, name: str) -> dict[str, Any]:
    """`name`'s card: a served name of the model (vLLM lists each), or an adapter's, whose parent is the
    model's first name."""
    adapter = name not in model.names
    return {
        "id": name,
        "object": "model",
        "created": int(model.bundle.root.stat().st_mtime),
        "owned_by": "textgen",
        "max_model_len": model.limits.context_length,
        "root": name,
        "parent": model.name if adapter else None,
    }


async def _tokenize(api: HttpApi, body: TokenizeRequest) -> TokenizeResponse:
    model = named_model(api.state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages")
    chat_only = ("tools", "documents", "chat_template_kwargs")
    given = next((name for name in chat_only if getattr(body, name) is not None), None)
    if body.prompt is not None and given is not None:
        raise InvalidRequest(f"{given} applies to messages: a prompt is not rendered by the chat template")
    if body.messages is not None:
        if body.add_special_tokens:
            raise InvalidRequest(
                "add_special_tokens applies to a prompt: a chat's special tokens are its template's"
            )
        tools = [tool.model_dump(exclude_unset=True) for tool in body.tools] if body.tools else None
        messages, variables = chat_messages(body.messages, model.chat_reads_parts), body.chat_template_kwargs
        ids = await asyncio.to_thread(model.chat_prompt, messages, tools, body.documents, variables)
    else:
        special = body.add_special_tokens is not False
        encode = model.tokenizer.encode
        ids = (await asyncio.to_thread(encode, body.prompt, add_special_tokens=special)).ids
    # "" for ids the model has but the tokenizer does not (a vocabulary padded for speed)
    strs = [model.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    limit = model.limits.context_length
    return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}


async def _detokenize(api: HttpApi, body: DetokenizeRequest) -> DetokenizeResponse:
    model = named_model(api.state, body.model)
    ids = token_ids(body.tokens, model.info.vocab_size, "tokens")
    return {"prompt": await asyncio.to_thread(model.tokenizer.decode, ids)}


__all__ = ["ERRORS", "openai_routes"]

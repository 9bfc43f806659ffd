"""The OpenAI-compatible HTTP API: FastAPI on uvicorn, on the server's own event loop, beside gRPC.

    GET  /v1/models              the served model (each of its served names) and its max_model_len
    POST /v1/completions         prompt(s) as text or token ids; echo, logprobs, n, stream, ...
    POST /v1/chat/completions    messages rendered with the bundle's chat template (serve/api/chat.py)
    POST /v1/responses           OpenAI's Responses API, stateless: served as the chat it means (responses.py)
    POST /v1/messages            Anthropic's Messages API, served as the chat it means (serve/api/anthropic/)
    POST /v1/messages/count_tokens  the tokens of a Messages request's prompt
    POST /tokenize, /detokenize  a prompt's or a chat's token ids, and back
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter  vLLM's, with --lora-runtime-updates (else 404)
    GET  /health                 200 while serving, 503 while loading or draining (no token needed)

It shares the gRPC front end's request core (serve/api/validation.py), error kinds (serve/api/http_status.py
maps them), token (`Authorization: Bearer ...`, or Anthropic's `x-api-key`), metrics (the route is the `rpc`
label) and drain.
Handlers submit to the same scheduler directly, on the event loop. `X-Request-Id` is taken (or made) and
echoed; it is the request id of the log line and of an INTERNAL error's message. A client that goes away
cancels its request at the next engine step, streamed or not.

The generation routes share one handler (`_generate`): the body's translation (translate_*.py) and its
route's renderer (completions.py, chat.py, responses.py, anthropic/messages.py), run by serving.py's
skeleton.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from serve.api.adapters import load_adapter, unload_adapter
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
from serve.api.config import ServerSettings
from serve.api.http.errors import Accounting
from serve.api.http.front_door import FrontDoor
from serve.api.http.paths import (
    CHAT,
    COMPLETIONS,
    COUNT_TOKENS,
    DETOKENIZE,
    HEALTH,
    LOAD_LORA,
    MESSAGES,
    MODELS,
    REQUEST_ID_KEY,
    RESPONSES,
    TOKENIZE,
    UNLOAD_LORA,
)
from serve.api.http.serving import Renderer, Serving
from serve.api.http.translate import named_model, with_adapter
from serve.api.http.vocabulary import Vocabulary
from serve.api.metrics import Metrics
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
from serve.api.state import ServingState
from serve.api.tracing import RequestTracer
from serve.api.validation import PRIORITY_HEADER, header_priority, token_ids
from serve.errors import Draining, InvalidRequest

# The error statuses a route may answer with, each in OpenAI's error shape (/openapi.json says so).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503, 504)
}
# The error statuses of /v1/messages and count_tokens, in Anthropic's shape (529: draining or loading).
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicError} for status in (400, 401, 404, 413, 429, 500, 504, 529)
}
# With "stream": true the answer is server-sent events instead: `data: <JSON chunk>` lines, the chunks of the
# route's object (an error object if it fails after it began), then `data: [DONE]`; /v1/responses sends typed
# `event:` lines, response.created to response.completed, response.incomplete or response.failed, and
# /v1/messages Anthropic's, message_start to message_stop.
STREAMED: dict[int | str, dict[str, Any]] = {
    200: {
        "description": 'the object, or with "stream": true server-sent events',
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    }
}


GenerationBody = CompletionRequest | ChatCompletionRequest | ResponsesRequest | MessagesRequest


# --- the API ------------------------------------------------------------------------------------------------


class OpenAIApi:
    """The handlers, on the server's event loop; `app` is the ASGI application uvicorn serves."""

    def __init__(
        self,
        state: ServingState,
        settings: ServerSettings,
        metrics: Metrics | None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self._state = state
        self._settings = settings
        self._metrics = metrics
        self._accounting = Accounting(settings, metrics, tracer)
        self._serving = Serving(state, self._accounting.account)
        self._vocabularies: dict[int, Vocabulary] = {}
        self.fastapi = self._build()
        token = settings.auth_token.get_secret_value() if settings.auth_token is not None else None
        refused, traced = self._accounting.refused, tracer is not None
        self.app = FrontDoor(self.fastapi, token, settings.max_message_bytes, refused, traced)

    # -- the application ------------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(
            title="textgen",
            summary="OpenAI-compatible completions and chat completions of a textgen model bundle",
            docs_url=None,
            redoc_url=None,
        )
        self._accounting.install(app)

        @app.get(HEALTH, summary="200 while serving, 503 while loading or draining")
        async def health() -> Response:
            serving = not self._state.draining and self._ready() is not None
            body = {"status": "serving" if serving else "not serving"}
            return JSONResponse(body, status_code=200 if serving else 503)

        @app.get(
            MODELS,
            summary="the served model and its LoRA adapters",
            response_model=ModelList,
            responses=ERRORS,
        )
        async def models(request: Request) -> Response:
            record = CallRecord(rpc=MODELS, request_id=request.scope[REQUEST_ID_KEY])
            try:
                model = self._state.ready_model()
            except Exception as exc:
                return self._accounting.failed(record, exc)
            record.status = 200
            self._accounting.account(record)
            cards = [self._model_card(model, name) for name in (*model.names, *model.info.adapters)]
            return JSONResponse({"object": "list", "data": cards})

        @app.post(
            COMPLETIONS,
            summary="completions of one or more prompts",
            response_model=CompletionResponse,
            responses=STREAMED | ERRORS,
        )
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._generate(COMPLETIONS, body, request)

        @app.post(
            CHAT,
            summary="the assistant's next message in a chat",
            response_model=ChatCompletionResponse,
            responses=STREAMED | ERRORS,
        )
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._generate(CHAT, body, request)

        @app.post(
            RESPONSES,
            summary="OpenAI's Responses API, stateless: a chat completion in its shape",
            response_model=ResponseObject,
            responses=STREAMED | ERRORS,
        )
        async def responses(body: ResponsesRequest, request: Request) -> Response:
            return await self._generate(RESPONSES, body, request)

        @app.post(
            MESSAGES,
            summary="Anthropic's Messages API: the assistant's next message",
            response_model=MessageObject,
            responses=STREAMED | ANTHROPIC_ERRORS,
        )
        async def messages(body: MessagesRequest, request: Request) -> Response:
            return await self._generate(MESSAGES, body, request)

        @app.post(
            COUNT_TOKENS,
            summary="the tokens of a Messages request's prompt",
            response_model=TokenCount,
            responses=ANTHROPIC_ERRORS,
        )
        async def count_tokens(body: MessagesInput, request: Request) -> Response:
            return await self._answer(COUNT_TOKENS, request, self._count_tokens(body, request))

        @app.post(
            TOKENIZE,
            summary="a prompt's or a chat's token ids",
            response_model=TokenizeResponse,
            responses=ERRORS,
        )
        async def tokenize(body: TokenizeRequest, request: Request) -> Response:
            return await self._answer(TOKENIZE, request, self._tokenize(body))

        @app.post(
            DETOKENIZE, summary="the text of token ids", response_model=DetokenizeResponse, responses=ERRORS
        )
        async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
            return await self._answer(DETOKENIZE, request, self._detokenize(body))

        if self._settings.lora_runtime_updates:
            self._adapter_routes(app)
        return app

    def _adapter_routes(self, app: FastAPI) -> None:
        """vLLM's routes that change the served LoRA adapters; each answers as vLLM does, in plain text."""

        @app.post(LOAD_LORA, summary="load a LoRA adapter (a peft folder) while serving", responses=ERRORS)
        async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> Response:
            name = body.lora_name

            async def update(model: LoadedModel) -> str:
                await load_adapter(model, name, body.lora_path, self._settings)
                return f"Success: LoRA adapter {name!r} added successfully."

            return await self._updated(LOAD_LORA, request, update)

        @app.post(
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

            return await self._updated(UNLOAD_LORA, request, update)

    async def _updated(
        self, route: str, request: Request, update: Callable[[LoadedModel], Awaitable[str]]
    ) -> Response:
        """An adapter update's answer: vLLM's success text, or the error that left the adapters unchanged."""
        record = self._record(route, request)
        try:
            done = await update(self._state.ready_model())
        except Exception as exc:
            return self._accounting.failed(record, exc)
        record.status = 200
        self._accounting.account(record)
        headers = {"X-Request-Id": record.request_id}
        return PlainTextResponse(done, headers=headers)

    def _ready(self) -> LoadedModel | None:
        try:
            return self._state.ready_model()
        except Draining:
            return None

    def _model_card(self, model: LoadedModel, name: str) -> dict[str, Any]:
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

    # -- the generation routes -----------------------------------------------------------------------------
    async def _generate(self, route: str, body: GenerationBody, request: Request) -> Response:
        """A completion, a chat, a response or a message, accounted as `route`."""
        record = self._record(route, request)
        try:
            model = named_model(self._state, body.model)
            renderer = await self._renderer(_with_header_priority(body, request), model, record)
            label = renderer.plan.constraint_label  # the constrained-request metric's ("tool": a forced call)
            if self._metrics is not None and label is not None:
                self._metrics.on_constrained(label)
            return await self._serving.run(renderer, model, request, record)
        except Exception as exc:
            return self._accounting.failed(record, exc)

    async def _renderer(self, body: GenerationBody, model: LoadedModel, record: CallRecord) -> Renderer[Any]:
        """The body's plan (its route's translation), in the renderer of its route's answers."""
        max_n, vocab, rid = self._settings.max_n, self._vocabulary(model), record.request_id
        if isinstance(body, CompletionRequest):
            plan = await completion_plan(body, model, max_n, record)
            return CompletionRenderer(plan, with_adapter(plan, model, body.model), rid, vocab)
        if isinstance(body, ResponsesRequest):
            response = await responses_plan(body, model, record)
            return ResponsesRenderer(response, with_adapter(response, model, body.model), rid, vocab)
        if isinstance(body, MessagesRequest):
            message = await messages_plan(body, model, record)
            return MessagesRenderer(message, with_adapter(message, model, body.model), rid, vocab)
        chat = await chat_plan(body, model, max_n, record)
        return ChatRenderer(chat, with_adapter(chat, model, body.model), rid, vocab)

    @staticmethod
    def _record(route: str, request: Request) -> CallRecord:
        return CallRecord(rpc=route, request_id=request.scope[REQUEST_ID_KEY])

    def _vocabulary(self, model: LoadedModel) -> Vocabulary:
        vocab = self._vocabularies.get(id(model.tokenizer))
        if vocab is None:
            vocab = self._vocabularies[id(model.tokenizer)] = Vocabulary(model.tokenizer)
        return vocab

    # -- the tokenizer's routes ------------------------------------------------------------------------------
    async def _answer(self, route: str, request: Request, answer: Awaitable[Mapping[str, Any]]) -> Response:
        """A route that answers with one JSON object, or its error, accounted as `route`."""
        record = self._record(route, request)
        try:
            body = await answer
        except Exception as exc:
            return self._accounting.failed(record, exc)
        record.status = 200
        self._accounting.account(record)
        return JSONResponse(body, headers={"X-Request-Id": record.request_id})

    async def _tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        model = named_model(self._state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of prompt and messages")
        if body.messages is not None:
            if body.add_special_tokens:
                raise InvalidRequest(
                    "add_special_tokens applies to a prompt: a chat's special tokens are its template's"
                )
            ids = await asyncio.to_thread(model.chat_prompt, chat_messages(body.messages))
        else:
            special = body.add_special_tokens is not False
            encode = model.tokenizer.encode
            ids = (await asyncio.to_thread(encode, body.prompt, add_special_tokens=special)).ids
        # "" for ids the model has but the tokenizer does not (a vocabulary padded for speed)
        strs = [model.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        limit = model.limits.context_length
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strs}

    async def _count_tokens(self, body: MessagesInput, request: Request) -> TokenCount:
        model = named_model(self._state, body.model)
        counted = self._record(COUNT_TOKENS, request)  # the prompt's; _answer accounts the call
        prompt, _ = await messages_prompt(body, model, counted)
        return {"input_tokens": len(prompt.ids)}

    async def _detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        model = named_model(self._state, body.model)
        ids = token_ids(body.tokens, model.info.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(model.tokenizer.decode, ids)}


__all__ = ["OpenAIApi"]


def _with_header_priority(body: GenerationBody, request: Request) -> GenerationBody:
    """The body, its priority taken from the `X-Request-Priority` header where the body sets none."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is None or body.priority is not None:
        return body
    return body.model_copy(update={"priority": header_priority(header)})

"""The OpenAI-compatible HTTP API: FastAPI on uvicorn, on the server's own event loop, beside gRPC.

    GET  /v1/models              the served model (its bundle's name) and its max_model_len
    POST /v1/completions         prompt(s) as text or token ids; echo, logprobs, n, stream, ...
    POST /v1/chat/completions    messages rendered with the bundle's chat template (serve/api/chat.py)
    GET  /health                 200 while serving, 503 while loading or draining (no token needed)

It shares the gRPC front end's request core (serve/api/validation.py), error kinds (serve/api/http_status.py
maps them), bearer token (`Authorization: Bearer ...`), metrics (the route is the `rpc` label) and drain.
Handlers submit to the same scheduler directly, on the event loop. `X-Request-Id` is taken (or made) and
echoed; it is the request id of the log line and of an INTERNAL error's message. A client that goes away
cancels its request at the next engine step, streamed or not.

n > 1 is served as n requests with seeds derived from (seed, index) (`validation.choice_seed`): the same seed
gives the same n choices whatever else is batched. Choices 1..n-1 are forks of choice 0
(`GenerationRequest.fork_of`): admitted in its prefill group (the usual case), the prompt is prefilled once
and the engine copies its row (KV and first-step logits) into theirs; one left out of the group for lack of
rows is prefilled later on its own (from the prefix cache, when it keeps the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from serve.api.common import CallRecord, LoadedModel
from serve.api.config import ServerSettings
from serve.api.http_status import http_error
from serve.api.metrics import Metrics
from serve.api.openai.errors import Accounting
from serve.api.openai.front_door import FrontDoor
from serve.api.openai.logprobs import Vocabulary, chat_logprobs, completion_logprobs
from serve.api.openai.paths import (
    CHAT,
    COMPLETIONS,
    DETOKENIZE,
    HEALTH,
    MODELS,
    REQUEST_ID_KEY,
    RESPONSES,
    TOKENIZE,
)
from serve.api.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from serve.api.openai.request_events import (
    complete,
    first_event,
    merged,
    plan_usage,
    prepend,
    submit_all,
    until_done,
)
from serve.api.openai.responses import Draft, ResponsesRequest, chat_body, events, from_chat
from serve.api.openai.translate import (
    Plan,
    Prompt,
    chat_messages,
    chat_plan,
    completion_plan,
    named_model,
)
from serve.api.state import ServingState
from serve.api.tool_calls import Reply
from serve.api.tracing import RequestTracer
from serve.api.validation import (
    token_ids,
)
from serve.errors import Draining, InvalidRequest
from serve.scheduling.handles import RequestHandle
from serve.scheduling.request import Completion, Event, FinishEvent, TokenEvent

log = logging.getLogger("textgen.http")

# The error statuses a route may answer with, each in OpenAI's error shape (/openapi.json says so).
ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503, 504)
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

        @app.get(MODELS, summary="the served model", response_model=ModelList, responses=ERRORS)
        async def models(request: Request) -> Response:
            record = CallRecord(rpc=MODELS, request_id=request.scope[REQUEST_ID_KEY])
            try:
                model = self._state.ready_model()
            except Exception as exc:
                return self._accounting.failed(record, exc)
            record.status = 200
            self._accounting.account(record)
            return JSONResponse({"object": "list", "data": [self._model_card(model)]})

        @app.post(
            COMPLETIONS,
            summary="completions of one or more prompts",
            response_model=CompletionResponse,
            responses=ERRORS,
        )
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._completions(body, request)

        @app.post(
            CHAT,
            summary="the assistant's next message in a chat",
            response_model=ChatCompletionResponse,
            responses=ERRORS,
        )
        async def chat(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._chat(body, request)

        @app.post(RESPONSES, summary="OpenAI's Responses API, stateless: a chat completion in its shape")
        async def responses(body: ResponsesRequest, request: Request) -> Response:
            return await self._responses(body, request)

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

        return app

    def _ready(self) -> LoadedModel | None:
        try:
            return self._state.ready_model()
        except Draining:
            return None

    def _model_card(self, model: LoadedModel) -> dict[str, Any]:
        return {
            "id": model.name,
            "object": "model",
            "created": int(model.bundle.root.stat().st_mtime),
            "owned_by": "textgen",
            "max_model_len": model.limits.context_length,
        }

    async def _run(
        self,
        plan: Plan,
        model: LoadedModel,
        request: Request,
        record: CallRecord,
        stream: bool,
        render: Callable[[Plan, list[Completion]], dict[str, Any]],
        chunks: Callable[
            [Plan, AsyncIterator[tuple[int, Event]], list[FinishEvent | None]], AsyncIterator[str]
        ],
    ) -> Response:
        if self._state.draining:  # the drain may have begun while the prompt was being tokenized
            raise Draining("the server is shutting down: retry on another replica")
        handles = submit_all(model, plan.requests)
        headers = {"X-Request-Id": record.request_id}
        if not stream:
            tasks = [asyncio.ensure_future(complete(h)) for h in handles]
            await until_done(tasks, request, handles)
            completions = [t.result() for t in tasks]
            body = render(plan, completions)
            _usage_of, record.finish = plan_usage(plan, [c.finish for c in completions])
            record.text = completions[0].text
            record.status = 200
            self._accounting.account(record)
            return JSONResponse(body, headers=headers)
        events = merged(handles)
        # The response starts with the first event, so a request refused before it (a drain, a failed
        # prefill) gets its HTTP status, and one whose client leaves while queued is cancelled.
        try:
            first = await first_event(events, request)
        except BaseException:
            for handle in handles:
                handle.cancel()
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]  # an async generator
            raise
        finishes: list[FinishEvent | None] = [None] * len(handles)
        sse = self._sse(chunks(plan, prepend(first, events), finishes), handles, record, plan, finishes)
        return StreamingResponse(sse, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def _sse(
        self,
        chunks: AsyncIterator[str],
        handles: Sequence[RequestHandle],
        record: CallRecord,
        plan: Plan,
        finishes: list[FinishEvent | None],
    ) -> AsyncIterator[str]:
        record.status = 200
        try:
            async for chunk in chunks:
                yield chunk
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: starlette cancels the stream
            record.code = "CANCELLED"
            raise
        except Exception as exc:  # after the response began: an error event, then the end of the stream
            error = http_error(exc, record.request_id)
            record.code, record.error = error.code, error.message
            if error.code == "INTERNAL":
                log.error("request %s failed", record.request_id, exc_info=exc)
            yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for handle in handles:
                handle.cancel()  # frees the rows of a stream whose client went away; no effect once finished
            _, record.finish = plan_usage(plan, finishes)
            self._accounting.account(record)

    # -- /v1/completions ------------------------------------------------------------------------------------
    async def _completions(self, body: CompletionRequest, request: Request) -> Response:
        record = CallRecord(rpc=COMPLETIONS, request_id=request.scope[REQUEST_ID_KEY])
        try:
            model = named_model(self._state, body.model)
            plan = await completion_plan(body, model, self._settings.max_n, record)
            created = int(time.time())
            vocab = self._vocabulary(model)
            echo, k, include_usage = plan.echo, plan.logprobs, plan.include_usage
            ident = f"cmpl-{record.request_id}"
            self._count_constraint(plan)

            def render(plan: Plan, done: list[Completion]) -> dict[str, Any]:
                choices = [
                    _completion_choice(i, plan.prompts[i // plan.n], c, echo, k, vocab)
                    for i, c in enumerate(done)
                ]
                usage, _ = plan_usage(plan, [c.finish for c in done])
                return _completion_object(ident, created, model.name, choices) | {"usage": usage}

            async def chunks(
                plan: Plan, events: AsyncIterator[tuple[int, Event]], finishes: list[FinishEvent | None]
            ) -> AsyncIterator[str]:
                offsets = [0] * len(plan.requests)
                started = [False] * len(plan.requests)
                async for index, event in events:
                    if isinstance(event, FinishEvent):
                        finishes[index] = event
                        choice = {"index": index, "text": "", "logprobs": None}
                        choice["finish_reason"] = finish_reason(event.finish_reason)
                        yield _sse_data(
                            _completion_object(ident, created, model.name, [choice]), include_usage
                        )
                        continue
                    text, logprobs = event.text, None
                    prompt = plan.prompts[index // plan.n]
                    if not started[index] and echo:
                        text = prompt.text + text
                    if k is not None:
                        logprobs, offsets[index] = _event_completion_logprobs(
                            vocab, event, prompt if echo and not started[index] else None, offsets[index]
                        )
                    started[index] = True
                    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
                    yield _sse_data(_completion_object(ident, created, model.name, [choice]), include_usage)
                if include_usage:
                    usage, _ = plan_usage(plan, finishes)
                    yield _sse_data(_completion_object(ident, created, model.name, []) | {"usage": usage})

            return await self._run(plan, model, request, record, bool(body.stream), render, chunks)
        except Exception as exc:
            return self._accounting.failed(record, exc)

    # -- the Responses API (serve/api/openai/responses.py) ---------------------------------------------------
    async def _responses(self, body: ResponsesRequest, request: Request) -> Response:
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body))
            model = named_model(self._state, body.model)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            invalid = InvalidRequest(f"{where}: {first['msg']}")
            return self._accounting.failed(self._record(RESPONSES, request), invalid)
        except Exception as exc:
            return self._accounting.failed(self._record(RESPONSES, request), exc)
        answer = await self._chat(chat, request, route=RESPONSES)
        if answer.status_code != 200:  # an error, already in OpenAI's shape and accounted
            return answer
        draft = Draft(body, model.name)
        headers = {"X-Request-Id": request.scope[REQUEST_ID_KEY]}
        if isinstance(answer, StreamingResponse):
            stream = events(draft, answer.body_iterator)
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
            )
        return JSONResponse(from_chat(draft, json.loads(bytes(answer.body))), headers=headers)

    @staticmethod
    def _record(route: str, request: Request) -> CallRecord:
        return CallRecord(rpc=route, request_id=request.scope[REQUEST_ID_KEY])

    def _vocabulary(self, model: LoadedModel) -> Vocabulary:
        vocab = self._vocabularies.get(id(model.tokenizer))
        if vocab is None:
            vocab = self._vocabularies[id(model.tokenizer)] = Vocabulary(model.tokenizer)
        return vocab

    def _count_constraint(self, plan: Plan) -> None:
        """The constrained-request metric, by kind ("tool": a call that tool_choice forces)."""
        if self._metrics is not None and plan.constraint_label is not None:
            self._metrics.on_constrained(plan.constraint_label)

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

    async def _detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        model = named_model(self._state, body.model)
        ids = token_ids(body.tokens, model.info.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(model.tokenizer.decode, ids)}

    # -- /v1/chat/completions --------------------------------------------------------------------------------
    async def _chat(self, body: ChatCompletionRequest, request: Request, route: str = CHAT) -> Response:
        """`route`: the route the call is accounted as (/v1/responses serves its requests through this)."""
        record = CallRecord(rpc=route, request_id=request.scope[REQUEST_ID_KEY])
        try:
            model = named_model(self._state, body.model)
            plan = await chat_plan(body, model, self._settings.max_n, record)
            created = int(time.time())
            vocab = self._vocabulary(model)
            tools, want_logprobs, include_usage = plan.tools, plan.logprobs, plan.include_usage
            ident = f"chatcmpl-{record.request_id}"
            self._count_constraint(plan)

            def render(plan: Plan, done: list[Completion]) -> dict[str, Any]:
                choices = []
                for index, completion in enumerate(done):
                    assert completion.finish is not None
                    logprobs = (
                        {
                            "content": chat_logprobs(
                                vocab, completion.token_ids, completion.logprobs, completion.top_logprobs
                            )
                        }
                        if want_logprobs
                        else None
                    )
                    reply = Reply(tools)
                    reply.feed(completion.text)
                    _, reason = reply.finish(finish_reason(completion.finish.finish_reason))
                    choices.append(
                        {
                            "index": index,
                            "message": reply.message(),
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }
                    )
                usage, _ = plan_usage(plan, [c.finish for c in done])
                return _chat_object(ident, created, model.name, choices, "chat.completion") | {"usage": usage}

            async def chunks(
                plan: Plan, events: AsyncIterator[tuple[int, Event]], finishes: list[FinishEvent | None]
            ) -> AsyncIterator[str]:
                started = [False] * len(plan.requests)
                replies = [Reply(tools) for _ in plan.requests]
                kind = "chat.completion.chunk"

                def chunk(index: int, delta: dict[str, Any], logprobs: Any, reason: str | None) -> str:
                    if not started[index]:
                        first = (
                            {"role": "assistant"}
                            if tools.mode == "none"
                            else {"role": "assistant", "content": None}
                        )
                        delta = {**first, **delta}
                        started[index] = True
                    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
                    return _sse_data(_chat_object(ident, created, model.name, [choice], kind), include_usage)

                async for index, event in events:
                    if isinstance(event, FinishEvent):
                        finishes[index] = event
                        last, reason = replies[index].finish(finish_reason(event.finish_reason))
                        if last:
                            yield chunk(index, last, None, None)
                        yield chunk(index, {}, None, reason)
                        continue
                    delta = replies[index].feed(event.text)
                    logprobs = (
                        {"content": chat_logprobs(vocab, event.token_ids, event.logprobs, event.top_logprobs)}
                        if want_logprobs
                        else None
                    )
                    if delta or logprobs is not None:
                        yield chunk(index, delta, logprobs, None)
                if include_usage:
                    usage, _ = plan_usage(plan, finishes)
                    yield _sse_data(_chat_object(ident, created, model.name, [], kind) | {"usage": usage})

            return await self._run(plan, model, request, record, bool(body.stream), render, chunks)
        except Exception as exc:
            return self._accounting.failed(record, exc)


# --- helpers of the two routes ------------------------------------------------------------------------------


def finish_reason(reason: str) -> str:
    """textgen's finish reason as OpenAI's: EOS and stop sequences are "stop", the limits "length"."""
    return "stop" if reason in ("eos", "stop") else "length"


def _sse_data(obj: dict[str, Any], usage_field: bool = False) -> str:
    if usage_field:
        obj["usage"] = None  # OpenAI: every chunk but the last has "usage": null when usage is asked for
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _completion_object(ident: str, created: int, model: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": ident, "object": "text_completion", "created": created, "model": model, "choices": choices}


def _chat_object(
    ident: str, created: int, model: str, choices: list[dict[str, Any]], kind: str
) -> dict[str, Any]:
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
    }


def _prompt_scores(
    prompt: Prompt, logprobs: list[float], tops: list[Any]
) -> tuple[list[float | None], list[Any]]:
    """The prompt's logprobs as echo shows them: the first token has none."""
    top_list: list[Any] = [None, *tops] if tops else [None] * len(prompt.ids)
    return [None, *logprobs], top_list


def _event_completion_logprobs(
    vocab: Vocabulary, event: TokenEvent, prompt: Prompt | None, offset: int
) -> tuple[CompletionLogprobs, int]:
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[Any] = []
    if prompt is not None:
        plp, ptop = _prompt_scores(prompt, event.prompt_logprobs, event.prompt_top_logprobs)
        ids, lps, tops = list(prompt.ids), plp, ptop
    ids += event.token_ids
    lps += event.logprobs
    tops += event.top_logprobs or [None] * len(event.token_ids)
    return completion_logprobs(vocab, ids, lps, tops, offset)


def _completion_choice(
    index: int, prompt: Prompt, completion: Completion, echo: bool, k: int | None, vocab: Vocabulary
) -> dict[str, Any]:
    assert completion.finish is not None
    text = (prompt.text if echo else "") + completion.text
    logprobs = None
    if k is not None:
        event = TokenEvent(
            completion.token_ids,
            completion.text,
            completion.logprobs,
            completion.top_logprobs,
            completion.prompt_logprobs,
            completion.prompt_top_logprobs,
        )
        logprobs, _ = _event_completion_logprobs(vocab, event, prompt if echo else None, 0)
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(completion.finish.finish_reason),
    }


__all__ = ["OpenAIApi"]

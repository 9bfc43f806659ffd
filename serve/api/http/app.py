"""The HTTP application: FastAPI on uvicorn, on the server's own event loop, beside gRPC, assembled from each
API's router (serve/api/openai/routes.py, serve/api/anthropic/routes.py) and what their handlers share here.

    GET  /health                 200 while serving, 503 while loading or draining (no token needed)

Every route shares the gRPC front end's request core (serve/api/validation.py), error kinds
(serve/api/http_status.py maps them), token (`Authorization: Bearer ...`, or Anthropic's `x-api-key`),
metrics (the route is the `rpc` label) and drain. Handlers submit to the same scheduler directly, on the
event loop. `X-Request-Id` is taken (or made) and echoed; it is the request id of the log line and of an
INTERNAL error's message. A client that goes away cancels its request at the next engine step, streamed or
not.

The generation routes share one handler (`HttpApi.generate`): the body's translation and its route's
renderer, which the route passes in, run by serving.py's skeleton.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from serve.api.common import CallRecord, LoadedModel
from serve.api.config import ServerSettings
from serve.api.http.errors import Accounting
from serve.api.http.fields import SamplingFields
from serve.api.http.front_door import FrontDoor
from serve.api.http.paths import HEALTH, REQUEST_ID_KEY
from serve.api.http.serving import Renderer, Serving
from serve.api.http.translate import named_model
from serve.api.http.vocabulary import Vocabulary
from serve.api.metrics import Metrics
from serve.api.state import ServingState
from serve.api.tracing import RequestTracer
from serve.api.validation import PRIORITY_HEADER, header_priority
from serve.errors import Draining

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

B = TypeVar("B", bound=SamplingFields)
# A generation route's body, the model it names and its call → the body's plan in its route's renderer.
RendererOf = Callable[[B, LoadedModel, CallRecord], Awaitable[Renderer[Any]]]


class HttpApi:
    """What the routes' handlers share, on the server's event loop; `app(*routers)` is the ASGI application
    uvicorn serves."""

    def __init__(
        self,
        state: ServingState,
        settings: ServerSettings,
        metrics: Metrics | None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.state = state
        self.settings = settings
        self.metrics = metrics
        self.accounting = Accounting(settings, metrics, tracer)
        self._serving = Serving(state, self.accounting.account)
        self._vocabularies: dict[int, Vocabulary] = {}
        self._traced = tracer is not None

    def app(self, *routers: APIRouter) -> ASGIApp:
        """The application of the routers' routes and /health, behind the front door."""
        app = FastAPI(
            title="textgen",
            summary="OpenAI-compatible completions and chat completions of a textgen model bundle",
            docs_url=None,
            redoc_url=None,
        )
        self.accounting.install(app)

        @app.get(HEALTH, summary="200 while serving, 503 while loading or draining")
        async def health() -> Response:
            serving = not self.state.draining and self._ready() is not None
            body = {"status": "serving" if serving else "not serving"}
            return JSONResponse(body, status_code=200 if serving else 503)

        for router in routers:
            app.include_router(router)
        token = self.settings.auth_token.get_secret_value() if self.settings.auth_token is not None else None
        refused = self.accounting.refused
        return FrontDoor(app, token, self.settings.max_message_bytes, refused, self._traced)

    def _ready(self) -> LoadedModel | None:
        try:
            return self.state.ready_model()
        except Draining:
            return None

    async def generate(self, route: str, body: B, request: Request, renderer: RendererOf[B]) -> Response:
        """A completion, a chat, a response or a message, accounted as `route`."""
        record = self.record(route, request)
        try:
            model = named_model(self.state, body.model)
            rendered = await renderer(_with_header_priority(body, request), model, record)
            label = rendered.plan.constraint_label  # the constrained-request metric's ("tool": a forced call)
            if self.metrics is not None and label is not None:
                self.metrics.on_constrained(label)
            return await self._serving.run(rendered, model, request, record)
        except Exception as exc:
            return self.accounting.failed(record, exc)

    async def answer(self, route: str, request: Request, answer: Awaitable[Mapping[str, Any]]) -> Response:
        """A route that answers with one JSON object, or its error, accounted as `route`."""
        record = self.record(route, request)
        try:
            body = await answer
        except Exception as exc:
            return self.accounting.failed(record, exc)
        record.status = 200
        self.accounting.account(record)
        return JSONResponse(body, headers={"X-Request-Id": record.request_id})

    @staticmethod
    def record(route: str, request: Request) -> CallRecord:
        return CallRecord(rpc=route, request_id=request.scope[REQUEST_ID_KEY])

    def vocabulary(self, model: LoadedModel) -> Vocabulary:
        vocab = self._vocabularies.get(id(model.tokenizer))
        if vocab is None:
            vocab = self._vocabularies[id(model.tokenizer)] = Vocabulary(model.tokenizer)
        return vocab


def _with_header_priority(body: B, request: Request) -> B:
    """The body, its priority taken from the `X-Request-Priority` header where the body sets none."""
    header = request.headers.get(PRIORITY_HEADER)
    if header is None or body.priority is not None:
        return body
    return body.model_copy(update={"priority": header_priority(header)})


__all__ = ["STREAMED", "HttpApi", "RendererOf"]

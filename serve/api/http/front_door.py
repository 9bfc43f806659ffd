"""The HTTP API's front door, pure ASGI and outermost: request id, bearer token, body size."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable

from fastapi import HTTPException as FastAPIHTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.api.http.paths import (
    ANTHROPIC_ROUTES,
    HEALTH,
    REQUEST_ID_HEADER,
    REQUEST_ID_KEY,
    ROUTES,
)
from serve.api.http_status import TOO_LARGE, HttpError, anthropic_error, http_error
from serve.api.tracing import take_trace_context
from serve.api.validation import (
    check_request_id,
)
from serve.errors import InvalidRequest, Unauthenticated


class BodyTooLarge(FastAPIHTTPException):  # FastAPI's: its body reader re-raises these as they are
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds the server's limit of {limit} bytes")


def error_response(
    error: HttpError, request_id: str, path: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """`error` answered in the shape of the API `path` belongs to: OpenAI's, or Anthropic's."""
    headers = {"X-Request-Id": request_id}
    if path in ANTHROPIC_ROUTES:
        status, body = anthropic_error(error)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(error.body(param, code), status_code=error.status, headers=headers)


class FrontDoor:
    """Pure ASGI, outermost: takes (or makes) the request id and echoes it, keeps the caller's trace context
    when requests are traced, refuses a call without the token (401; `Authorization: Bearer <token>`, or
    Anthropic's `x-api-key: <token>`) and a body over the limit (413), before any routing or parsing."""

    def __init__(
        self,
        app: ASGIApp,
        token: str | None,
        max_body: int,
        on_refused: Callable[[str, str, int, str], None],
        traced: bool = False,
    ) -> None:
        self._app = app
        self._traced = traced
        self._token = None if token is None else token.encode()
        self._max_body = max_body
        self._on_refused = on_refused  # (route, metric code, HTTP status, request id)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        supplied = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = supplied or uuid.uuid4().hex
        path = scope["path"]
        refusal: tuple[HttpError, str | None] | None = None
        try:
            check_request_id(request_id)
        except InvalidRequest as exc:
            request_id = uuid.uuid4().hex
            refusal = http_error(exc), "X-Request-Id"
        scope[REQUEST_ID_KEY] = request_id
        if self._traced:
            take_trace_context((k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"])
        if refusal is None and self._token is not None and path != HEALTH:
            refusal = self._unauthenticated(headers, self._token)
        length = headers.get(b"content-length")
        if refusal is None and length is not None and length.isdigit() and int(length) > self._max_body:
            status, kind, code = TOO_LARGE
            message = f"the request body ({int(length)} bytes) exceeds the server's limit of {self._max_body}"
            refusal = HttpError(status, kind, code, message), None
        if refusal is not None:
            error, param = refusal
            if path in ROUTES:
                self._on_refused(path, error.code, error.status, request_id)
            await error_response(error, request_id, path, param)(scope, receive, send)
            return
        if path in ROUTES and scope["method"] == "POST":
            # The body is JSON whatever the Content-Type says (`curl -d` sends a form's type).
            raw = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*raw, (b"content-type", b"application/json")]}
        await self._app(scope, self._counting(receive), self._echoing(send, request_id, path))

    @staticmethod
    def _unauthenticated(headers: dict[bytes, bytes], token: bytes) -> tuple[HttpError, str | None] | None:
        """The refusal of a call without the token (None: it has it); either header may carry it."""
        bearer, api_key = headers.get(b"authorization"), headers.get(b"x-api-key")
        if bearer is None and api_key is None:
            missing = "missing credentials: send 'Authorization: Bearer <token>' or 'x-api-key: <token>'"
            return http_error(Unauthenticated(missing)), "Authorization"
        # constant time: no timing oracle
        if bearer is not None and hmac.compare_digest(bearer, b"Bearer " + token):
            return None
        if api_key is not None and hmac.compare_digest(api_key, token):
            return None
        wrong = "bearer token in the Authorization" if bearer is not None else "token in the x-api-key"
        return http_error(Unauthenticated(f"invalid {wrong} header")), None

    def _counting(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self._max_body:
                    raise BodyTooLarge(self._max_body)
            return message

        return counted

    @staticmethod
    def _echoing(send: Send, request_id: str, path: str) -> Send:
        """`send`, with the request id in the answer's X-Request-Id header, and on Anthropic's routes in its
        `request-id` too (the anthropic SDK's `_request_id`)."""
        names = (b"x-request-id", b"request-id") if path in ANTHROPIC_ROUTES else (b"x-request-id",)
        value = request_id.encode("latin-1", "replace")

        async def echoed(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() not in names]
                message = {**message, "headers": [*headers, *((name, value) for name in names)]}
            await send(message)

        return echoed

"""The HTTP API's calls accounted, and its error answers in OpenAI's shape (Anthropic's on /v1/messages): a
route's own failures, and what FastAPI refuses before a route runs (an invalid body, an unknown path) or lets
escape (a bug)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from serve.api.common import CallRecord, account
from serve.api.config import ServerSettings
from serve.api.http.front_door import error_response
from serve.api.http.paths import REQUEST_ID_KEY, ROUTES
from serve.api.http_status import TOO_LARGE, HttpError, http_error
from serve.api.metrics import Metrics
from serve.api.tracing import RequestTracer
from serve.errors import InvalidRequest, NotFound

log = logging.getLogger("textgen.http")


class Accounting:
    """Each call's record written once (`account`: its log line, request metric and span), and the error
    answers, which account the call they end."""

    def __init__(
        self, settings: ServerSettings, metrics: Metrics | None, tracer: RequestTracer | None
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._tracer = tracer

    def install(self, app: FastAPI) -> None:
        """FastAPI's own refusals and escaped exceptions answered in OpenAI's shape."""
        app.add_exception_handler(RequestValidationError, self._invalid_body)  # type: ignore[arg-type]
        app.add_exception_handler(HTTPException, self._http_exception)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, self._unexpected)

    def account(self, record: CallRecord) -> None:
        account(record, self._settings.log_prompts, self._metrics, self._tracer)

    def refused(self, route: str, code: str, status: int, request_id: str) -> None:
        """A call the front door or FastAPI refused before its route ran."""
        self.account(CallRecord(rpc=route, request_id=request_id, code=code, status=status))

    def failed(self, record: CallRecord, exc: BaseException, param: str | None = None) -> JSONResponse:
        error = http_error(exc, record.request_id or None)
        code = "model_not_found" if isinstance(exc, NotFound) else None
        record.code, record.status, record.error = error.code, error.status, error.message
        if error.code == "INTERNAL":
            log.error("request %s failed", record.request_id, exc_info=exc)
        self.account(record)
        return error_response(error, record.request_id, record.rpc, param, code)

    async def _invalid_body(self, request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request body"}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        where = ".".join(loc)
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
            loc, where = [], ""
        else:
            shown = json.dumps(first["input"], default=repr)[:80] if "input" in first else ""
            got = f" (got {shown})" if shown and loc else ""
            message = f"{where or 'body'}: {first['msg']}{got}"
        record = CallRecord(rpc=request.url.path, request_id=request.scope.get(REQUEST_ID_KEY, ""))
        if record.rpc not in ROUTES:
            return error_response(
                http_error(InvalidRequest(message)), record.request_id, record.rpc, where or None
            )
        return self.failed(record, InvalidRequest(message), where or None)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        request_id = request.scope.get(REQUEST_ID_KEY, "")
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see GET /openapi.json"
        else:
            message = str(exc.detail)
        error = HttpError(exc.status_code, "invalid_request_error", "INVALID_ARGUMENT", message)
        if request.url.path in ROUTES:
            code = TOO_LARGE[2] if exc.status_code == 413 else error.code
            self.refused(request.url.path, code, exc.status_code, request_id)
        response = error_response(error, request_id, request.url.path)
        response.headers.update(exc.headers or {})
        return response

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        request_id = request.scope.get(REQUEST_ID_KEY, "")
        log.error("request %s failed", request_id, exc_info=exc)
        return error_response(http_error(exc, request_id or None), request_id, request.url.path)

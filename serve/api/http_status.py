"""The one place that turns an error's kind into an HTTP status and OpenAI's error `type`.

| ErrorKind | HTTP | OpenAI `type` | metric `code` |
|---|---|---|---|
| INVALID_REQUEST | 400 | invalid_request_error | INVALID_ARGUMENT |
| NOT_FOUND (a model or adapter not served) | 404 | invalid_request_error | NOT_FOUND |
| UNAUTHENTICATED | 401 | authentication_error | UNAUTHENTICATED |
| OVERLOADED | 429 | rate_limit_error | RESOURCE_EXHAUSTED |
| CANCELLED | 499 (the client is gone: nobody reads it) | cancelled | CANCELLED |
| INTERNAL | 500, the message carries the request id | server_error | INTERNAL |
| UNAVAILABLE | 503 (draining, or the model still loading) | service_unavailable | UNAVAILABLE |
| DEADLINE_EXCEEDED | 504 | timeout | DEADLINE_EXCEEDED |

The metric `code` is the gRPC status name of the same kind (`serve.api.grpc_status`), so
`textgen_requests_total{code=...}` and the alert rules read both front ends alike; the HTTP route is the
`rpc` label. Two HTTP-only refusals have no ErrorKind: an unknown route (404, invalid_request_error,
NOT_FOUND) and a body over the size limit (413, invalid_request_error, RESOURCE_EXHAUSTED, as gRPC refuses
an oversized message).

Anthropic's Messages API (/v1/messages) names the same errors its own way (`anthropic_error`): by status,
invalid_request_error (400), authentication_error (401), not_found_error (404), request_too_large (413),
rate_limit_error (429), overloaded_error (529, for a server that cannot take the request now: 503 here),
timeout_error (504) and api_error for the server's other faults.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from serve.api.grpc_status import GRPC_CODES
from serve.errors import ErrorKind, describe


class HttpError(NamedTuple):
    status: int
    type: str
    code: str  # the metric's code label (a gRPC status name)
    message: str

    def body(self, param: str | None = None, code: str | None = None) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": param, "code": code}}


HTTP_STATUSES: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.UNAUTHENTICATED: (401, "authentication_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.CANCELLED: (499, "cancelled"),
    ErrorKind.INTERNAL: (500, "server_error"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    ErrorKind.DEADLINE_EXCEEDED: (504, "timeout"),
}
NOT_FOUND = (404, "invalid_request_error", "NOT_FOUND")
TOO_LARGE = (413, "invalid_request_error", "RESOURCE_EXHAUSTED")


# status -> Anthropic's (status, error type); any other keeps its number, an invalid_request_error if it is
# the client's (4xx), an api_error if the server's.
ANTHROPIC_ERRORS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),  # draining or loading: Anthropic's clients retry an overloaded server
    504: (504, "timeout_error"),
}


def anthropic_error(error: HttpError) -> tuple[int, dict[str, Any]]:
    """The status and body of `error` in Anthropic's shape."""
    other = "invalid_request_error" if error.status < 500 else "api_error"
    status, kind = ANTHROPIC_ERRORS.get(error.status, (error.status, other))
    return status, {"type": "error", "error": {"type": kind, "message": error.message}}


def http_error(exc: BaseException, request_id: str | None = None) -> HttpError:
    """The status, type, metric code and message an HTTP client sees for an exception raised while serving
    its request."""
    kind, message = describe(exc, request_id)
    status, kind_type = HTTP_STATUSES[kind]
    return HttpError(status, kind_type, GRPC_CODES[kind].name, message)

"""The one place that turns an error's kind into a gRPC status code."""

from __future__ import annotations

import grpc

from serve.errors import ErrorKind, describe

GRPC_CODES = {
    ErrorKind.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def grpc_status(exc: BaseException, request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """The status and message a gRPC client sees for an exception raised while serving its request."""
    kind, message = describe(exc, request_id)
    return GRPC_CODES[kind], message

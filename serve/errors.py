"""Domain exceptions and their one mapping to gRPC status codes.

Every layer raises these; only the API layer turns them into gRPC statuses, through `grpc_status`.
"""

from __future__ import annotations

import grpc


class TextgenError(Exception):
    """Base class: the message is shown to the client, so it says what was wrong and what is allowed."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequest(TextgenError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class QueueFull(TextgenError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(TextgenError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(TextgenError):
    code = grpc.StatusCode.CANCELLED


class Draining(TextgenError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(TextgenError):
    code = grpc.StatusCode.UNAUTHENTICATED


class EngineFailure(TextgenError):
    code = grpc.StatusCode.INTERNAL


class BundleError(TextgenError):
    """A bundle that cannot be served: the message names the file and the problem."""


def grpc_status(exc: BaseException, request_id: str | None = None) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for an exception raised while serving its request.

    INTERNAL messages carry the request id so an operator can find the request in the server's logs.
    """
    if isinstance(exc, TextgenError):
        code, message = exc.code, str(exc)
    else:
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    if code is grpc.StatusCode.INTERNAL and request_id and request_id not in message:
        message = f"{message} (request_id {request_id})"
    return code, message

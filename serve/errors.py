"""Domain exceptions, each of a protocol-neutral kind.

Every layer raises these; each front end maps a kind to its protocol's status in one place
(serve/api/grpc_status.py for gRPC), so nothing below the front end knows any protocol.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """What went wrong, as a client would act on it."""

    INVALID_REQUEST = "invalid_request"  # fix the request; retrying it as it is fails again
    NOT_FOUND = "not_found"  # it names a model or LoRA adapter this server does not serve
    OVERLOADED = "overloaded"  # the queue is full: retry later
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"  # the server is shutting down: retry elsewhere
    UNAUTHENTICATED = "unauthenticated"
    INTERNAL = "internal"  # the server's fault; the message carries the request id


class TextgenError(Exception):
    """Base class: the message is shown to the client, so it says what was wrong and what is allowed."""

    kind: ErrorKind = ErrorKind.INTERNAL


class InvalidRequest(TextgenError):
    kind = ErrorKind.INVALID_REQUEST


class NotFound(TextgenError):
    kind = ErrorKind.NOT_FOUND


class QueueFull(TextgenError):
    kind = ErrorKind.OVERLOADED


class DeadlineExceeded(TextgenError):
    kind = ErrorKind.DEADLINE_EXCEEDED


class Cancelled(TextgenError):
    kind = ErrorKind.CANCELLED


class Draining(TextgenError):
    kind = ErrorKind.UNAVAILABLE


class Unauthenticated(TextgenError):
    kind = ErrorKind.UNAUTHENTICATED


class EngineFailure(TextgenError):
    kind = ErrorKind.INTERNAL


class BundleError(TextgenError):
    """A bundle that cannot be served: the message names the file and the problem."""


def describe(exc: BaseException, request_id: str | None = None) -> tuple[ErrorKind, str]:
    """The kind and message a client sees for an exception raised while serving its request.

    INTERNAL messages carry the request id so an operator can find the request in the server's logs.
    """
    if isinstance(exc, TextgenError):
        kind, message = exc.kind, str(exc)
    else:
        kind, message = ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    if kind is ErrorKind.INTERNAL and request_id and request_id not in message:
        message = f"{message} (request_id {request_id})"
    return kind, message

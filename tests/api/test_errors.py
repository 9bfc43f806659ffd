"""Errors know no protocol; the gRPC front end maps each kind to its status in one place."""

from __future__ import annotations

import grpc
import pytest

from serve.api.grpc_status import GRPC_CODES, grpc_status
from serve.errors import (
    BundleError,
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineFailure,
    ErrorKind,
    InvalidRequest,
    QueueFull,
    TextgenError,
    Unauthenticated,
    describe,
)


def test_every_kind_has_a_grpc_status() -> None:
    assert set(GRPC_CODES) == set(ErrorKind)
    assert len(set(GRPC_CODES.values())) == len(ErrorKind)  # no two kinds look alike to a gRPC client


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
        (Cancelled, grpc.StatusCode.CANCELLED),
        (Draining, grpc.StatusCode.UNAVAILABLE),
        (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
        (EngineFailure, grpc.StatusCode.INTERNAL),
        (BundleError, grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_reaches_a_grpc_client_with_its_status(
    error: type[TextgenError], code: grpc.StatusCode
) -> None:
    assert grpc_status(error("what was wrong"), "r1")[0] is code


def test_internal_messages_carry_the_request_id_and_others_stay_as_they_are() -> None:
    assert describe(EngineFailure("the engine failed"), "r7") == (
        ErrorKind.INTERNAL,
        "the engine failed (request_id r7)",
    )
    assert (
        describe(EngineFailure("request r7: the engine failed"), "r7")[1] == "request r7: the engine failed"
    )
    assert describe(InvalidRequest("top_p must be in (0, 1]"), "r7") == (
        ErrorKind.INVALID_REQUEST,
        "top_p must be in (0, 1]",
    )
    kind, message = describe(KeyError("x"), "r8")
    assert kind is ErrorKind.INTERNAL and message == "internal error: KeyError: 'x' (request_id r8)"

"""Transport security for the gRPC port: bearer-token auth (an interceptor) and TLS / mTLS credentials."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from serve.api.config import ServerSettings
from serve.api.grpc_status import grpc_status
from serve.errors import TextgenError, Unauthenticated

HEALTH_EXEMPT_PREFIX = "/grpc.health.v1.Health/"  # kubelet gRPC probes cannot send an authorization header


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless it carries `authorization: Bearer <token>`."""

    def __init__(self, token: str, on_refused: Callable[[str], None] | None = None) -> None:
        self._expected = f"Bearer {token}".encode()
        self._on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_EXEMPT_PREFIX):
            return handler
        supplied = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if supplied is None:
            refusal = Unauthenticated("missing credentials: send metadata 'authorization: Bearer <token>'")
        elif hmac.compare_digest(str(supplied).encode(), self._expected):  # constant time: no timing oracle
            return handler
        else:
            refusal = Unauthenticated("invalid bearer token in the authorization metadata")
        if self._on_refused is not None:
            self._on_refused(method.rsplit("/", 1)[-1])
        return _refusing_handler(handler, refusal)


def _refusing_handler(handler: grpc.RpcMethodHandler, refusal: TextgenError) -> grpc.RpcMethodHandler:
    code, message = grpc_status(refusal)

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    factory = factories[(handler.request_streaming, handler.response_streaming)]
    return factory(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def server_credentials(settings: ServerSettings) -> grpc.ServerCredentials | None:
    if settings.tls_cert is None or settings.tls_key is None:
        return None
    client_ca = settings.tls_client_ca.read_bytes() if settings.tls_client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(settings.tls_key.read_bytes(), settings.tls_cert.read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )

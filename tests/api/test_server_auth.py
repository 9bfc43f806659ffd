"""Token auth and TLS / mTLS on a real gRPC port: right credentials pass, wrong ones are refused.

The service behind the interceptor is the generated base servicer (every RPC UNIMPLEMENTED), so a call that
gets UNIMPLEMENTED went through authentication; the full server with a model is covered in test_client.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from server_tools import LoopThread, Pki, make_pki, rpc_error

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.auth import TokenAuthInterceptor, server_credentials
from serve.api.config import ServerSettings

TOKEN = "correct horse battery staple"
Serve = Callable[[ServerSettings], int]
TLS_NAME = [("grpc.ssl_target_name_override", "localhost")]


@pytest.fixture(scope="module")
def pki() -> Pki:
    return make_pki()


@pytest.fixture(scope="module")
def pki_files(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return pki.write(tmp_path_factory.mktemp("pki"))


async def _serve(settings: ServerSettings) -> tuple[grpc.aio.Server, int]:
    interceptors = []
    if settings.auth_token is not None:
        interceptors.append(TokenAuthInterceptor(settings.auth_token.get_secret_value()))
    server = grpc.aio.server(interceptors=interceptors)
    pb_grpc.add_TextGenerationServicer_to_server(pb_grpc.TextGenerationServicer(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    credentials = server_credentials(settings)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


@pytest.fixture
def serve(loop: LoopThread) -> Iterator[Callable[[ServerSettings], int]]:
    servers: list[grpc.aio.Server] = []

    def start(settings: ServerSettings) -> int:
        server, port = loop.run(_serve(settings))
        servers.append(server)
        return port

    yield start
    for server in servers:
        loop.run(server.stop(None))


def _health(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_token_auth_on_unary_and_stream_calls(serve: Serve, tmp_path: Path) -> None:
    port = serve(ServerSettings(bundle=tmp_path, auth_token=TOKEN))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        missing = rpc_error(lambda: stub.GetModelInfo(pb.GetModelInfoRequest()))
        assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing credentials" in missing.details()
        wrong = rpc_error(
            lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("authorization", "x")])
        )
        assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "invalid bearer token" in wrong.details()
        stream = rpc_error(
            lambda: stub.GenerateStream(
                pb.GenerateRequest(text="hi"), metadata=[("authorization", "Bearer no")]
            )
        )
        assert stream.code() == grpc.StatusCode.UNAUTHENTICATED
        right = [("authorization", f"Bearer {TOKEN}")]
        passed = rpc_error(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=right))
        assert passed.code() == grpc.StatusCode.UNIMPLEMENTED  # authenticated, then reached the servicer
        # Kubernetes' gRPC probes cannot send headers: health needs no token.
        assert _health(channel) == grpc.StatusCode.OK


def test_tls_accepts_the_right_ca_and_refuses_others(
    serve: Serve, pki: Pki, pki_files: dict[str, Path], tmp_path: Path
) -> None:
    settings = ServerSettings(
        bundle=tmp_path, tls_cert=pki_files["server_cert"], tls_key=pki_files["server_key"]
    )
    target = f"127.0.0.1:{serve(settings)}"
    trusted = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert)
    with grpc.secure_channel(target, trusted, options=TLS_NAME) as channel:
        assert _health(channel) == grpc.StatusCode.OK
    untrusted = grpc.ssl_channel_credentials(root_certificates=pki.stranger_ca.cert)
    with grpc.secure_channel(target, untrusted, options=TLS_NAME) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(target) as plaintext:
        assert _health(plaintext) == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_from_the_client_ca(
    serve, pki: Pki, pki_files, tmp_path: Path
) -> None:
    settings = ServerSettings(
        bundle=tmp_path,
        tls_cert=pki_files["server_cert"],
        tls_key=pki_files["server_key"],
        tls_client_ca=pki_files["ca"],
    )
    target = f"127.0.0.1:{serve(settings)}"
    cases = {
        (pki.client.key, pki.client.cert): grpc.StatusCode.OK,
        (None, None): grpc.StatusCode.UNAVAILABLE,
        (pki.stranger_client.key, pki.stranger_client.cert): grpc.StatusCode.UNAVAILABLE,
    }
    for (key, cert), expected in cases.items():
        credentials = grpc.ssl_channel_credentials(pki.ca.cert, key, cert)
        with grpc.secure_channel(target, credentials, options=TLS_NAME) as channel:
            assert _health(channel) == expected, f"client cert {cert is not None}"

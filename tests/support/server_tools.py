"""Test helpers for the gRPC server: an event loop on a thread (so tests use plain blocking stubs) and a
throwaway PKI made with `cryptography` for TLS and mTLS tests."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

T = TypeVar("T")


class LoopThread:
    """An asyncio loop running on a daemon thread; `run` executes a coroutine there and waits for it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def rpc_error(call: Any) -> grpc.RpcError:
    """The error a blocking call raised; fails the test if it succeeded."""
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            for _ in result:
                pass
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded; an error was expected")


# --- PKI ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Issued:
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class Pki:
    """A CA with a server (localhost) and a client certificate, plus an unrelated CA and its client."""

    ca: Issued
    server: Issued
    client: Issued
    stranger_ca: Issued
    stranger_client: Issued

    def write(self, directory: Path) -> dict[str, Path]:
        files = {
            "ca": self.ca.cert,
            "server_cert": self.server.cert,
            "server_key": self.server.key,
            "client_cert": self.client.cert,
            "client_key": self.client.key,
            "stranger_ca": self.stranger_ca.cert,
            "stranger_cert": self.stranger_client.cert,
            "stranger_key": self.stranger_client.key,
        }
        paths = {}
        for name, data in files.items():
            paths[name] = directory / f"{name}.pem"
            paths[name].write_bytes(data)
        return paths


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    signer: ec.EllipticCurvePrivateKey,
    ca: bool,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
        )
    return builder.sign(signer, hashes.SHA256())


def _issued(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem)


def _ca(common_name: str) -> tuple[Issued, ec.EllipticCurvePrivateKey, x509.Name]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(common_name, key, _name(common_name), key, ca=True)
    return _issued(cert, key), key, cert.subject


def _leaf(common_name: str, ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    return _issued(_certificate(common_name, key, ca_name, ca_key, ca=False), key)


def make_pki() -> Pki:
    ca, ca_key, ca_name = _ca("textgen test CA")
    stranger_ca, stranger_key, stranger_name = _ca("someone else's CA")
    return Pki(
        ca=ca,
        server=_leaf("localhost", ca_key, ca_name),
        client=_leaf("client", ca_key, ca_name),
        stranger_ca=stranger_ca,
        stranger_client=_leaf("client", stranger_key, stranger_name),
    )


def free_port() -> int:
    """A port free on the loopback interface now (the HTTP API's port 0 means off, not any port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])

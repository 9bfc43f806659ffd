"""uvicorn serving the HTTP API on the server's own event loop: the socket, start and stop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from serve.api.config import ConfigError, ServerSettings


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: textgen-serve's own drive the drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, so asyncio's transports set TCP_NODELAY on the accepted sockets (it checks the
    # protocol); with Nagle's algorithm a stream's small chunks wait for the client's delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen for HTTP on {host}:{port}: {exc}") from None
    sock.setblocking(False)
    return sock


class HttpServer:
    """uvicorn serving an ASGI app on the running loop: `await start()` (its port), `await stop(grace)`."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self._settings = settings
        tls: dict[str, Any] = {}
        if settings.tls_cert is not None and settings.tls_key is not None:
            tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
            if settings.tls_client_ca is not None:
                tls |= {"ssl_ca_certs": str(settings.tls_client_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        self._config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http="httptools",  # the C parser: less CPU per request and per SSE chunk than h11
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=None,
            **tls,
        )
        self._server = _Server(self._config)
        self._task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    async def start(self) -> int:
        self._socket = _bind(self._settings.http_host, self._settings.http_port)
        self.port = int(self._socket.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what start-up raised
                raise ConfigError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.005)
        return self.port

    async def stop(self, grace: float | None) -> None:
        """Stop listening; open responses get `grace` seconds (None: none) to end."""
        if self._task is None:
            return
        self._config.timeout_graceful_shutdown = None if grace is None else max(int(grace), 1)
        self._server.should_exit = True
        if grace is None:
            self._server.force_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self._task), timeout=(grace or 0) + 5)
        if not self._task.done():
            self._task.cancel()
        if self._socket is not None:
            self._socket.close()
        self._task = None


__all__ = ["HttpServer"]

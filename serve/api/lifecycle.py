"""The server process's life: the metrics endpoint, the gRPC server (service, health, reflection, auth, TLS)
and the HTTP API, loading the model, and the drain.

Start-up order: metrics endpoint, gRPC port (health answers NOT_SERVING while the model loads), the engine
process given its spec (started ahead by `textgen-serve`) while the tokenizer is loaded here, the engine's
warm-up, scheduler, then SERVING. SIGTERM/SIGINT: NOT_SERVING, new requests UNAVAILABLE, running requests
get `grace_seconds` to finish, then the process exits 0 (docs/deploy.md says what a gRPC client sees at each
moment). Both front ends read one `ServingState`, which only this module changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.auth import TokenAuthInterceptor, server_credentials
from serve.api.common import LoadedModel
from serve.api.config import ConfigError, ServerSettings
from serve.api.grpc_service import SERVICE_NAME, DecodeGuardInterceptor, TextGenerationService
from serve.api.http.server import HttpServer
from serve.api.http_app import http_api
from serve.api.loading import load_model
from serve.api.metrics import Metrics
from serve.api.state import ServingState
from serve.api.tracing import RequestTracer
from serve.process import freeze_startup_objects
from serve.scheduling.engine_client import EngineProcess, ProcessScheduler
from serve.scheduling.messages import EngineWrap

log = logging.getLogger("textgen.server")

# After the scheduler has drained, handlers only have their last messages to write.
STOP_GRACE_SECONDS = 5.0


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class TextgenServer:
    """The whole server: `await start()`, then `await drain()`; `serve()` drives it from signals."""

    def __init__(
        self,
        settings: ServerSettings,
        metrics: Metrics | None = None,
        engine_wrap: EngineWrap | None = None,
        freeze_heap: bool = False,
        tracer: RequestTracer | None = None,
        engine_process: EngineProcess | None = None,
    ) -> None:
        """`engine_wrap` wraps the engine before the scheduler gets it (tests: a slow or failing step).
        `freeze_heap`: once loaded, freeze this process's start-up objects (`freeze_startup_objects`); for a
        process that runs one server for its life, not for a test process that starts many. `tracer`: where
        request spans go (default: `otlp_traces_endpoint`'s exporter, or none). `engine_process`: the engine
        process started ahead (`textgen-serve` starts it before importing this module); None: one is started
        when the model loads."""
        self.settings = settings
        self._engine_wrap = engine_wrap
        self._engine_process = engine_process
        self._freeze_heap = freeze_heap
        # Made in start(); completes with the reason if the engine process dies: the server then stops.
        self.failed: asyncio.Future[str] | None = None
        self.metrics = metrics if metrics is not None else Metrics()
        endpoint = settings.otlp_traces_endpoint
        self.tracer = tracer if tracer is not None or endpoint is None else RequestTracer.otlp(endpoint)
        self.state = ServingState()
        self.service = TextGenerationService(self.state, settings, self.metrics, self.tracer)
        self.health = health.aio.HealthServicer()
        self.port = 0
        self.http_port = 0  # 0: the HTTP API is off (http_port 0)
        self._http: HttpServer | None = None
        self.metrics_port = 0
        self._metrics_server: WSGIServer | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._server: grpc.aio.Server | None = None  # made in start(): grpc.aio binds it to the running loop

    def _build_server(self) -> grpc.aio.Server:
        interceptors: list[grpc.aio.ServerInterceptor] = [DecodeGuardInterceptor()]
        if self.settings.auth_token is not None:  # outermost: nothing runs for an unauthenticated call
            token = self.settings.auth_token.get_secret_value()
            interceptors.insert(0, TokenAuthInterceptor(token, self._count_unauthenticated))
        limit = self.settings.max_message_bytes
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        )
        pb_grpc.add_TextGenerationServicer_to_server(self.service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        return server

    def _count_unauthenticated(self, rpc: str) -> None:
        self.metrics.on_request_done(rpc, grpc.StatusCode.UNAUTHENTICATED.name, 0.0)

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    def _bind(self, server: grpc.aio.Server) -> int:
        address = _address(self.settings.host, self.settings.port)
        credentials = server_credentials(self.settings)
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {address}: {exc}") from None
        if port == 0:
            raise ConfigError(f"cannot listen on {address}: the address is in use or not local")
        return port

    async def start(self) -> None:
        """Listen (health NOT_SERVING), load and warm up the model, then report SERVING."""
        self.failed = asyncio.get_running_loop().create_future()
        self.metrics_port = self._start_metrics()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server = self._build_server()
        self.port = self._bind(self._server)
        await self._server.start()
        log.info(
            "listening on %s (tls=%s)", _address(self.settings.host, self.port), self.settings.tls_enabled
        )
        if self.settings.http_port:
            self._http = http_api(self.state, self.settings, self.metrics, self.tracer)
            self.http_port = await self._http.start()
            scheme = "https" if self.settings.tls_enabled else "http"
            log.info(
                "OpenAI-compatible API on %s://%s", scheme, _address(self.settings.http_host, self.http_port)
            )
        model = await load_model(self.settings, self.metrics, self._engine_wrap, self._engine_process)
        if isinstance(model.scheduler, ProcessScheduler):
            assert model.scheduler.exited is not None
            model.scheduler.exited.add_done_callback(self._engine_exited)
            if model.scheduler.pid is not None:
                self.metrics.watch_process("engine", model.scheduler.pid)
        self.state.loaded(model)
        self._publish_model_info(model)
        if self._freeze_heap:
            log.info("froze %d start-up objects", freeze_startup_objects())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.metrics.set_ready(True)
        log.info("serving %s as %s", model.bundle.manifest.model_name, ", ".join(model.names))

    def _engine_exited(self, exited: asyncio.Future[str]) -> None:
        """The engine process died: nothing can be served any more; say so and let `serve` stop."""
        self.state.start_draining()
        self.metrics.set_ready(False)
        self._health_task = asyncio.create_task(self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        if self.failed is not None and not self.failed.done():
            self.failed.set_result(exited.result())

    def _start_metrics(self) -> int:
        address = _address(self.settings.metrics_host, self.settings.metrics_port)
        try:
            server, _thread = self.metrics.start_http_server(
                self.settings.metrics_port, self.settings.metrics_host
            )
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {address}: {exc}") from None
        self._metrics_server = server
        port = int(server.server_port)
        log.info("metrics on http://%s/metrics", _address(self.settings.metrics_host, port))
        return port

    def _publish_model_info(self, model: LoadedModel) -> None:
        manifest = model.bundle.manifest
        provider = model.info.providers[0] if model.info.providers else "unknown"
        self.metrics.set_model_info(model.name, manifest.dtype, manifest.quantization, provider)

    async def drain(self) -> None:
        """NOT_SERVING (gRPC health, HTTP /health 503), refuse new work (UNAVAILABLE, HTTP 503), let running
        requests (streams of either front end) finish within grace_seconds, stop."""
        log.info("draining: up to %.1f s for running requests", self.settings.grace_seconds)
        self.state.start_draining()
        self.metrics.set_ready(False)
        await self.health.enter_graceful_shutdown()
        if self.state.model is not None:
            await self.state.model.scheduler.drain(self.settings.grace_seconds)
        await self._stop_server(STOP_GRACE_SECONDS)
        log.info("stopped")

    async def stop(self) -> None:
        """Immediate stop (tests, failed start-up): running calls are cancelled."""
        self.state.start_draining()
        if self.state.model is not None:
            await self.state.model.scheduler.drain(0.0)
        await self._stop_server(None)

    async def _stop_server(self, grace: float | None) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.stop(grace)
        if self._server is not None:
            self.state.stop_grpc()
            await self._server.stop(grace)
        await self._stop_metrics()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # sends the spans still batched

    async def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)  # waits up to one poll interval (0.5 s)
            server.server_close()


async def serve(settings: ServerSettings, engine_process: EngineProcess | None = None) -> int:
    """Run until SIGTERM or SIGINT, then drain (exit status 0); a failed start-up stops the server and
    re-raises; if the engine process dies, the server stops at once (exit status 1). `engine_process`: the
    engine process, started ahead."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = TextgenServer(settings, freeze_heap=True, engine_process=engine_process)
    starting = asyncio.create_task(server.start())
    signalled = asyncio.create_task(stop.wait())
    done, _pending = await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if starting not in done:  # a signal during start-up: no request has been admitted yet
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await server.stop()
        return 0
    try:
        starting.result()
    except BaseException:
        signalled.cancel()
        await server.stop()
        raise
    assert server.failed is not None
    ended: set[asyncio.Future[Any]] = {signalled, server.failed}
    await asyncio.wait(ended, return_when=asyncio.FIRST_COMPLETED)
    if server.failed.done():
        signalled.cancel()
        log.error("%s; the server stops", server.failed.result())
        await server.stop()
        return 1
    await server.drain()
    return 0

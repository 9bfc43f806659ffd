"""The gRPC server: the TextGeneration service, health, reflection, auth, TLS and the drain lifecycle.

Start-up order: metrics endpoint, gRPC port (health answers NOT_SERVING while the model loads), bundle,
engine and its warm-up, scheduler, then SERVING. SIGTERM/SIGINT: NOT_SERVING, new requests UNAVAILABLE,
running requests get `grace_seconds` to finish, then the process exits 0.

Every failure a client sees goes through `serve.api.grpc_status`; nothing else picks status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIServer

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.auth import TokenAuthInterceptor, server_credentials
from serve.api.common import CallRecord, LoadedModel, account, chat_template
from serve.api.config import ConfigError, ServerSettings
from serve.api.grpc_requests import generation_request, prompt_ids, reject_unknown_fields
from serve.api.grpc_status import grpc_status
from serve.api.metrics import Metrics
from serve.api.openai.http_server import HttpServer, http_api
from serve.api.sizing import KvSizing, size_kv_cache
from serve.api.tracing import RequestTracer, take_trace_context
from serve.api.validation import RequestLimits, check_request_id, token_ids
from serve.bundle import Bundle, load_bundle
from serve.engine.sampling import Alternatives
from serve.engine.types import EngineInfo, EngineSettings, SessionConfig
from serve.errors import Draining, InvalidRequest
from serve.process import (
    allowed_cpus,
    beside,
    check_cpus,
    engine_cpus,
    format_cpu_list,
    freeze_startup_objects,
    pin_process,
)
from serve.scheduling.engine_client import ProcessScheduler
from serve.scheduling.handles import RequestHandle
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.messages import EngineSpec, EngineWrap
from serve.scheduling.request import Completion, Event, FinishEvent
from serve.scheduling.scheduler import open_in_thread

log = logging.getLogger("textgen.server")

__all__ = ["CallRecord", "LoadedModel", "TextgenServer", "chat_template", "serve"]

M = TypeVar("M", bound=Message)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name
# After the scheduler has drained, handlers only have their last messages to write.
STOP_GRACE_SECONDS = 5.0


def server_version() -> str:
    try:
        return importlib.metadata.version("textgen-serving")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def batch_invariant(bundle_invariant: bool, providers: tuple[str, ...]) -> bool:
    """What GetModelInfo claims: the bundle's batch invariance, which export verification measures with ONNX
    Runtime's CPU kernels. On a GPU (CUDA, TensorRT) the libraries may choose other kernels for one row than
    for many, which nothing here has measured: no claim there."""
    return bundle_invariant and bool(providers) and providers[0] == "CPUExecutionProvider"


FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
}


def finish_reason(reason: str) -> pb.FinishReason:
    return FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def top_logprobs(alternatives: list[Alternatives]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=a.token_ids, logprobs=a.logprobs) for a in alternatives]


def usage(finish: FinishEvent) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        cached_prompt_tokens=finish.cached_prompt_tokens,
    )


def generate_response(request_id: str, completion: Completion) -> pb.GenerateResponse:
    """A finished completion as `Generate`'s reply."""
    finish = completion.finish
    assert finish is not None  # every generation ends with a FinishEvent or an exception
    return pb.GenerateResponse(
        request_id=request_id,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=finish_reason(finish.finish_reason),
        usage=usage(finish),
        logprobs=completion.logprobs,
        top_logprobs=top_logprobs(completion.top_logprobs),
        prompt_logprobs=completion.prompt_logprobs,
        prompt_top_logprobs=top_logprobs(completion.prompt_top_logprobs),
        queue_seconds=finish.queue_seconds,
        time_to_first_token_seconds=finish.ttft_seconds,
        total_seconds=finish.total_seconds,
        constraint_incomplete=finish.constraint_incomplete,
    )


def stream_message(request_id: str, event: Event) -> pb.GenerateStreamResponse:
    """One `GenerateStream` message: tokens and their text, or the last one with finish reason and usage."""
    if isinstance(event, FinishEvent):
        return pb.GenerateStreamResponse(
            request_id=request_id,
            finish_reason=finish_reason(event.finish_reason),
            usage=usage(event),
            constraint_incomplete=event.constraint_incomplete,
        )
    return pb.GenerateStreamResponse(
        request_id=request_id,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=event.logprobs,
        top_logprobs=top_logprobs(event.top_logprobs),
        prompt_logprobs=event.prompt_logprobs,
        prompt_top_logprobs=top_logprobs(event.prompt_top_logprobs),
    )


# --- the loaded model ---------------------------------------------------------------------------------------


def request_limits(settings: ServerSettings, info: EngineInfo, max_total_tokens: int) -> RequestLimits:
    # A KV slot, or the whole batch budget when that is smaller, bounds prompt + new tokens.
    context = max_total_tokens
    return RequestLimits(
        vocab_size=info.vocab_size,
        context_length=context,
        max_prompt_tokens=min(settings.max_prompt_tokens or context - 1, context - 1),
        default_max_new_tokens=settings.default_max_new_tokens,
        max_new_tokens=settings.max_new_tokens,
        max_stop_strings=settings.max_stop_strings,
        max_stop_length=settings.max_stop_length,
    )


def scheduler_limits(settings: ServerSettings, sizing: KvSizing | None = None) -> SchedulerLimits:
    return SchedulerLimits.of(settings, sizing.max_batch_size if sizing else settings.max_batch_size)


def session_config(settings: ServerSettings) -> SessionConfig:
    """The engine's ONNX Runtime session as the flags ask for it."""
    threads = settings.threads or len(engine_cpus(settings.engine_cpus) or ())  # 0: ONNX Runtime's choice
    return SessionConfig(
        providers=tuple(settings.providers or ()),
        threads=threads,
        spinning=settings.spinning,
        spin_between_runs=settings.spin_between_steps,
    )


def engine_settings(settings: ServerSettings, sizing: KvSizing | None = None) -> EngineSettings:
    """The engine's settings; `sizing` (the KV rows the memory budget allows) over the flags' own rows."""
    return EngineSettings(
        max_batch_size=sizing.max_batch_size if sizing else settings.max_batch_size,
        capacity=sizing.max_model_len if sizing else settings.max_model_len,
        session=session_config(settings),
        prefix_cache_rows=sizing.prefix_cache_rows if sizing else settings.prefix_cache_rows,
        prefix_cache_min_tokens=settings.prefix_cache_min_tokens,
    )


def kv_sizing(settings: ServerSettings, bundle: Bundle) -> KvSizing:
    """The KV rows to allocate for this bundle (ConfigError: none fits the budget), logged."""
    sizing = size_kv_cache(
        bundle.manifest,
        settings.max_model_len,
        settings.kv_cache_memory,
        settings.max_batch_size,
        settings.prefix_cache_rows,
    )
    log.info("%s", sizing.describe())
    if sizing.max_batch_size < settings.max_batch_size:
        log.warning(
            "max_batch_size %d -> %d: kv_cache_memory holds %d rows of %d tokens",
            settings.max_batch_size,
            sizing.max_batch_size,
            sizing.max_batch_size,
            sizing.max_model_len,
        )
    return sizing


def checked_engine_cpus(settings: ServerSettings) -> frozenset[int] | None:
    """The engine process's CPUs (`engine_cpus` resolved); ConfigError for CPUs this process may not use."""
    cpus = engine_cpus(settings.engine_cpus)
    if cpus is None and settings.engine_cpus == "auto":
        log.warning("engine_cpus auto: this process may run on one CPU only; nothing to keep apart")
    elif cpus is not None:
        try:
            check_cpus(cpus, "engine_cpus")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if settings.threads is not None and settings.threads > len(cpus):
            log.warning(
                "threads %d on %d engine CPUs: ONNX Runtime's threads will take turns (leave threads unset)",
                settings.threads,
                len(cpus),
            )
    return cpus


def place_server(engine_cpus: frozenset[int]) -> None:
    """Move this process off the engine process's CPUs onto the rest of those it may use (none left: stay)."""
    rest = beside(engine_cpus)
    if rest is not None:
        pin_process(frozenset(rest))
    log.info(
        "engine process on CPUs %s; the server's process on %s",
        format_cpu_list(engine_cpus),
        format_cpu_list(rest or allowed_cpus()),
    )


async def load_model(
    settings: ServerSettings, metrics: Metrics | None, wrap: EngineWrap | None = None
) -> LoadedModel:
    """Bundle, warmed-up engine (in its own process, or here), started scheduler; raises BundleError for a
    bundle that cannot be served. `wrap` wraps the engine before the scheduler gets it (tests)."""
    bundle = await asyncio.to_thread(load_bundle, settings.bundle)
    sizing = kv_sizing(settings, bundle)
    cpus = checked_engine_cpus(settings) if settings.engine_process else None
    limits = scheduler_limits(settings, sizing)
    spec = EngineSpec(bundle, engine_settings(settings, sizing), limits, settings.log_level, wrap, cpus)
    if not settings.engine_process:
        scheduler, info = await open_in_thread(spec, metrics)
        return LoadedModel(
            bundle, info, scheduler, request_limits(settings, info, scheduler.max_total_tokens)
        )
    process = ProcessScheduler(spec, metrics)
    await process.start()
    if cpus is not None:
        place_server(cpus)
    checks = request_limits(settings, process.info, process.max_total_tokens)
    return LoadedModel(bundle, process.info, process, checks)


# --- requests that are not valid protobuf ------------------------------------------------------------------


@dataclass(frozen=True)
class Undecodable:
    """Stands in for request bytes that are not a valid message (e.g. bad UTF-8 in a string field)."""

    message: str


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid protobuf message: {exc}")

    return parse


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """gRPC answers an undecodable request with UNKNOWN before any handler runs; this hands the handler an
    `Undecodable` instead, so the service refuses it with INVALID_ARGUMENT and logs and counts it."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                handler.unary_stream,
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            handler.unary_unary,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def checked(request: M | Undecodable) -> M:
    """The request message, or InvalidRequest for bytes that do not decode or fields this server lacks."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(request.message)
    reject_unknown_fields(request)
    return request


# --- the service -------------------------------------------------------------------------------------------


class TextGenerationService(pb_grpc.TextGenerationServicer):
    def __init__(
        self, settings: ServerSettings, metrics: Metrics | None, tracer: RequestTracer | None = None
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._tracer = tracer
        self.model: LoadedModel | None = None
        self.draining = False

    def ready_model(self) -> LoadedModel:
        if self.draining:
            raise Draining("the server is shutting down: retry on another replica")
        if self.model is None:
            raise Draining("the model is still loading: retry when health reports SERVING")
        return self.model

    @contextlib.asynccontextmanager
    async def _call(self, rpc: str, context: grpc.aio.ServicerContext) -> AsyncIterator[CallRecord]:
        """Maps whatever ends the RPC to its one status, log line and metric.

        The record is written before the status goes out, so whoever sees the status can find its log line.
        """
        if self._tracer is not None:
            take_trace_context(context.invocation_metadata() or ())
        record = CallRecord(rpc=rpc)
        try:
            yield record
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            record.code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            self._account(record)
            raise
        except GeneratorExit:  # a stream whose client vanished mid-write: gRPC closes it without cancelling
            record.code = "CANCELLED"
            self._account(record)
            raise
        except Exception as exc:
            code, record.error = grpc_status(exc, record.request_id or None)
            record.code = code.name
            if code is grpc.StatusCode.INTERNAL:
                log.exception("request %s failed", record.request_id)
            self._account(record)
            await context.abort(code, record.error)
        else:
            self._account(record)

    def _account(self, record: CallRecord) -> None:
        account(record, self._settings.log_prompts, self._metrics, self._tracer)

    async def _submit(
        self,
        raw: pb.GenerateRequest | Undecodable,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        stream: bool,
    ) -> RequestHandle:
        model = self.ready_model()
        request: pb.GenerateRequest = checked(raw)
        record.request_id = check_request_id(request.request_id) or uuid.uuid4().hex
        which = request.WhichOneof("input")
        record.prompt = request.text if which == "text" else None
        encode = model.tokenizer.encode
        args = (request, lambda text: encode(text).ids, model.limits.vocab_size, model.chat_prompt)
        # Text and chats are tokenized off the event loop (a long prompt takes milliseconds); token ids are
        # only checked.
        on_loop = which not in ("text", "messages")
        prompt = prompt_ids(*args) if on_loop else await asyncio.to_thread(prompt_ids, *args)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        generation = generation_request(
            request,
            request_id=record.request_id,
            prompt=prompt,
            limits=model.limits,
            deadline=deadline,
            stream=stream,
        )
        if self.draining:  # the drain may have begun while the prompt was being tokenized
            raise Draining("the server is shutting down: retry on another replica")
        if self._metrics is not None and generation.constraint is not None:
            self._metrics.on_constrained(generation.constraint.kind.value)
        return model.scheduler.submit(generation)

    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        async with self._call("Generate", context) as record:
            handle = await self._submit(request, context, record, stream=False)
            completion = Completion(record.request_id)
            try:
                async for event in handle:
                    completion.add(event)
            finally:
                handle.cancel()  # frees the slot of a call that ends early; no effect once finished
            record.finish, record.text = completion.finish, completion.text
            return generate_response(record.request_id, completion)

    async def GenerateStream(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Tokens as they come, then a last message with the finish reason and usage (and no tokens).

        A stream that keeps up gets one message per engine step; one that falls behind (slow client, busy
        event loop) gets everything produced meanwhile in its next message, so the per-message cost is paid
        once per write instead of once per token.
        """
        async with self._call("GenerateStream", context) as record:
            handle = await self._submit(request, context, record, stream=True)
            texts: list[str] = []
            try:
                async for event in handle.coalesced():
                    if isinstance(event, FinishEvent):
                        record.finish = event
                    else:
                        texts.append(event.text)
                    yield stream_message(record.request_id, event)
            finally:
                handle.cancel()  # frees the slot when the client goes away; no effect once finished
            record.text = "".join(texts)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        async with self._call("GetModelInfo", context):
            model = self.ready_model()
            checked(request)
            manifest = model.bundle.manifest
            return pb.ModelInfo(
                model_name=manifest.model_name,
                vocab_size=model.info.vocab_size,
                context_length=model.info.context_length,
                max_new_tokens_limit=min(self._settings.max_new_tokens, model.limits.context_length - 1),
                max_batch_size=model.info.max_batch_size,
                dtype=manifest.dtype,
                quantization=manifest.quantization,
                execution_providers=list(model.info.providers),
                eos_token_id=model.info.eos_token_id,
                server_version=server_version(),
                prefix_cache_rows=model.info.prefix_cache_rows,
                kv_cache_bytes=model.info.kv_bytes,
                eos_token_ids=list(model.info.eos_token_ids or (model.info.eos_token_id,)),
                max_model_len=model.limits.context_length,
                batch_invariant=batch_invariant(manifest.batch_invariant, model.info.providers),
            )

    async def Tokenize(
        self, request: pb.TokenizeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        async with self._call("Tokenize", context):
            model = self.ready_model()
            tokenize: pb.TokenizeRequest = checked(request)
            special = not tokenize.HasField("add_special_tokens") or tokenize.add_special_tokens
            encoding = await asyncio.to_thread(
                model.tokenizer.encode, tokenize.text, add_special_tokens=special
            )
            return pb.TokenizeResponse(ids=encoding.ids, tokens=encoding.tokens)

    async def Detokenize(
        self, request: pb.DetokenizeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        async with self._call("Detokenize", context):
            model = self.ready_model()
            detokenize: pb.DetokenizeRequest = checked(request)
            ids = token_ids(detokenize.ids, model.info.vocab_size, "ids")
            return await asyncio.to_thread(_detokenized, model.tokenizer, ids)


def _detokenized(tokenizer: Tokenizer, ids: list[int]) -> pb.DetokenizeResponse:
    return pb.DetokenizeResponse(
        text=tokenizer.decode(ids),
        texts=tokenizer.decode_batch([[token] for token in ids]),
        # "" for ids the model has but the tokenizer does not (a vocabulary padded for speed).
        tokens=[tokenizer.id_to_token(token) or "" for token in ids],
    )


# --- server lifecycle --------------------------------------------------------------------------------------


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
    ) -> None:
        """`engine_wrap` wraps the engine before the scheduler gets it (tests: a slow or failing step).
        `freeze_heap`: once loaded, freeze this process's start-up objects (`freeze_startup_objects`); for a
        process that runs one server for its life, not for a test process that starts many. `tracer`: where
        request spans go (default: `otlp_traces_endpoint`'s exporter, or none)."""
        self.settings = settings
        self._engine_wrap = engine_wrap
        self._freeze_heap = freeze_heap
        # Made in start(); completes with the reason if the engine process dies: the server then stops.
        self.failed: asyncio.Future[str] | None = None
        self.metrics = metrics if metrics is not None else Metrics()
        endpoint = settings.otlp_traces_endpoint
        self.tracer = tracer if tracer is not None or endpoint is None else RequestTracer.otlp(endpoint)
        self.service = TextGenerationService(settings, self.metrics, self.tracer)
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
            self._http = http_api(self.service, self.settings, self.metrics, self.tracer)
            self.http_port = await self._http.start()
            scheme = "https" if self.settings.tls_enabled else "http"
            log.info(
                "OpenAI-compatible API on %s://%s", scheme, _address(self.settings.http_host, self.http_port)
            )
        model = await load_model(self.settings, self.metrics, self._engine_wrap)
        if isinstance(model.scheduler, ProcessScheduler):
            assert model.scheduler.exited is not None
            model.scheduler.exited.add_done_callback(self._engine_exited)
        self.service.model = model
        self._publish_model_info(model)
        if self._freeze_heap:
            log.info("froze %d start-up objects", freeze_startup_objects())
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.metrics.set_ready(True)
        log.info("serving %s", model.bundle.manifest.model_name)

    def _engine_exited(self, exited: asyncio.Future[str]) -> None:
        """The engine process died: nothing can be served any more; say so and let `serve` stop."""
        self.service.draining = True
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
        self.metrics.set_model_info(manifest.model_name, manifest.dtype, manifest.quantization, provider)

    async def drain(self) -> None:
        """NOT_SERVING (gRPC health, HTTP /health 503), refuse new work (UNAVAILABLE, HTTP 503), let running
        requests (streams of either front end) finish within grace_seconds, stop."""
        log.info("draining: up to %.1f s for running requests", self.settings.grace_seconds)
        self.service.draining = True
        self.metrics.set_ready(False)
        await self.health.enter_graceful_shutdown()
        if self.service.model is not None:
            await self.service.model.scheduler.drain(self.settings.grace_seconds)
        await self._stop_server(STOP_GRACE_SECONDS)
        log.info("stopped")

    async def stop(self) -> None:
        """Immediate stop (tests, failed start-up): running calls are cancelled."""
        self.service.draining = True
        if self.service.model is not None:
            await self.service.model.scheduler.drain(0.0)
        await self._stop_server(None)

    async def _stop_server(self, grace: float | None) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.stop(grace)
        if self._server is not None:
            await self._server.stop(grace)
        await self._stop_metrics()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # sends the spans still batched

    async def _stop_metrics(self) -> None:
        server, self._metrics_server = self._metrics_server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)  # waits up to one poll interval (0.5 s)
            server.server_close()


async def serve(settings: ServerSettings) -> int:
    """Run until SIGTERM or SIGINT, then drain (exit status 0); a failed start-up stops the server and
    re-raises; if the engine process dies, the server stops at once (exit status 1)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = TextgenServer(settings, freeze_heap=True)
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

"""OpenTelemetry spans of requests (`--otlp-traces-endpoint`), as vLLM exports them.

One span a call, from its arrival to its end (the last token, or the error), written when the call is
accounted (serve/api/common.py `account`), so nothing runs while the request does: its start is the
record's, its attributes the finished request's queue time, time to first token, prompt and output tokens
and finish reason (OpenTelemetry's gen_ai names, as vLLM's). A W3C `traceparent` (and `tracestate`) from
the HTTP headers or the gRPC metadata makes the span a child of the caller's. Off unless the endpoint is set:
the OpenTelemetry SDK (the `tracing` extra) is imported only then.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from serve.scheduling.request import FinishEvent

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context
# The caller's trace context, set by each front end where a call starts (a task of its own).
_carrier: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "trace_carrier", default=None
)


def take_trace_context(headers: Iterable[tuple[str, str]]) -> None:
    """Keep the W3C trace headers among `headers` (lower-case names) for the calls of this task."""
    found = {name: value for name, value in headers if name in TRACE_HEADERS}
    _carrier.set(found or None)


def trace_context() -> dict[str, str] | None:
    """The trace headers the current call came with, if any."""
    return _carrier.get()


class TracedCall(Protocol):
    """What a span tells of a finished call (serve/api/common.py `CallRecord` is one): tracing needs no more
    of the front ends, which import it."""

    @property
    def rpc(self) -> str: ...
    @property
    def started(self) -> float: ...  # time.perf_counter() at its arrival
    @property
    def request_id(self) -> str: ...
    @property
    def code(self) -> str: ...
    @property
    def status(self) -> int | None: ...
    @property
    def error(self) -> str: ...
    @property
    def finish(self) -> FinishEvent | None: ...
    @property
    def trace(self) -> dict[str, str] | None: ...


class RequestTracer:
    """Spans of finished calls, batched to `exporter` on a thread of the SDK's."""

    def __init__(self, exporter: SpanExporter, service_name: str = "textgen") -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:  # pragma: no cover - exercised only without the extra
            raise ImportError(
                "--otlp-traces-endpoint needs OpenTelemetry: pip install 'textgen-serving[tracing]'"
            ) from exc
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("textgen")
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str) -> RequestTracer:
        """Spans sent over OTLP/HTTP (protobuf) to `endpoint`, e.g. http://collector:4318/v1/traces."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint))

    def record(self, record: TracedCall) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode

        now = time.time_ns()
        start = now - int((time.perf_counter() - record.started) * 1e9)
        parent = self._propagator.extract(record.trace) if record.trace else None
        span = self._tracer.start_span(
            record.rpc, context=parent, kind=SpanKind.SERVER, start_time=start, attributes=attributes(record)
        )
        if record.code not in ("OK", "CANCELLED"):
            span.set_status(Status(StatusCode.ERROR, record.error or record.code))
        span.end(end_time=now)

    def force_flush(self) -> None:
        self._provider.force_flush()

    def shutdown(self) -> None:
        """Send what is batched, then stop."""
        self._provider.shutdown()


def attributes(record: TracedCall) -> dict[str, Any]:
    out: dict[str, Any] = {
        "textgen.rpc": record.rpc,
        "textgen.request_id": record.request_id,
        "textgen.code": record.code,
    }
    if record.status is not None:
        out["http.response.status_code"] = record.status
    finish = record.finish
    if finish is not None:
        out |= {
            "gen_ai.request.id": record.request_id,
            "gen_ai.usage.prompt_tokens": finish.prompt_tokens,
            "gen_ai.usage.completion_tokens": finish.completion_tokens,
            "gen_ai.usage.cached_prompt_tokens": finish.cached_prompt_tokens,
            "gen_ai.latency.time_in_queue": finish.queue_seconds,
            "gen_ai.latency.time_to_first_token": finish.ttft_seconds,
            "gen_ai.latency.e2e": time.perf_counter() - record.started,
            "gen_ai.response.finish_reasons": [finish.finish_reason],
        }
    return out

"""Request spans (`--otlp-traces-endpoint`): one span per call with the finished request's figures, a child of
the caller's W3C trace context from HTTP headers or gRPC metadata, sent over OTLP/HTTP to a receiver run in
the test; no tracer, no spans."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.common import CallRecord
from serve.api.tracing import RequestTracer, take_trace_context
from serve.scheduling.request import FinishEvent

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _the_span(exporter: InMemorySpanExporter, tracer: RequestTracer, name: str) -> ReadableSpan:
    tracer.force_flush()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


def test_a_span_carries_the_finished_request_and_the_callers_trace() -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(exporter)
    take_trace_context([("traceparent", TRACEPARENT), ("x-other", "1")])
    record = CallRecord(rpc="/v1/completions", request_id="r1", status=200)
    record.finish = FinishEvent("length", 7, 5, 2, 0.01, 0.05, 0.2)
    tracer.record(record)
    span = _the_span(exporter, tracer, "/v1/completions")
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.parent is not None and f"{span.parent.span_id:016x}" == PARENT_ID
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.prompt_tokens"] == 7 and attributes["gen_ai.usage.completion_tokens"] == 5
    assert attributes["gen_ai.latency.time_to_first_token"] == 0.05
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["textgen.request_id"] == "r1" and attributes["http.response.status_code"] == 200
    assert span.start_time is not None and span.end_time is not None and span.start_time <= span.end_time
    assert span.status.is_ok

    take_trace_context([])  # a call without a caller's context starts a trace of its own
    failed = CallRecord(rpc="Generate", request_id="r2", code="INVALID_ARGUMENT", error="bad")
    tracer.record(failed)
    span = _the_span(exporter, tracer, "Generate")
    assert span.parent is None and f"{span.context.trace_id:032x}" != TRACE_ID
    assert not span.status.is_ok and span.status.description == "bad"
    assert "gen_ai.usage.prompt_tokens" not in (span.attributes or {})


@pytest.fixture(scope="module")
def traced(loop: LoopThread, tiny_bundle: Path) -> Iterator[tuple[RunningServer, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    settings = loopback_settings(tiny_bundle, http_port=free_port(), engine_process=False)
    running = RunningServer(loop, settings, tracer=RequestTracer(exporter))
    yield running, exporter
    running.stop()


def test_both_front_ends_continue_the_callers_trace(
    traced: tuple[RunningServer, InMemorySpanExporter],
) -> None:
    server, exporter = traced
    assert server.server.tracer is not None
    body = {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{server.http_base}/v1/completions", json=body, headers={"traceparent": TRACEPARENT})
    usage = reply.json()["usage"]
    span = _the_span(exporter, server.server.tracer, "/v1/completions")
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 4
    assert 0 <= attributes["gen_ai.latency.time_in_queue"] <= attributes["gen_ai.latency.time_to_first_token"]
    assert attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]

    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with grpc.insecure_channel(server.target) as channel:
        request = pb.GenerateRequest(
            text="x", stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True)
        )
        pb_grpc.TextGenerationStub(channel).Generate(request, metadata=[("traceparent", other)])
    span = _the_span(exporter, server.server.tracer, "Generate")
    assert f"{span.context.trace_id:032x}" == other.split("-")[1]
    assert dict(span.attributes or {})["gen_ai.usage.completion_tokens"] == 3


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: keeps each export request's spans."""

    received: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append(ExportTraceServiceRequest.FromString(body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_spans_reach_an_otlp_receiver(loop: LoopThread, tiny_bundle: Path) -> None:
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    settings = loopback_settings(
        tiny_bundle, http_port=free_port(), engine_process=False, otlp_traces_endpoint=endpoint
    )
    server = RunningServer(loop, settings)
    try:
        reply = httpx.post(
            f"{server.http_base}/v1/completions",
            json={"prompt": "x", "max_tokens": 2},
            headers={"traceparent": TRACEPARENT},
        )
        assert reply.status_code == 200
    finally:
        server.stop()  # sends what is batched
        receiver.shutdown()
    spans = [
        span
        for request in _Receiver.received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    (span,) = [s for s in spans if s.name == "/v1/completions"]
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    names = {a.key: a.value for a in span.attributes}
    assert names["gen_ai.usage.completion_tokens"].int_value == 2


def test_no_endpoint_no_tracer(loop: LoopThread, tiny_bundle: Path) -> None:
    server = RunningServer(loop, loopback_settings(tiny_bundle, engine_process=False))
    try:
        assert server.server.tracer is None
    finally:
        server.stop()

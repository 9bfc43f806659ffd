"""schemathesis fuzzes the HTTP API from its own OpenAPI schema (/openapi.json), a bounded run: a fixed
number of examples per operation. No answer may be a 5xx, none may hang (each call has a timeout), and the
server serves a normal request afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

# Per operation: about 10 s in all for the four of them on 2 cores; `make soak` runs a longer fuzz.
EXAMPLES = int(os.environ.get("TEXTGEN_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fuzzed(loop: LoopThread, tiny_bundle: Path) -> Iterator[RunningServer]:
    settings = loopback_settings(
        tiny_bundle,
        http_port=free_port(),
        max_new_tokens=8,
        default_max_new_tokens=4,
        max_n=2,
        engine_process=False,
        max_message_bytes=64 * 1024,
    )
    running = RunningServer(loop, settings)
    yield running
    running.stop()


def test_no_server_errors(fuzzed: RunningServer) -> None:
    base = f"http://127.0.0.1:{fuzzed.server.http_port}"
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    anthropic_routes = ("/v1/messages", "/v1/messages/count_tokens")
    routes = (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        *anthropic_routes,
    )
    assert {op.path for op in operations} >= {*routes, "/v1/models"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case: schemathesis.Case) -> None:
            response = case.call(base_url=base, timeout=20)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text)
            if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
                body = response.json()
                shape = (
                    {"type", "message"}
                    if case.path in anthropic_routes
                    else {"message", "type", "param", "code"}
                )
                assert set(body["error"]) == shape, response.text

        call()
    scrape = fuzzed.server.metrics.exposition()
    for route in routes:
        counted = sum(
            float(line.rsplit(" ", 1)[1])
            for line in scrape.splitlines()
            if line.startswith("textgen_requests_total{") and f'rpc="{route}"' in line
        )
        assert counted >= EXAMPLES / 2, (route, counted)  # the examples reached the handlers


def test_the_server_still_serves_after_the_fuzzing(fuzzed: RunningServer) -> None:
    url = f"http://127.0.0.1:{fuzzed.server.http_port}"
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=20)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert fuzzed.wait_idle(5.0).running == 0

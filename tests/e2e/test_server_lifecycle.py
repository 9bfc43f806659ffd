"""Start-up, drain and exit: health flips at start and on drain; SIGTERM with streams in flight finishes
them and exits 0; a broken bundle or bad configuration exits non-zero with a clear message."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from engine_faults import InjectedFaults
from running_server import RunningServer, loopback_settings
from server_process import NOT_SERVING, SERVING, ServerProcess, health_status, run_serve
from server_tools import LoopThread, free_port, rpc_error

import serve.api.grpc_service
import serve.api.lifecycle
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.common import LoadedModel
from serve.api.lifecycle import TextgenServer
from serve.api.metrics import Metrics


def long_request(max_new_tokens: int = 30) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="once upon a time", stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True)
    )


def test_health_is_not_serving_until_the_model_is_loaded(
    loop: LoopThread, tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = asyncio.Event()
    load_model = serve.api.lifecycle.load_model

    async def gated_load(*args: object) -> LoadedModel:
        await gate.wait()
        return await load_model(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(serve.api.lifecycle, "load_model", gated_load)
    server = TextgenServer(loopback_settings(tiny_bundle, http_port=free_port()), Metrics())
    starting = loop.submit(server.start())
    deadline = time.monotonic() + 10
    while server.port == 0 or server.http_port == 0:  # both front ends listen before loading
        assert time.monotonic() < deadline and not starting.done()
        time.sleep(0.01)
    target = f"127.0.0.1:{server.port}"
    try:
        assert health_status(target) == NOT_SERVING
        with grpc.insecure_channel(target) as channel:
            error = rpc_error(lambda: pb_grpc.TextGenerationStub(channel).Generate(long_request(2)))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "still loading" in error.details()
        url = f"http://127.0.0.1:{server.http_port}"
        assert httpx.get(f"{url}/health").status_code == 503  # the HTTP API listens before loading too
        loading = httpx.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert loading.status_code == 503 and "still loading" in loading.json()["error"]["message"]
        loop.loop.call_soon_threadsafe(gate.set)
        starting.result(60)
        assert health_status(target) == SERVING
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        loop.run(server.stop())


def test_drain_finishes_running_streams_and_refuses_new_requests(loop: LoopThread, tiny_bundle: Path) -> None:
    slow = InjectedFaults(slow_seconds=0.03, slow_prefix="")
    running = RunningServer(loop, loopback_settings(tiny_bundle, grace_seconds=30), slow)
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        stream = stub.GenerateStream(long_request())
        first = next(stream)
        draining = loop.submit(running.server.drain())
        deadline = time.monotonic() + 5
        while health_status(running.target) != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        refused = rpc_error(lambda: stub.Generate(long_request(2)))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
        rest = list(stream)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 30
        draining.result(30)


def test_drain_fails_what_outlives_the_grace_period(loop: LoopThread, tiny_bundle: Path) -> None:
    slow = InjectedFaults(slow_seconds=0.05, slow_prefix="")
    running = RunningServer(loop, loopback_settings(tiny_bundle, grace_seconds=0.2), slow)
    with grpc.insecure_channel(running.target) as channel:
        stream = pb_grpc.TextGenerationStub(channel).GenerateStream(long_request())
        next(stream)
        draining = loop.submit(running.server.drain())
        error = rpc_error(lambda: stream)
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()
        draining.result(30)


def test_a_call_still_running_when_grpc_stops_is_unavailable_and_counted_so(
    loop: LoopThread, tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC cancels what still runs at the end of its stop's grace: the client sees UNAVAILABLE (and retries
    elsewhere), and the server logs and counts the call so, not as CANCELLED (the client's doing)."""
    monkeypatch.setattr(serve.api.lifecycle, "STOP_GRACE_SECONDS", 0.2)
    tokenizing = threading.Event()
    prompt_ids = serve.api.grpc_service.prompt_ids

    def slow_prompt_ids(*args: Any) -> list[int]:
        tokenizing.set()
        time.sleep(2)  # the whole drain happens meanwhile
        return prompt_ids(*args)

    monkeypatch.setattr(serve.api.grpc_service, "prompt_ids", slow_prompt_ids)
    running = RunningServer(loop, loopback_settings(tiny_bundle, engine_process=False))
    with grpc.insecure_channel(running.target) as channel:
        call = pb_grpc.TextGenerationStub(channel).Generate.future(long_request(2))
        assert tokenizing.wait(10)
        loop.run(running.server.drain())
        error = rpc_error(call.result)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error

    def counted(code: str) -> float:
        return running.metric("textgen_requests_total", rpc="Generate", code=code)

    deadline = time.monotonic() + 5
    while counted("UNAVAILABLE") + counted("CANCELLED") == 0:  # accounted as the cancelled handler unwinds
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert (counted("UNAVAILABLE"), counted("CANCELLED")) == (1, 0)


# --- the process --------------------------------------------------------------------------------------------


def test_sigterm_completes_streams_in_flight_and_exits_0(tiny_bundle: Path) -> None:
    server = ServerProcess("--bundle", str(tiny_bundle), "--grace-seconds", "30")
    try:
        target = server.wait_serving()
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            streams = [stub.GenerateStream(long_request(25)) for _ in range(3)]
            for stream in streams:
                next(stream)  # every stream is running
            server.proc.send_signal(signal.SIGTERM)
            for stream in streams:
                assert list(stream)[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert server.proc.wait(30) == 0, "".join(server.lines)
        log = "".join(server.lines)
        assert "draining" in log and '"code": "OK"' in log
        # Both processes froze their start-up heaps before serving (a full collection skips them).
        frozen = re.findall(r"(textgen\.\w+) (?:engine process: )?froze (\d+) start-up objects", log)
        assert sorted(name for name, _ in frozen) == ["textgen.engine_process", "textgen.server"], log
        assert all(int(count) > 1000 for _, count in frozen), frozen
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_sigterm_drains_http_streams_too(tiny_bundle: Path) -> None:
    http_port = free_port()
    server = ServerProcess(
        "--bundle", str(tiny_bundle), "--grace-seconds", "30", "--http-port", str(http_port)
    )
    url = f"http://127.0.0.1:{http_port}"
    body = {"prompt": "once upon a time", "max_tokens": 25, "ignore_eos": True, "stream": True}
    try:
        server.wait_serving()
        assert httpx.get(f"{url}/health").status_code == 200
        with contextlib.ExitStack() as streams:
            responses = [
                streams.enter_context(httpx.stream("POST", f"{url}/v1/completions", json=body))
                for _ in range(2)
            ]
            lines = [r.iter_lines() for r in responses]
            for stream in lines:
                assert next(stream).startswith("data: ")  # every stream is running
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(f"{url}/health").status_code != 503:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
            for stream in lines:
                rest = [line for line in stream if line]
                assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert server.proc.wait(30) == 0, "".join(server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_broken_bundle_exits_1_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{not json")
    result = run_serve("--bundle", str(tmp_path), "--port", "0")
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "start-up failed" in line]
    assert len(errors) == 1 and "manifest.json" in errors[0], result.stderr


def test_bad_configuration_exits_2(tmp_path: Path) -> None:
    result = run_serve("--bundle", str(tmp_path), "--port", "99999")
    assert result.returncode == 2
    assert "port: Input should be less than or equal to 65535" in result.stderr


def test_port_in_use_exits_1_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve("--bundle", str(tmp_path), "--port", str(port))
    assert result.returncode == 1
    assert f"start-up failed: cannot listen on 127.0.0.1:{port}" in result.stderr

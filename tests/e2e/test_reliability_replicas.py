"""Two server replicas behind one round_robin channel with a retry policy for UNAVAILABLE
(`serve.api.client.connect`): one is killed (SIGKILL) mid-load. Streams in flight on it fail UNAVAILABLE, the
survivor's log accounts for every other one, requests sent after the kill are retried onto the survivor, and
nothing hangs."""

from __future__ import annotations

import io
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from server_process import ServerProcess
from test_reliability_load import CALL_TIMEOUT, LONG, PROMPTS, Streamed, consume, greedy, started

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.client import connect
from serve.api.client import main as client_main

IN_FLIGHT = 6
AFTER_KILL = 6
NEW_TOKENS = LONG  # ~1 s of decode at the replicas' 20 ms a step: still running when the kill comes


def request_records(server: ServerProcess) -> list[dict[str, object]]:
    """The server's request log lines (one JSON object per finished call)."""
    marker = "textgen.requests "
    return [json.loads(line.split(marker, 1)[1]) for line in list(server.lines) if marker in line]


def answered_ok(server: ServerProcess, rpc: str, expected: set[str]) -> set[str]:
    """Request ids the server logged as answered OK, once `expected` are among them (or after 10 s): the
    server logs a call as its status goes out, and its log reaches us through a pipe."""
    deadline = time.monotonic() + 10
    while True:
        ok = {str(r["request_id"]) for r in request_records(server) if r["rpc"] == rpc and r["code"] == "OK"}
        if expected <= ok or time.monotonic() > deadline:
            return ok
        time.sleep(0.05)


@pytest.fixture
def replicas(tiny_bundle: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    pair = tuple(ServerProcess("--bundle", str(tiny_bundle), "--max-batch-size", "4") for _ in range(2))
    try:
        for replica in pair:
            replica.wait_serving()
        yield pair  # type: ignore[misc]
    finally:
        for replica in pair:
            if replica.proc.poll() is None:
                replica.proc.kill()
            replica.proc.wait(30)


def spread_over(channel: grpc.Channel, pair: tuple[ServerProcess, ServerProcess]) -> None:
    """Calls until both replicas have answered one: round_robin only picks connected subchannels."""
    stub = pb_grpc.TextGenerationStub(channel)
    deadline = time.monotonic() + 30
    while not all(any(r["rpc"] == "GetModelInfo" for r in request_records(p)) for p in pair):
        assert time.monotonic() < deadline, "round_robin never reached both replicas"
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=CALL_TIMEOUT)
        time.sleep(0.05)


def test_killing_a_replica_mid_load_fails_only_its_streams_and_retries_new_requests(
    replicas: tuple[ServerProcess, ServerProcess],
) -> None:
    victim, survivor = replicas
    target = f"ipv4:127.0.0.1:{victim.port},127.0.0.1:{survivor.port}"
    with connect(target, lb="round_robin") as channel:
        spread_over(channel, replicas)
        stub = pb_grpc.TextGenerationStub(channel)
        in_flight = [
            started(
                stub, greedy(PROMPTS[i % len(PROMPTS)], NEW_TOKENS, f"inflight-{i}"), timeout=CALL_TIMEOUT
            )
            for i in range(IN_FLIGHT)
        ]
        victim.proc.kill()
        victim.proc.wait(30)
        after: dict[str, pb.GenerateResponse | grpc.RpcError] = {}

        def send(request_id: str) -> None:
            try:
                after[request_id] = stub.Generate(greedy(PROMPTS[0], 4, request_id), timeout=CALL_TIMEOUT)
            except grpc.RpcError as exc:
                after[request_id] = exc

        senders = [threading.Thread(target=send, args=(f"after-{i}",)) for i in range(AFTER_KILL)]
        for sender in senders:
            sender.start()
        ended: dict[str, Streamed] = {
            f"inflight-{i}": consume(call, seen) for i, (call, seen) in enumerate(in_flight)
        }
        for sender in senders:
            sender.join(CALL_TIMEOUT)
        assert not any(sender.is_alive() for sender in senders), "a request hung"
        # The command-line client takes the same channel: one more request through it, after the kill.
        out, err = io.StringIO(), io.StringIO()
        cli = ["generate", PROMPTS[1], "--target", target, "--lb", "round_robin", "--max-new-tokens", "3"]
        assert client_main([*cli, "--timeout", str(CALL_TIMEOUT)], out, err) == 0, err.getvalue()
        assert out.getvalue().strip()

    failed = {rid for rid, seen in ended.items() if seen.code != grpc.StatusCode.OK}
    completed = set(ended) - failed
    assert failed and completed, "round_robin put every stream on one replica"
    for rid in failed:
        assert ended[rid].code == grpc.StatusCode.UNAVAILABLE, (rid, ended[rid].code, ended[rid].details)
        assert ended[rid].details
    for rid in completed:
        assert ended[rid].finish_reason == pb.FINISH_REASON_LENGTH
        assert ended[rid].completion_tokens == len(ended[rid].token_ids) == NEW_TOKENS
    # Every completed stream was the survivor's, and it saw none of the failed ones through to the end.
    assert answered_ok(survivor, "GenerateStream", completed) == completed
    for rid, answer in after.items():
        assert isinstance(answer, pb.GenerateResponse), (rid, answer)
        assert answer.usage.completion_tokens == 4
    assert answered_ok(survivor, "Generate", set(after)) >= set(after)
    assert survivor.proc.poll() is None

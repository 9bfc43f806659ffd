"""Load and faults against a real server: every request ends with a status, and nothing is lost or left over.

- Many more streaming clients than batch rows plus queue places: each stream is complete (the same tokens and
  text as the same request alone) or ends RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED; the server counts the same.
- Many cancels and deadline expiries at once free their slots within a step or two; a bystander is untouched.
- SIGTERM under load: running streams finish, queued and new requests get UNAVAILABLE, the process exits 0.
- An engine step that raises fails only that step's requests (INTERNAL); later requests succeed.
- A corrupt or mismatched bundle stops start-up with one line naming the file and the problem.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from engine_faults import InjectedFaults
from prometheus_client.parser import text_string_to_metric_families
from running_server import RunningServer, loopback_settings
from server_process import NOT_SERVING, ServerProcess, health_status, run_serve
from server_tools import LoopThread, rpc_error

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.scheduling.intake import SchedulerSnapshot

PROMPTS = ("the quick brown fox", "once upon a time", "import numpy as np", "def main():", "hello world")
NEW_TOKENS = 8
CALL_TIMEOUT = 60.0  # no call may hang: a stuck one fails with the client's DEADLINE_EXCEEDED, then the test


@pytest.fixture
def serving(loop: LoopThread, tiny_bundle: Path) -> Iterator[Callable[..., RunningServer]]:
    """Starts tiny-bundle servers with the given settings; stops them after the test."""
    started: list[RunningServer] = []

    def start(faults: InjectedFaults | None = None, **overrides: object) -> RunningServer:
        started.append(RunningServer(loop, loopback_settings(tiny_bundle, **overrides), faults))
        return started[-1]

    yield start
    for running in started:
        running.stop()


def greedy(prompt: str, max_new_tokens: int = NEW_TOKENS, request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        text=prompt,
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


@dataclass
class Streamed:
    """What a client saw of one GenerateStream call."""

    code: grpc.StatusCode = grpc.StatusCode.OK
    details: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    completion_tokens: int = 0

    def add(self, message: pb.GenerateStreamResponse) -> None:
        assert self.finish_reason == pb.FINISH_REASON_UNSPECIFIED, "a message after the last one"
        self.text += message.text
        self.token_ids.extend(message.token_ids)
        self.finish_reason = message.finish_reason
        self.completion_tokens = message.usage.completion_tokens


def consume(call: Iterator[pb.GenerateStreamResponse], seen: Streamed | None = None) -> Streamed:
    """Reads a stream to its end; the status is OK or the error the call ended with."""
    seen = seen if seen is not None else Streamed()
    try:
        for message in call:
            seen.add(message)
    except grpc.RpcError as exc:
        seen.code, seen.details = exc.code(), exc.details()
    return seen


def started(
    stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest, **kwargs: object
) -> tuple[Iterator[pb.GenerateStreamResponse], Streamed]:
    """A stream whose first message has arrived (so it is running), and what it has said so far."""
    call = stub.GenerateStream(request, **kwargs)
    seen = Streamed()
    seen.add(next(call))
    return call, seen


def references(
    stub: pb_grpc.TextGenerationStub, max_new_tokens: int = NEW_TOKENS
) -> dict[str, pb.GenerateResponse]:
    """Each prompt's greedy completion with the server to itself."""
    return {prompt: stub.Generate(greedy(prompt, max_new_tokens)) for prompt in PROMPTS}


def assert_complete(seen: Streamed, reference: pb.GenerateResponse) -> None:
    assert seen.code == grpc.StatusCode.OK, (seen.code, seen.details)
    assert seen.finish_reason == pb.FINISH_REASON_LENGTH
    assert seen.token_ids == list(reference.token_ids)  # none lost, duplicated or reordered
    assert seen.text == reference.text
    assert seen.completion_tokens == len(seen.token_ids) == len(reference.token_ids)


def sample(server: RunningServer, name: str, **labels: str) -> float:
    return server.server.metrics.registry.get_sample_value(name, labels) or 0.0


def stream_counts(server: RunningServer) -> Counter[str]:
    counts: Counter[str] = Counter()
    for code in grpc.StatusCode:
        value = sample(server, "textgen_requests_total", rpc="GenerateStream", code=code.name)
        if value:
            counts[code.name] = int(value)
    return counts


def wait_counted(server: RunningServer, before: Counter[str], expected: Counter[str]) -> Counter[str]:
    """The server's GenerateStream counts since `before`, once they reach `expected` (a handler counts its
    call just after the client has read the last message), or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        delta = stream_counts(server) - before
        if all(delta[code] >= n for code, n in expected.items()) or time.monotonic() > deadline:
            return delta
        time.sleep(0.02)


def assert_gauges_idle(server: RunningServer) -> None:
    snapshot = server.wait_idle()
    assert snapshot.kv_slots_used == 0 and snapshot.kv_tokens_reserved == 0
    for gauge in ("textgen_requests_running", "textgen_requests_waiting", "textgen_kv_cache_slots_used"):
        assert sample(server, gauge) == 0, gauge


# --- overload ----------------------------------------------------------------------------------------------

CLIENTS = 12
LOAD_SECONDS = 3.0
BATCH, QUEUE = 2, 3  # CLIENTS is twice the requests the server may hold at once
IMPATIENT_TIMEOUT = 0.25  # every fourth client: 40 tokens at >= 10 ms a step cannot finish in time


def client_loop(
    stub: pb_grpc.TextGenerationStub, index: int, until: float, out: list[tuple[str, Streamed]]
) -> None:
    impatient = index % 4 == 3
    turn = 0
    while time.monotonic() < until:
        prompt = PROMPTS[(index + turn) % len(PROMPTS)]
        turn += 1
        if impatient:
            seen = consume(stub.GenerateStream(greedy(prompt, 40), timeout=IMPATIENT_TIMEOUT))
        else:
            seen = consume(stub.GenerateStream(greedy(prompt), timeout=CALL_TIMEOUT))
        out.append((prompt, seen))
        if seen.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            time.sleep(0.02)  # a refused client backs off a little, as a real one would


def test_overload_every_stream_completes_or_is_refused_and_the_server_agrees(
    serving: Callable[..., RunningServer],
) -> None:
    slow = InjectedFaults(slow_seconds=0.01, slow_prefix="")
    server = serving(slow, max_batch_size=BATCH, max_queue=QUEUE)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        expected = references(stub)
        before, tokens_before = stream_counts(server), sample(server, "textgen_generation_tokens_total")
        results: list[list[tuple[str, Streamed]]] = [[] for _ in range(CLIENTS)]
        until = time.monotonic() + LOAD_SECONDS
        threads = [
            threading.Thread(target=client_loop, args=(stub, i, until, results[i])) for i in range(CLIENTS)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(CALL_TIMEOUT + LOAD_SECONDS)
        assert not any(thread.is_alive() for thread in threads), "a client hung"
    outcomes = [outcome for client in results for outcome in client]
    seen_codes = Counter(seen.code.name for _prompt, seen in outcomes)
    assert set(seen_codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, seen_codes
    assert all(seen_codes[code] for code in ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")), seen_codes
    for prompt, seen in outcomes:
        if seen.code == grpc.StatusCode.OK:
            assert_complete(seen, expected[prompt])
        else:
            assert seen.details and seen.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    server.wait_idle()
    # A client whose deadline passes may reset the stream before the server's own clock says the deadline
    # has passed; the server then counts it CANCELLED. And a call whose deadline passes before gRPC has read
    # its request message never reaches the service, so the service cannot count it (docs/reliability.md).
    client_expired = seen_codes.pop("DEADLINE_EXCEEDED")
    counted = wait_counted(server, before, seen_codes)
    expired = counted.pop("DEADLINE_EXCEEDED", 0) + counted.pop("CANCELLED", 0)
    assert 0 < expired <= client_expired
    assert counted == seen_codes
    completed = sum(seen.completion_tokens for _prompt, seen in outcomes if seen.code == grpc.StatusCode.OK)
    assert sample(server, "textgen_generation_tokens_total") - tokens_before == completed
    assert_gauges_idle(server)


# --- cancels and deadlines ---------------------------------------------------------------------------------

STEP_SECONDS = 0.05
LONG = 45  # new tokens: the longest prompt (16 tokens) + 45 fits the tiny model's 64-token context
# A step in progress when the scheduler learns of a cancel finishes and the next step's sweep frees the slot
# (tests/scheduling/test_scheduler_failures.py holds the scheduler to that). Seen end to end, the cancel's
# trip through gRPC and the event loop comes first, or, for an expiry, the server's deadline, which starts
# when the call reaches it: steps on a busy machine. So here a slot must be freed well before its request
# could have finished (LONG steps), whatever the machine's load.
FREED_WITHIN_STEPS = LONG // 3


def steps_until_ended(server: RunningServer, outcomes: Counter[str], ended: int) -> int:
    """Engine steps the scheduler completes until `ended` more requests were cancelled or expired."""
    steps = len(server.model.scheduler.steps())

    def gone(snapshot: SchedulerSnapshot) -> bool:
        now = Counter(snapshot.outcomes) - outcomes
        return now["cancelled"] + now["expired"] >= ended and snapshot.waiting == 0

    server.wait_for(gone)
    return len(server.model.scheduler.steps()) - steps


def started_together(
    calls: list[Iterator[pb.GenerateStreamResponse]],
) -> list[Iterator[pb.GenerateStreamResponse]]:
    """Calls sent at once (so they share prefills), returned once each has its first message."""
    for call in calls:
        next(call)
    return calls


def test_many_cancels_and_expiries_free_their_slots_and_spare_the_others(
    serving: Callable[..., RunningServer],
) -> None:
    server = serving(InjectedFaults(slow_seconds=STEP_SECONDS), max_batch_size=6, max_queue=8)

    def slowed(prompt: str, name: str, timeout: float = CALL_TIMEOUT) -> Iterator[pb.GenerateStreamResponse]:
        return stub.GenerateStream(greedy(prompt, LONG, f"slow-{name}"), timeout=timeout)

    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        bystander_reference = stub.Generate(greedy(PROMPTS[0], LONG))  # at full speed
        before = Counter(server.snapshot().outcomes)
        bystander, bystander_seen = started(
            stub, greedy(PROMPTS[0], LONG, "slow-bystander"), timeout=CALL_TIMEOUT
        )
        finishing = threading.Thread(target=consume, args=(bystander, bystander_seen))
        finishing.start()

        running = started_together([slowed(PROMPTS[1], f"running-{i}") for i in range(5)])
        queued = [slowed(PROMPTS[2], f"queued-{i}") for i in range(3)]
        server.wait_for(lambda s: s.running == 6 and s.waiting == 3)
        for call in running + queued:
            call.cancel()
        assert steps_until_ended(server, before, 8) <= FREED_WITHIN_STEPS
        cancelled = [consume(call) for call in running + queued]
        assert {seen.code for seen in cancelled} == {grpc.StatusCode.CANCELLED}
        # The gauges follow at the end of the step that freed the slots (counted in steps, not seconds; the
        # time limit only keeps a broken gauge from hanging the test).
        freed_at, hang_guard = len(server.model.scheduler.steps()), time.monotonic() + 60
        while (
            sample(server, "textgen_requests_running") > 1
            or sample(server, "textgen_kv_cache_slots_used") > 1
        ):
            late = len(server.model.scheduler.steps()) - freed_at > 1 or time.monotonic() > hang_guard
            assert not late, "the load gauges still count the cancelled requests"
            time.sleep(0.005)

        expiring = started_together([slowed(PROMPTS[3], f"expiring-{i}", timeout=0.8) for i in range(5)])
        expired = [consume(call) for call in expiring]
        assert steps_until_ended(server, before, 13) <= FREED_WITHIN_STEPS
        assert {seen.code for seen in expired} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        finishing.join(CALL_TIMEOUT)
    assert_complete(bystander_seen, bystander_reference)
    ended = Counter(server.snapshot().outcomes) - before
    # An expiring client may reset its stream before the server's clock passes the deadline: then the
    # scheduler sees a cancel rather than an expiry. Either way the slot is freed at the next step.
    assert ended["cancelled"] + ended["expired"] == 13 and ended["finished"] == 1, ended
    assert_gauges_idle(server)


# --- engine failure ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("beside", [False, True], ids=["between", "beside"])
def test_a_failing_engine_step_fails_only_its_requests(
    serving: Callable[..., RunningServer], beside: bool
) -> None:
    faults = InjectedFaults(0.02, slow_prefix="", fail_prefill_prefix="joins-and-fails", fail_rows=3)
    server = serving(faults, max_batch_size=4, prefill_beside_decode=beside)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        expected = references(stub, 30)

        # A prefill fails: the request joining fails, the two already running go on.
        runners = [started(stub, greedy(p, 30), timeout=CALL_TIMEOUT) for p in PROMPTS[:2]]
        joining = consume(
            stub.GenerateStream(greedy(PROMPTS[2], 30, "joins-and-fails"), timeout=CALL_TIMEOUT)
        )
        assert joining.code == grpc.StatusCode.INTERNAL and not joining.token_ids
        assert "joins-and-fails" in joining.details and "injected ONNX Runtime failure" in joining.details
        for prompt, (call, seen) in zip(PROMPTS[:2], runners, strict=True):
            assert_complete(consume(call, seen), expected[prompt])

        # A decode step fails once the three doomed requests run together: all three fail, the server goes on.
        doomed = [
            started(stub, greedy(p, 30, f"doomed-{i}"), timeout=CALL_TIMEOUT)
            for i, p in enumerate(PROMPTS[:3])
        ]
        failed = [consume(call, seen) for call, seen in doomed]
        assert {seen.code for seen in failed} == {grpc.StatusCode.INTERNAL}
        assert all(f"doomed-{i}" in seen.details for i, seen in enumerate(failed))
        assert all(len(seen.token_ids) < 30 for seen in failed)
        assert_gauges_idle(server)
        after = [consume(stub.GenerateStream(greedy(p, 30), timeout=CALL_TIMEOUT)) for p in PROMPTS]
    for prompt, seen in zip(PROMPTS, after, strict=True):
        assert_complete(seen, expected[prompt])
    assert sample(server, "textgen_requests_total", rpc="GenerateStream", code="INTERNAL") == 4


# --- SIGTERM under load (the real process) -----------------------------------------------------------------


def scrape(server: ServerProcess) -> dict[str, float]:
    """Unlabelled gauges and counters of a server process, from its /metrics port (found in its log)."""
    port = next(
        int(found.group(1))
        for line in server.lines
        if (found := re.search(r"metrics on http://[^:]+:(\d+)/metrics", line))
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return {s.name: s.value for f in families for s in f.samples if not s.labels}


def test_sigterm_under_load_finishes_running_streams_and_refuses_the_rest(tiny_bundle: Path) -> None:
    server = ServerProcess(
        "--bundle", str(tiny_bundle), "--grace-seconds", "30", "--max-batch-size", "3", "--max-queue", "8"
    )
    try:
        target = server.wait_serving()
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            running = [started(stub, greedy(p, LONG), timeout=CALL_TIMEOUT) for p in PROMPTS[:3]]
            queued = [stub.GenerateStream(greedy(p, LONG), timeout=CALL_TIMEOUT) for p in PROMPTS[:3]]
            deadline = time.monotonic() + 10
            while scrape(server)["textgen_requests_waiting"] != 3:
                assert time.monotonic() < deadline, "the queued requests never reached the server"
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            while health_status(target) != NOT_SERVING:
                assert time.monotonic() < deadline + 10
                time.sleep(0.01)
            refused = rpc_error(lambda: stub.Generate(greedy(PROMPTS[0]), timeout=CALL_TIMEOUT))
            finished = [consume(call, seen) for call, seen in running]
            rejected = [consume(call) for call in queued]
        assert server.proc.wait(30) == 0, "".join(server.lines)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.details()
    for seen in finished:
        assert seen.code == grpc.StatusCode.OK and seen.finish_reason == pb.FINISH_REASON_LENGTH
        assert seen.completion_tokens == len(seen.token_ids) == LONG
    assert {seen.code for seen in rejected} == {grpc.StatusCode.UNAVAILABLE}
    assert all("retry elsewhere" in seen.details for seen in rejected)
    logged = Counter(
        (record["rpc"], record["code"])
        for line in server.lines
        if "textgen.requests" in line
        for record in [json.loads(line.split("textgen.requests ", 1)[1])]
    )
    assert logged == {
        ("GenerateStream", "OK"): 3,
        ("GenerateStream", "UNAVAILABLE"): 3,
        ("Generate", "UNAVAILABLE"): 1,
    }


# --- bundles that cannot be served -------------------------------------------------------------------------


def edit_manifest(bundle: Path, edit: Callable[[dict], None]) -> None:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def corrupt_graph(bundle: Path) -> None:
    graph = bundle / "model_inplace.onnx"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))


def fewer_heads(manifest: dict) -> None:
    manifest["architecture"].update(n_heads=4, head_dim=8)  # d_model unchanged: only the graph disagrees


def smaller_vocab(manifest: dict) -> None:
    manifest["architecture"]["vocab_size"] = 100


BROKEN = {
    "corrupt graph": (corrupt_graph, "model_inplace.onnx", "checksum mismatch"),
    "vocab mismatch": (lambda b: edit_manifest(b, smaller_vocab), "tokenizer.json", "vocab_size is 100"),
    "graph mismatch": (lambda b: edit_manifest(b, fewer_heads), "model_inplace.onnx", "does not match"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_bundle_stops_start_up_with_one_line_naming_the_file(
    case: str, tiny_bundle: Path, tmp_path: Path
) -> None:
    breaks, file, problem = BROKEN[case]
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    breaks(bundle)
    # A first start (an empty cache): with a prepared entry of the intact bundle, which shares its manifest,
    # the server would read the entry and not the broken graph (docs/architecture.md, "Prepared graph").
    cache = tmp_path / "compiled"
    result = run_serve("--bundle", str(bundle), "--port", "0", "--compiled-cache", str(cache))
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "Traceback" in line]
    assert len(errors) == 1, result.stderr
    assert "start-up failed" in errors[0] and str(bundle / file) in errors[0] and problem in errors[0]


# --- a stream closed under the handler ---------------------------------------------------------------------


def test_a_stream_handler_closed_by_grpc_is_still_counted_and_frees_its_slot(
    serving: Callable[..., RunningServer],
) -> None:
    """When a write fails because the client has just gone (gRPC logs ExecuteBatchError), gRPC stops iterating
    the handler and closes it, without cancelling it: the call still needs its status in the log and metrics.
    (Seen once in 24 000 calls of the soak; here the handler is closed directly, as gRPC does.)"""
    server = serving()
    context: Any = SimpleNamespace(time_remaining=lambda: None, invocation_metadata=lambda: ())

    async def first_message_then_close() -> pb.GenerateStreamResponse:
        stream = server.server.service.GenerateStream(greedy(PROMPTS[0], LONG), context)
        first = await anext(stream)
        await stream.aclose()
        return first

    before = sample(server, "textgen_requests_total", rpc="GenerateStream", code="CANCELLED")
    assert server.loop.run(first_message_then_close()).token_ids
    assert sample(server, "textgen_requests_total", rpc="GenerateStream", code="CANCELLED") == before + 1
    assert_gauges_idle(server)

"""The engine in a process of its own (serve/scheduling/engine_core.py and engine_client.py): what only that
shape of the server does.

Both shapes run the whole gRPC suite (tests/api/test_server.py); here: the scheduler's guarantees across the
process boundary (batch invariance, the queue bound, cancels), metrics recorded there and replayed here, and
what happens when either process dies or the engine process will not stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from engine_faults import InjectedFaults
from grpc_health.v1 import health_pb2
from running_server import RunningServer, loopback_settings
from server_process import ServerProcess, health_status, run_serve
from server_tools import LoopThread, rpc_error

import serve.scheduling.engine_client
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.loading import engine_settings
from serve.api.metrics import Metrics, new_registry
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, SessionConfig
from serve.errors import Draining, EngineFailure, QueueFull
from serve.process import allowed_cpus, format_cpu_list
from serve.scheduling.engine_client import EngineProcess, ProcessScheduler, replay
from serve.scheduling.engine_core import MetricRecorder
from serve.scheduling.handles import RequestHandle
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.messages import EngineSpec, StepOutput
from serve.scheduling.offline import generate
from serve.scheduling.request import Completion, GenerationRequest

T = TypeVar("T")
SESSION = SessionConfig(threads=1, spinning=False)


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle)


def spec(bundle: Bundle, faults: InjectedFaults | None = None, **limits: Any) -> EngineSpec:
    limits.setdefault("max_batch_size", 4)
    engine = EngineSettings(max_batch_size=limits["max_batch_size"], session=SESSION)
    return EngineSpec(bundle.root, engine, SchedulerLimits(**limits), "WARNING", faults)


def request(rid: str, prompt: list[int], max_new: int = 8) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(), max_new, ignore_eos=True)


async def collect(handle: RequestHandle) -> Completion:
    completion = Completion(handle.request_id)
    async for event in handle:
        completion.add(event)
    return completion


def run(main: Callable[[], Coroutine[Any, Any, T]], timeout: float = 60.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), timeout)

    return asyncio.run(bounded())


def test_greedy_tokens_are_batch_invariant_across_the_process_boundary(bundle: Bundle) -> None:
    prompts = [[3 + i + j for j in range(2 + 3 * i)] for i in range(6)]
    alone = Engine.from_bundle(bundle, EngineSettings(max_batch_size=1, session=SESSION))
    expected = [generate(alone, [p], max_new_tokens=12, ignore_eos=True)[0].token_ids for p in prompts]

    async def main() -> list[list[int]]:
        scheduler = ProcessScheduler(spec(bundle))
        await scheduler.start()
        try:
            early = [scheduler.submit(request(f"r{i}", p, 12)) for i, p in enumerate(prompts[:4])]
            while scheduler.snapshot().running == 0:  # the others join a running batch
                await asyncio.sleep(0.001)
            late = [scheduler.submit(request(f"r{i + 4}", p, 12)) for i, p in enumerate(prompts[4:])]
            done = await asyncio.gather(*(collect(h) for h in [*early, *late]))
            assert max(step.rows for step in scheduler.steps()) > 1
            assert scheduler.snapshot().outcomes["finished"] == 6
        finally:
            await scheduler.drain(0.0)
        return [c.token_ids for c in done]

    assert run(main) == expected


def test_an_engine_process_started_ahead_builds_once_given_its_spec_or_ends_when_closed(
    bundle: Bundle,
) -> None:
    unused = EngineProcess()  # the server's start-up failed before it sent a spec
    unused.close()
    assert unused.process.exitcode == 0

    async def main() -> list[int]:
        ahead = EngineProcess()  # as textgen-serve starts it, before its own imports
        scheduler = ProcessScheduler(spec(bundle), process=ahead)
        await scheduler.start()
        try:
            assert scheduler.pid == ahead.process.pid
            return (await collect(scheduler.submit(request("r", [3, 4, 5])))).token_ids
        finally:
            await scheduler.drain(0.0)
            ahead.close()

    assert len(run(main)) == 8


def test_the_queue_bound_holds_here_and_a_cancel_reaches_the_engine_process(bundle: Bundle) -> None:
    async def main() -> None:
        scheduler = ProcessScheduler(spec(bundle, InjectedFaults(0.02), max_batch_size=1, max_queue=2))
        await scheduler.start()
        try:
            running = scheduler.submit(request("slow-running", [5, 6, 7], 40))
            await running.__anext__()
            queued = [scheduler.submit(request(f"queued-{i}", [5, 6], 2)) for i in range(2)]
            # Refused at once, before the engine process has said anything about the two just sent.
            with pytest.raises(QueueFull, match="queue is full"):
                scheduler.submit(request("one-too-many", [5], 2))
            assert scheduler.snapshot().waiting == 2 and scheduler.snapshot().outcomes["rejected"] == 1
            running.cancel()
            for handle in queued:  # the cancelled request's row goes to the queue
                assert (await collect(handle)).finish_reason == "length"
            assert scheduler.snapshot().outcomes["cancelled"] == 1
            assert scheduler.snapshot().running == 0
        finally:
            await scheduler.drain(0.0)

    run(main)


def test_the_queue_gauge_counts_what_was_sent_during_a_long_step(bundle: Bundle) -> None:
    metrics = Metrics(new_registry())

    def waiting() -> tuple[float | None, float | None]:
        sample = metrics.registry.get_sample_value
        return sample("textgen_requests_waiting"), sample("vllm:num_requests_waiting")

    async def main() -> None:
        scheduler = ProcessScheduler(spec(bundle, InjectedFaults(1.0), max_batch_size=1), metrics)
        await scheduler.start()
        try:
            running = scheduler.submit(request("slow-running", [5, 6, 7], 3))
            await running.__anext__()  # prefilled: each of its decode steps now takes a second
            for i in range(2):
                scheduler.submit(request(f"queued-{i}", [5, 6], 2))
            assert waiting() == (2, 2)  # the engine process, inside a step, has not read them yet
        finally:
            await scheduler.drain(0.0)
        assert waiting() == (0, 0)

    run(main)


def test_steps_without_outcomes_reach_the_server_together_and_none_is_lost(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    outputs: list[StepOutput] = []
    receive = ProcessScheduler._receive

    def counted(self: ProcessScheduler, output: StepOutput) -> None:
        outputs.append(output)
        receive(self, output)

    monkeypatch.setattr(ProcessScheduler, "_receive", counted)
    prompts = [[3 + i, 4, 5 + i] for i in range(4)]
    metrics = Metrics(new_registry())

    async def main() -> None:
        scheduler = ProcessScheduler(spec(bundle), metrics)
        await scheduler.start()
        try:
            unary = [replace(request(f"u{i}", p, 48), stream=False) for i, p in enumerate(prompts)]
            handles = [scheduler.submit(r) for r in unary]
            done = await asyncio.gather(*(collect(h) for h in handles))
        finally:
            await scheduler.drain(0.0)
        assert all(len(c.token_ids) == 48 for c in done)
        steps = scheduler.steps()
        # Every token after each request's first came from one row of one decode step: no record was lost.
        assert sum(s.rows for s in steps if s.phase == "decode") == 4 * 47
        decode_steps = sum(s.phase == "decode" for s in steps)
        series = f'textgen_step_duration_seconds_count{{phase="decode"}} {decode_steps}.0'
        assert series in metrics.exposition()
        # Nothing to deliver between the first tokens and the last: the records waited for company.
        assert 2 * len([o for o in outputs if o.steps]) <= len(steps)

    run(main)


def cpus_of(pid: int) -> set[str]:
    """The CPU lists the threads of process `pid` may run on."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            found = re.search(r"Cpus_allowed_list:\s*(\S+)", (task / "status").read_text())
            assert found is not None
            lists.add(found.group(1))
    return lists


def test_the_engine_process_runs_on_its_cpus_and_the_server_on_the_others(
    loop: LoopThread, tiny_bundle: Path, cpus_restored: frozenset[int]
) -> None:
    assert len(cpus_restored) >= 2, "this test needs a machine of two CPUs or more"
    engine_cpu = min(cpus_restored)
    settings = loopback_settings(tiny_bundle, engine_cpus=frozenset({engine_cpu}))
    assert engine_settings(settings).session.threads == 1  # one intra-op thread per pinned CPU
    assert engine_settings(settings.model_copy(update={"threads": 3})).session.threads == 3
    server = RunningServer(loop, settings)
    try:
        scheduler = server.model.scheduler
        assert isinstance(scheduler, ProcessScheduler) and scheduler.pid is not None
        assert cpus_of(scheduler.pid) == {str(engine_cpu)}
        assert cpus_of(os.getpid()) == {format_cpu_list(cpus_restored - {engine_cpu})}
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            stopping = pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)
            reply = stub.Generate(pb.GenerateRequest(text="abc", stopping=stopping))
        assert len(reply.token_ids) == 4
    finally:
        server.stop()


def test_engine_cpus_this_process_may_not_use_fail_start_up(tiny_bundle: Path) -> None:
    result = run_serve("--bundle", str(tiny_bundle), "--port", "0", "--engine-cpus", "4095")
    assert result.returncode == 1
    allowed = format_cpu_list(allowed_cpus())
    assert f"start-up failed: engine_cpus 4095: this process may run on CPUs {allowed} only" in result.stderr


def test_recorded_metric_calls_replay_as_the_same_exposition() -> None:
    direct, replayed, recorder = Metrics(new_registry()), Metrics(new_registry()), MetricRecorder()
    for metrics in (direct, recorder):
        metrics.on_admitted(0.002)
        metrics.on_first_token(0.05)
        metrics.on_token(0.012)
        metrics.on_finished("eos", 7, 9, 4)
        metrics.on_step("decode", 3, 0.1, 0.01)
        metrics.set_load(3, 3, 8)
        metrics.set_priorities({-1: 2}, {0: 3})
        metrics.on_preempted(1)
        metrics.set_preempted_kv_bytes(2048)
    replay(replayed, recorder.take())
    assert recorder.take() == []

    def textgen_series(metrics: Metrics) -> list[str]:  # but *_created: when each series was made
        lines = metrics.exposition().splitlines()
        return [line for line in lines if line.startswith("textgen_") and "_created" not in line]

    assert textgen_series(replayed) == textgen_series(direct)
    assert "textgen_inter_token_latency_seconds_count 1.0" in textgen_series(direct)
    assert "textgen_preemptions_total 1.0" in textgen_series(direct)


def test_an_engine_process_that_will_not_stop_is_killed(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve.scheduling.engine_client, "STOP_TIMEOUT_SECONDS", 0.5)

    async def main() -> None:
        scheduler = ProcessScheduler(spec(bundle, InjectedFaults(slow_seconds=60)))
        await scheduler.start()
        stuck = scheduler.submit(request("slow-stuck", [5, 6, 7], 4))
        await stuck.__anext__()  # its first decode step now sleeps for a minute
        began = time.monotonic()
        await scheduler.drain(0.0)
        assert time.monotonic() - began < 10
        with pytest.raises(Draining):
            await collect(stuck)
        assert scheduler.pid is not None and not Path(f"/proc/{scheduler.pid}").exists()

    run(main)


# --- the server ------------------------------------------------------------------------------------------


def test_a_dead_engine_process_fails_its_requests_and_stops_serving(
    loop: LoopThread, tiny_bundle: Path
) -> None:
    running = RunningServer(loop, loopback_settings(tiny_bundle), InjectedFaults(0.02))
    scheduler = running.model.scheduler
    assert isinstance(scheduler, ProcessScheduler) and scheduler.pid is not None
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            stream = stub.GenerateStream(
                pb.GenerateRequest(
                    request_id="slow-victim", text="abc", stopping=pb.StoppingCriteria(max_new_tokens=40)
                )
            )
            next(stream)
            os.kill(scheduler.pid, signal.SIGKILL)
            error = rpc_error(lambda: list(stream))
            assert error.code() == grpc.StatusCode.INTERNAL
            assert "slow-victim" in error.details()
            assert "engine process exited unexpectedly" in error.details()
            assert running.server.failed is not None
            assert "exit code -9" in loop.run(asyncio.wait_for(asyncio.shield(running.server.failed), 10))
            assert health_status(running.target) == health_pb2.HealthCheckResponse.NOT_SERVING
            refused = rpc_error(lambda: stub.Generate(pb.GenerateRequest(text="abc")))
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(EngineFailure, match="has exited"):
            scheduler.submit(request("after", [5], 2))
    finally:
        running.stop()


def engine_pid(server: ServerProcess, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(server.lines):
            if found := re.search(r"engine process (\d+) ready", line):
                return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError("".join(server.lines))


def gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_the_server_process_exits_1_when_its_engine_process_dies(tiny_bundle: Path) -> None:
    server = ServerProcess("--bundle", str(tiny_bundle))
    try:
        server.wait_serving()
        os.kill(engine_pid(server), signal.SIGKILL)
        assert server.proc.wait(30) == 1
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert any("engine process exited unexpectedly" in line for line in server.lines), "".join(server.lines)


def test_a_killed_server_leaves_no_engine_process_behind(tiny_bundle: Path) -> None:
    server = ServerProcess("--bundle", str(tiny_bundle))
    try:
        server.wait_serving()
        pid = engine_pid(server)
        server.proc.kill()  # SIGKILL: no drain, no clean-up of its own
        server.proc.wait(30)
        assert gone(pid), f"engine process {pid} outlived its server"
    finally:
        if server.proc.poll() is None:
            server.proc.kill()

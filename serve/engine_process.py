"""The engine and its scheduler in a process of their own, beside the gRPC server's (vLLM v1's engine core).

In one process, the engine thread's Python between two ONNX Runtime calls (sampling, stopping,
detokenization, step records) and the event loop's (a gRPC message per stream and token, tokenizing
prompts) take turns on one GIL, so every message the server writes can hold the next engine step back. Here
the child process runs `BatchRunner` over the engine in a plain loop, as the offline API does; the server's
process keeps what faces the clients: validation, the request handles, metrics. A stream whose messages
cannot keep up with the engine receives what was produced meanwhile in one message instead of slowing it
down (docs/benchmarks.md: the demo model streamed to 16 clients, one process against two).

Messages over one `multiprocessing` pipe, pickled:
- server -> engine: `("submit", GenerationRequest)`, `("cancel", request_id)`, `("reject_waiting",)`
  (the start of a drain: fail the queue), `("stop",)` (fail what still runs, send it, exit);
- engine -> server: once `("ready", EngineInfo, resolved SchedulerLimits, max_total_tokens, snapshot)` or
  `("failed", exception)`, then a `StepOutput` after every pass of its loop that has outcomes to deliver;
  step records and metric calls alone wait up to `FLUSH_SECONDS` for company.
The child ignores SIGINT and SIGTERM (the server drains it) and exits when the pipe closes, so it never
outlives the server. If it dies (killed, out of memory), every request in flight fails with a clear error
and `exited` tells the server, which stops: a half-working server would only hide it from its supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from serve.bundle import Bundle
from serve.config import configure_logging, freeze_startup_objects
from serve.cpus import pin_process
from serve.engine import Engine, EngineInfo, EngineSettings, open_engine
from serve.errors import EngineFailure, TextgenError
from serve.request import GenerationRequest, validate_request
from serve.scheduler import (
    BatchEngine,
    BatchRunner,
    Delivery,
    EngineMetrics,
    HandleTable,
    Outcome,
    RequestHandle,
    SchedulerLimits,
    SchedulerSnapshot,
    StepRecord,
    draining,
    draining_error,
    outcomes,
    queue_full,
)

log = logging.getLogger("textgen.engine_process")

# How long a stopping engine process may take to send its last outcomes and exit before it is killed.
STOP_TIMEOUT_SECONDS = 10.0
# The longest step records and metric calls wait to go with outcomes. A small model's decode step takes
# ~1 ms, and unary requests have nothing to deliver in most steps: a message per step cost the engine
# process ~8% of its time (pickling, the pipe) and woke the server's event loop a thousand times a second.
FLUSH_SECONDS = 0.01


EngineWrap = Callable[[Engine], BatchEngine]


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine process needs to build the engine the server would have built in-process."""

    bundle: Bundle
    engine: EngineSettings
    limits: SchedulerLimits
    log_level: str = "INFO"
    # Wraps the engine before the scheduler gets it (tests slow it down or make a step fail); picklable.
    wrap: EngineWrap | None = None
    cpus: frozenset[int] | None = None  # where the engine process runs (serve/cpus.py); None: anywhere


MetricCall = tuple[str, tuple[Any, ...]]


class MetricRecorder:
    """`EngineMetrics` that only records the calls, for the server's process to replay on its `Metrics`:
    a call costs a tuple here instead of a lock and a histogram bucket search between engine steps."""

    def __init__(self) -> None:
        self.calls: list[MetricCall] = []

    def on_admitted(self, queue_seconds: float) -> None:
        self.calls.append(("on_admitted", (queue_seconds,)))

    def on_first_token(self, ttft_seconds: float) -> None:
        self.calls.append(("on_first_token", (ttft_seconds,)))

    def on_token(self, inter_token_seconds: float) -> None:
        self.calls.append(("on_token", (inter_token_seconds,)))

    def on_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, cached_prompt_tokens: int
    ) -> None:
        self.calls.append(("on_finished", (reason, prompt_tokens, generation_tokens, cached_prompt_tokens)))

    def on_step(self, phase: str, batch_size: int, padding_ratio: float, seconds: float) -> None:
        self.calls.append(("on_step", (phase, batch_size, padding_ratio, seconds)))

    def set_load(self, running: int, waiting: int, kv_used: int, kv_capacity: int) -> None:
        self.calls.append(("set_load", (running, waiting, kv_used, kv_capacity)))

    def take(self) -> list[MetricCall]:
        calls, self.calls = self.calls, []
        return calls


def replay(metrics: EngineMetrics, calls: list[MetricCall]) -> None:
    for name, args in calls:
        getattr(metrics, name)(*args)


@dataclass(frozen=True)
class StepOutput:
    """What one pass of the engine process's loop produced."""

    outcomes: list[Outcome]
    metric_calls: list[MetricCall]
    snapshot: SchedulerSnapshot
    steps: tuple[StepRecord, ...]  # the engine steps run since the previous output
    received: int  # submit commands the engine process has read so far


# --- the engine process ---------------------------------------------------------------------------------


def engine_main(conn: Connection, spec: EngineSpec) -> None:
    """The child's entry point: build the engine, say so, then serve commands until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(spec.log_level)
    if spec.cpus is not None:
        pin_process(spec.cpus)  # before ONNX Runtime starts its threads, which inherit it
    recorder = MetricRecorder()
    try:
        engine = open_engine(spec.bundle, spec.engine)
        scheduled = spec.wrap(engine) if spec.wrap else engine
        runner = BatchRunner(scheduled, spec.limits.resolve(engine), recorder)
    except Exception as exc:
        conn.send(("failed", _picklable(exc)))
        return
    log.info("engine process: froze %d start-up objects", freeze_startup_objects())
    conn.send(("ready", engine.info, runner.limits, runner.max_total_tokens, runner.snapshot()))
    try:
        _EngineLoop(conn, runner, recorder).run()
    except (EOFError, BrokenPipeError):  # the server's process is gone: nobody is left to serve
        log.warning("the server closed the engine pipe; the engine process exits")


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _EngineLoop:
    def __init__(self, conn: Connection, runner: BatchRunner, recorder: MetricRecorder) -> None:
        self._conn = conn
        self._runner = runner
        self._recorder = recorder
        self._received = 0
        self._last_step: StepRecord | None = None
        self._steps: list[StepRecord] = []  # run since the last output
        self._sent_at = 0.0

    def run(self) -> None:
        while True:
            if self._runner.idle:
                self._conn.poll(None)  # nothing to step: sleep until the server sends something
            deliveries: list[Delivery] = []
            while self._conn.poll():
                command = self._conn.recv()
                if command[0] == "stop":
                    self._send_now(outcomes(self._runner.abort(draining_error)))
                    return
                deliveries += self._command(command)
            if not self._runner.idle:
                deliveries += self._runner.safe_step()
            self._send(deliveries)

    def _command(self, command: tuple[Any, ...]) -> list[Delivery]:
        kind = command[0]
        if kind == "submit":
            self._received += 1
            request: GenerationRequest = command[1]
            try:  # the server checked both already; this is the scheduler's own word
                self._runner.enqueue(self._runner.track(request))
            except TextgenError as exc:
                self._send_now([(request.request_id, exc)])
        elif kind == "cancel":
            self._runner.request_cancel(command[1])
        elif kind == "reject_waiting":
            return self._runner.reject_waiting(draining_error)
        else:
            raise ValueError(f"unknown engine process command {kind!r}")
        return []

    def _send(self, deliveries: list[Delivery]) -> None:
        step = self._runner.last_step
        if step is not None and step is not self._last_step:
            self._steps.append(step)
            self._last_step = step
        done = outcomes(deliveries)
        if done or self._runner.idle or time.monotonic() - self._sent_at >= FLUSH_SECONDS:
            self._send_now(done)

    def _send_now(self, done: list[Outcome]) -> None:
        calls = self._recorder.take()
        if not (done or calls or self._steps):
            return
        steps, self._steps = tuple(self._steps), []
        self._conn.send(StepOutput(done, calls, self._runner.snapshot(), steps, self._received))
        self._sent_at = time.monotonic()


# --- the server's side -----------------------------------------------------------------------------------


@dataclass
class _Started:
    info: EngineInfo
    limits: SchedulerLimits
    max_total_tokens: int
    snapshot: SchedulerSnapshot  # the engine process's latest


class ProcessScheduler:
    """The server's side of an engine process: a `RequestScheduler` whose engine runs in a child process.

    `submit` checks a request here (InvalidRequest, QueueFull, Draining at once, as `Scheduler` does) and
    hands it over; outcomes come back after every engine step and feed the request handles on the event
    loop. `exited` completes if the engine process ends without being told to.
    """

    def __init__(self, spec: EngineSpec, metrics: EngineMetrics | None = None) -> None:
        self._spec = spec
        self._metrics = metrics
        self._handles = HandleTable()
        self._steps: deque[StepRecord] = deque(maxlen=spec.limits.step_history)
        self._rejected = 0  # refused here for a full queue (the engine process counts the rest)
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._sent = 0  # submit commands handed to the engine process
        self._received = 0  # of them, read by the engine process as of the latest output
        self._draining = False
        self._stopping = False
        self._started: _Started | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = asyncio.Event()
        self.exited: asyncio.Future[str] | None = None

    # -- start -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the engine process and wait until its engine is warmed up; raises what building it raised
        (BundleError, ValueError for providers, ...)."""
        if self._process is not None:
            raise RuntimeError("the scheduler is already started")
        self._loop = asyncio.get_running_loop()
        self.exited = self._loop.create_future()
        # spawn, not fork: the server's process runs gRPC threads, which a forked child must not inherit.
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=engine_main, args=(child, self._spec), name="textgen-engine", daemon=True
        )
        self._process.start()
        child.close()
        try:
            hello = await asyncio.to_thread(self._conn.recv)
        except EOFError:
            await asyncio.to_thread(self._process.join)
            raise EngineFailure(
                f"the engine process exited while starting (exit code {self._process.exitcode})"
            ) from None
        except BaseException:  # cancelled (a signal during start-up): the half-built engine goes too
            self._process.kill()
            raise
        if hello[0] == "failed":
            await asyncio.to_thread(self._process.join)
            raise hello[1]
        self._started = _Started(*hello[1:])
        log.info("engine process %d ready", self._process.pid)
        threading.Thread(target=self._read, name="textgen-engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="textgen-engine-writer", daemon=True).start()

    @property
    def _ready(self) -> _Started:
        if self._started is None:
            raise RuntimeError("ProcessScheduler.start() was not awaited")
        return self._started

    @property
    def info(self) -> EngineInfo:
        return self._ready.info

    @property
    def limits(self) -> SchedulerLimits:
        return self._ready.limits

    @property
    def max_total_tokens(self) -> int:
        return self._ready.max_total_tokens

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # -- requests ----------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Hand a request to the engine process; raises InvalidRequest, QueueFull, Draining or
        EngineFailure at once. Call on the event loop."""
        started = self._ready
        rid = request.request_id
        if self.exited is not None and self.exited.done():
            raise EngineFailure(f"request {rid}: the engine process has exited; the server is stopping")
        if self._draining:
            raise draining(rid)
        self._handles.check_free(rid)
        validate_request(request, started.info.vocab_size, started.max_total_tokens)
        if self._waiting >= started.limits.max_queue:
            self._rejected += 1
            raise queue_full(rid, started.limits.max_queue)
        assert self._loop is not None
        self._post(("submit", request))
        self._sent += 1
        return self._handles.open(rid, self._loop, lambda: self._post(("cancel", rid)))

    @property
    def _waiting(self) -> int:
        """Requests queued in the engine process as of its latest output, and those sent since."""
        return self._ready.snapshot.waiting + self._sent - self._received

    def snapshot(self) -> SchedulerSnapshot:
        """The engine process's scheduler after its latest step (the queue counts what was sent since)."""
        latest = self._ready.snapshot
        outcomes = dict(latest.outcomes)
        if self._rejected:
            outcomes["rejected"] = outcomes.get("rejected", 0) + self._rejected
        return replace(latest, waiting=self._waiting, outcomes=outcomes)

    def steps(self) -> list[StepRecord]:
        return list(self._steps)

    # -- stop --------------------------------------------------------------------------------------------
    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting, let running requests finish within the grace period, fail the rest, stop the
        engine process (killed if it does not exit within STOP_TIMEOUT_SECONDS)."""
        self._draining = True
        if self._process is None:
            return
        self._post(("reject_waiting",))
        deadline = time.monotonic() + grace_seconds
        while len(self._handles) and time.monotonic() < deadline and not self._closed.is_set():
            await asyncio.sleep(0.01)
        self._stopping = True
        self._post(("stop",))
        self._post(None)
        try:
            await asyncio.wait_for(self._closed.wait(), STOP_TIMEOUT_SECONDS)
        except TimeoutError:
            log.error("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_SECONDS)
            self._process.kill()
        await asyncio.to_thread(self._process.join)
        self._handles.fail_all(draining)

    # -- the pipe ----------------------------------------------------------------------------------------
    def _post(self, command: tuple[Any, ...] | None) -> None:
        """Queue a command for the writer thread: a full pipe (the engine busy with a long step) must not
        block the event loop."""
        self._outbox.put(command)

    def _write(self) -> None:
        assert self._conn is not None
        while (command := self._outbox.get()) is not None:
            try:
                self._conn.send(command)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        assert self._conn is not None and self._loop is not None
        while True:
            try:
                output = self._conn.recv()
            except (EOFError, OSError):
                break
            if not self._call_soon(self._receive, output):
                return
        self._call_soon(self._on_closed)

    def _call_soon(self, callback: Callable[..., None], *args: Any) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop closed without draining us
            return False
        return True

    def _receive(self, output: StepOutput) -> None:
        if self._metrics is not None:
            replay(self._metrics, output.metric_calls)
        self._steps.extend(output.steps)
        self._ready.snapshot = output.snapshot
        self._received = output.received
        self._handles.deliver(output.outcomes)

    def _on_closed(self) -> None:
        self._closed.set()
        self._post(None)
        if self._stopping:
            return
        assert self._process is not None and self.exited is not None
        self._process.join(1.0)
        reason = f"the engine process exited unexpectedly (exit code {self._process.exitcode})"
        log.error("%s; failing %d requests in flight", reason, len(self._handles))
        self._handles.fail_all(lambda rid: EngineFailure(f"request {rid}: {reason}"))
        if not self.exited.done():
            self.exited.set_result(reason)

"""The server's side of an engine process: `ProcessScheduler`, a `RequestScheduler` whose engine runs in a
child process (serve/scheduling/engine_core.py), spoken to over one pipe (serve/scheduling/messages.py).

If the child dies (killed, out of memory), every request in flight fails with a clear error and `exited`
tells the server, which stops: a half-working server would only hide it from its supervisor.

The child can be started before the server knows what to build (`EngineProcess`): `textgen-serve` starts it
first thing, so that its imports (the engine's modules) overlap the server's own and its spec (the KV rows
sized from the bundle's manifest) arrives as soon as the server has it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from serve.engine.types import EngineInfo
from serve.errors import EngineFailure
from serve.scheduling.adapters import AdapterUpdate, UpdateResult
from serve.scheduling.engine_protocol import EngineMetrics, SchedulerMetrics
from serve.scheduling.handles import HandleTable, RequestHandle
from serve.scheduling.intake import SchedulerSnapshot, StepRecord, draining, queue_full
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.messages import (
    AdaptersUpdated,
    Cancel,
    Command,
    EngineSpec,
    Failed,
    MetricCall,
    Ready,
    RejectWaiting,
    StepOutput,
    Stop,
    Submit,
    UpdateAdapters,
)
from serve.scheduling.request import GenerationRequest
from serve.scheduling.request_checks import validate_request

log = logging.getLogger("textgen.engine_process")

# How long a stopping engine process may take to send its last outcomes and exit before it is killed.
STOP_TIMEOUT_SECONDS = 10.0


def replay(metrics: EngineMetrics, calls: list[MetricCall]) -> None:
    for name, args in calls:
        getattr(metrics, name)(*args)


def _engine_process_main(conn: Connection) -> None:
    # Imported in the child only: the server's process starts it before it imports the engine's modules.
    from serve.scheduling.engine_core import engine_main

    engine_main(conn)


class EngineProcess:
    """A started engine process waiting for its `EngineSpec` (the first message over its pipe), which
    `ProcessScheduler.start` sends; `close` ends one that never got it."""

    def __init__(self) -> None:
        # spawn, not fork: the server's process runs gRPC threads, which a forked child must not inherit.
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_process_main, args=(child,), name="textgen-engine", daemon=True
        )
        self.process.start()
        child.close()

    def close(self) -> None:
        """Close the pipe and wait for the process to end: one still waiting for its spec exits at once (a
        started scheduler stops it first, `ProcessScheduler.drain`)."""
        self.conn.close()
        self.process.join(STOP_TIMEOUT_SECONDS)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class _Latest(NamedTuple):
    """The engine process's latest snapshot and the submit commands it had read by then: replaced together,
    so the metrics' thread never reads one without the other."""

    snapshot: SchedulerSnapshot
    received: int


@dataclass
class _Started:
    info: EngineInfo
    limits: SchedulerLimits
    max_total_tokens: int
    latest: _Latest


class ProcessScheduler:
    """The server's side of an engine process: a `RequestScheduler` whose engine runs in a child process.

    `submit` checks a request here (InvalidRequest, QueueFull, Draining at once, as `Scheduler` does) and
    hands it over; outcomes come back after every engine step and feed the request handles on the event
    loop. `exited` completes if the engine process ends without being told to.
    """

    def __init__(
        self, spec: EngineSpec, metrics: SchedulerMetrics | None = None, process: EngineProcess | None = None
    ) -> None:
        """`process`: the engine process, started ahead; None: `start` starts one."""
        self._spec = spec
        self._spawned = process
        self._metrics = metrics
        self._handles = HandleTable()
        self._steps: deque[StepRecord] = deque(maxlen=spec.limits.step_history)
        self._rejected = 0  # refused here for a full queue (the engine process counts the rest)
        self._outbox: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sent = 0  # submit commands handed to the engine process
        self._draining = False
        self._stopping = False
        self._started: _Started | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._closed = asyncio.Event()
        self._updates: dict[int, asyncio.Future[UpdateResult]] = {}  # sent, not yet answered
        self._update_ids = itertools.count()
        self.exited: asyncio.Future[str] | None = None

    # -- start -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Send the engine process (started now unless it was given) its spec and wait until its engine is
        warmed up; raises what building it raised (BundleError, ValueError for providers, ...)."""
        if self._process is not None:
            raise RuntimeError("the scheduler is already started")
        self._loop = asyncio.get_running_loop()
        self.exited = self._loop.create_future()
        engine = self._spawned or EngineProcess()
        self._process, self._conn = engine.process, engine.conn
        try:
            self._conn.send(self._spec)
            hello = await asyncio.to_thread(self._conn.recv)
        except (EOFError, BrokenPipeError):
            await asyncio.to_thread(self._process.join)
            raise EngineFailure(
                f"the engine process exited while starting (exit code {self._process.exitcode})"
            ) from None
        except BaseException:  # cancelled (a signal during start-up): the half-built engine goes too
            self._process.kill()
            raise
        if isinstance(hello, Failed):
            await asyncio.to_thread(self._process.join)
            raise hello.error
        assert isinstance(hello, Ready), hello
        self._started = _Started(hello.info, hello.limits, hello.max_total_tokens, _Latest(hello.snapshot, 0))
        if self._metrics is not None:
            self._metrics.watch_waiting(lambda: self._waiting)
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
        """The engine's description; its adapters are those served now (`update_adapters` changes them)."""
        return self._ready.info

    async def update_adapters(self, update: AdapterUpdate) -> UpdateResult:
        """Load or unload a LoRA adapter in the engine process, between two of its steps; raises the error
        that left the adapters as they were (InvalidRequest, NotFound, EngineFailure). On the event loop."""
        if self._loop is None:
            raise RuntimeError("ProcessScheduler.start() was not awaited")
        if self._draining or self._closed.is_set():
            raise draining("adapter update")
        update_id = next(self._update_ids)
        reply: asyncio.Future[UpdateResult] = self._loop.create_future()
        self._updates[update_id] = reply
        self._post(UpdateAdapters(update_id, update))
        return await reply

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
        validate_request(
            request, started.info.vocab_size, started.max_total_tokens, adapters=started.info.adapters
        )
        if self._waiting >= started.limits.max_queue:
            self._rejected += 1
            raise queue_full(rid, started.limits.max_queue)
        assert self._loop is not None
        self._post(Submit(request))
        self._sent += 1
        return self._handles.open(rid, self._loop, lambda: self._post(Cancel(rid)))

    @property
    def _waiting(self) -> int:
        """Requests queued in the engine process as of its latest output, and those sent since (read by the
        metrics' thread too). One admitted by the step now running counts until that step ends: the engine
        process tells only then."""
        latest = self._ready.latest
        return latest.snapshot.waiting + self._sent - latest.received

    def snapshot(self) -> SchedulerSnapshot:
        """The engine process's scheduler after its latest step (the queue counts what was sent since)."""
        latest = self._ready.latest.snapshot
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
        self._post(RejectWaiting())
        deadline = time.monotonic() + grace_seconds
        while len(self._handles) and time.monotonic() < deadline and not self._closed.is_set():
            await asyncio.sleep(0.01)
        self._stopping = True
        self._post(Stop())
        self._post(None)
        try:
            await asyncio.wait_for(self._closed.wait(), STOP_TIMEOUT_SECONDS)
        except TimeoutError:
            log.error("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_SECONDS)
            self._process.kill()
        await asyncio.to_thread(self._process.join)
        self._handles.fail_all(draining)

    # -- the pipe ----------------------------------------------------------------------------------------
    def _post(self, command: Command | None) -> None:
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

    def _receive(self, output: StepOutput | AdaptersUpdated) -> None:
        if isinstance(output, AdaptersUpdated):
            self._updated(output)
            return
        if self._metrics is not None:
            replay(self._metrics, output.metric_calls)
        self._steps.extend(output.steps)
        self._ready.latest = _Latest(output.snapshot, output.received)
        self._handles.deliver(output.outcomes)

    def _updated(self, reply: AdaptersUpdated) -> None:
        """An update made or refused: the front end's adapters follow the engine's (also when the caller
        went away meanwhile: the update was made all the same)."""
        future = self._updates.pop(reply.update_id)
        if reply.result is not None:
            self._ready.info = replace(self._ready.info, adapters=reply.result.adapters)
        if future.done():
            return
        if reply.result is None:
            future.set_exception(reply.error or EngineFailure("the engine process refused the update"))
        else:
            future.set_result(reply.result)

    def _on_closed(self) -> None:
        self._closed.set()
        for future in self._updates.values():
            if not future.done():
                future.set_exception(EngineFailure("the engine process stopped before the adapter update"))
        self._updates.clear()
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

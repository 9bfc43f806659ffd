"""Continuous batching on one engine thread in this process, bridged to asyncio.

`Scheduler` runs `BatchRunner` (serve/scheduling/runner.py; the admission policy is planner.py's) on ONE
dedicated thread (ONNX Runtime releases the GIL while it computes) and hands events to the event loop with
`loop.call_soon_threadsafe`, one call per step. `engine_client.ProcessScheduler` runs the same runner in a
process of its own; the server takes either as a `RequestScheduler`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from serve.bundle import Bundle, load_bundle
from serve.engine.engine import open_engine
from serve.engine.prepared import prepare_bundle
from serve.engine.types import EngineInfo, EngineSettings
from serve.scheduling.adapters import AdapterUpdate, UpdateResult
from serve.scheduling.engine_protocol import BatchEngine, SchedulerMetrics
from serve.scheduling.handles import HandleTable, RequestHandle
from serve.scheduling.intake import (
    Delivery,
    SchedulerSnapshot,
    StepRecord,
    draining,
    draining_error,
    outcomes,
)
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.messages import EngineSpec
from serve.scheduling.request import GenerationRequest
from serve.scheduling.runner import BatchRunner

log = logging.getLogger(__name__)


class RequestScheduler(Protocol):
    """What the server needs of a scheduler: `Scheduler` (an engine thread in this process) or
    `serve.scheduling.engine_client.ProcessScheduler` (the engine in a process of its own)."""

    @property
    def max_total_tokens(self) -> int: ...
    @property
    def info(self) -> EngineInfo: ...  # its adapters: those served now
    async def start(self) -> None: ...
    async def update_adapters(self, update: AdapterUpdate) -> UpdateResult: ...
    def submit(self, request: GenerationRequest) -> RequestHandle: ...
    def snapshot(self) -> SchedulerSnapshot: ...
    def steps(self) -> list[StepRecord]: ...
    async def drain(self, grace_seconds: float) -> None: ...


class Scheduler:
    """Continuous batching on one engine thread; `submit` and the handles live on the event loop."""

    def __init__(
        self,
        engine: BatchEngine,
        limits: SchedulerLimits | None = None,
        metrics: SchedulerMetrics | None = None,
        info: EngineInfo | None = None,  # the engine's (Engine.info); None: a test's engine without one
    ) -> None:
        self.limits = (limits or SchedulerLimits()).resolve(engine)
        self._info = info
        self._engine = engine
        self._runner = BatchRunner(engine, self.limits, metrics)
        if metrics is not None:
            metrics.watch_waiting(lambda: self._runner.waiting)
        self._handles = HandleTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._draining = False
        self._stopping = False

    @property
    def max_total_tokens(self) -> int:
        """The most prompt + max_new_tokens one request may ask for."""
        return self._runner.max_total_tokens

    @property
    def info(self) -> EngineInfo:
        """The engine's description; its adapters are those served now (`update_adapters` changes them)."""
        if self._info is None:
            raise RuntimeError("this scheduler was given no EngineInfo")
        return self._info

    async def update_adapters(self, update: AdapterUpdate) -> UpdateResult:
        """Load or unload a LoRA adapter on the engine thread, between two steps; raises the error that
        left the adapters as they were (InvalidRequest, NotFound). Call on the event loop."""
        if self._draining:
            raise draining("adapter update")
        reply = asyncio.wrap_future(self._runner.request_update(update))
        reply.add_done_callback(self._updated)
        return await asyncio.shield(reply)  # a caller that goes away leaves it to be made all the same

    def _updated(self, reply: asyncio.Future[UpdateResult]) -> None:
        """An update made or refused: the adapters named here follow the engine's."""
        if not reply.cancelled() and reply.exception() is None:
            self._info = replace(self.info, adapters=reply.result().adapters)

    async def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the scheduler is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="textgen-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; raises InvalidRequest, QueueFull or Draining at once. Call on the event loop."""
        if self._loop is None:
            raise RuntimeError("Scheduler.start() was not awaited")
        if self._draining:
            raise draining(request.request_id)
        self._handles.check_free(request.request_id)
        tracker = self._runner.track(request)
        self._runner.enqueue(tracker)

        def cancel() -> None:
            tracker.request_cancel()
            self._runner.wake()

        return self._handles.open(request.request_id, self._loop, cancel)

    def snapshot(self) -> SchedulerSnapshot:
        return self._runner.snapshot()

    def steps(self) -> list[StepRecord]:
        """The most recent engine steps, oldest first (at most `limits.step_history`)."""
        return self._runner.steps()

    async def drain(self, grace_seconds: float) -> None:
        """Stop admitting, let running requests finish within the grace period, fail the rest, stop."""
        self._draining = True
        self._handles.deliver(outcomes(self._runner.reject_waiting(draining_error)))
        deadline = time.monotonic() + grace_seconds
        while not self._runner.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopping = True
        self._runner.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        # The thread posted its last deliveries with call_soon_threadsafe; let them run before returning.
        await asyncio.sleep(0)

    def _run(self) -> None:
        while True:
            self._runner.wait_for_work(lambda: self._stopping)
            if self._stopping:
                break
            if not self._post(self._runner.safe_step()):
                return
        self._post(self._runner.abort(draining_error))
        self._runner.drop_updates(draining("adapter update"))

    def _post(self, deliveries: list[Delivery]) -> bool:
        """Hand deliveries to the event loop; False once the loop is closed (nobody is left to tell)."""
        assert self._loop is not None
        if not deliveries:
            return True
        try:
            self._loop.call_soon_threadsafe(self._handles.deliver, outcomes(deliveries))
        except RuntimeError:  # the loop closed without draining us
            log.warning("event loop closed; the engine thread stops")
            return False
        return True


async def open_in_thread(spec: EngineSpec, metrics: SchedulerMetrics | None = None) -> Scheduler:
    """The engine built and warmed up in this process, and a started `Scheduler` over it (the in-process
    twin of `ProcessScheduler`, built from the same spec; `spec.cpus` is not used here)."""
    engine = await asyncio.to_thread(lambda: open_engine(load_bundle(spec.bundle), spec.engine))
    scheduler = Scheduler(spec.wrap(engine) if spec.wrap else engine, spec.limits, metrics, engine.info)
    await scheduler.start()
    return scheduler


def prepare_graph(bundle: Bundle, settings: EngineSettings) -> Path:
    """The compiled-cache entry an engine of `settings` serves `bundle` from, prepared now unless a usable one
    is there (`textgen-serve --prepare-only`); BundleError when it cannot be."""
    assert settings.compiled_cache is not None
    return prepare_bundle(bundle, settings.session, settings.kv_cache_dtype, settings.compiled_cache)

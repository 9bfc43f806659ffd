"""The runner's books (serve/scheduling/runner.py): requests tracked and queued from any thread, those
running, what became of each (its Delivery, the outcome counts), and what it reports of its load (the
snapshot, the metrics' gauges).

`enqueue`, `reject_waiting`, `request_cancel`, `request_update` and `wake` may be called from any thread:
`_cv` guards the queue (waiting and compiling requests, adapter updates) and wakes the engine thread. Every
other method runs on the engine thread. A constrained request's constraint is compiled when it is tracked,
on the worker threads of the engine's compiler (serve/engine/constraints.py; its cache lives as long as the
engine); it joins the queue once compiled, or is refused (InvalidRequest) at the next step if llguidance
rejects it, so no compile ever holds a step back.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from serve.errors import Draining, EngineFailure, InvalidRequest, QueueFull, TextgenError
from serve.scheduling.adapters import AdapterUpdate, UpdateResult, lora_engine, unknown_adapter
from serve.scheduling.engine_protocol import (
    BatchEngine,
    EngineMetrics,
    PriorityCounts,
    StepKind,
    priority_counts,
)
from serve.scheduling.handles import Outcome
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.planner import NO_STEP, Planner
from serve.scheduling.request import Event, GenerationRequest, RequestState, RequestTracker
from serve.scheduling.request_checks import validate_request

if TYPE_CHECKING:
    from serve.engine.constraints import ConstraintCompiler
    from serve.engine.types import CompiledConstraint


@dataclass(frozen=True)
class StepRecord:
    """One engine step. `padded_tokens`: token slots it computed, padding included (decode: rows x longest
    context; prefill: rows prefilled together x their longest prompt, plus the uncached tokens of each
    prefix-cache hit, which runs alone); `real_tokens`: the tokens among them."""

    phase: StepKind  # PREFILL | DECODE
    rows: int
    padded_tokens: int
    real_tokens: int
    seconds: float

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


@dataclass(frozen=True)
class SchedulerSnapshot:
    running: int
    waiting: int
    kv_slots_used: int  # the engine's rows in use after the last step (its batch size)
    kv_slots_capacity: int
    kv_tokens_reserved: int  # sum of running requests' prompt + max_new_tokens
    kv_shape: tuple[int, ...]  # the engine's live KV view after the last step
    outcomes: dict[str, int]  # finished / cancelled / expired / failed / rejected


class Delivery(NamedTuple):
    """What a step produced for one request (an event or the error that ends it), for its tracker."""

    tracker: RequestTracker
    item: Event | TextgenError


class Intake:
    """The runner's queue, running requests, outcomes and reports."""

    def __init__(
        self, engine: BatchEngine, limits: SchedulerLimits, metrics: EngineMetrics | None = None
    ) -> None:
        self.engine = engine
        self.limits = limits
        self._metrics = metrics
        self._cv = threading.Condition()  # guards _waiting; wakes the engine thread
        self._stats_lock = threading.Lock()  # guards _steps and _outcomes (read by other threads)
        self._waiting: deque[RequestTracker] = deque()
        self._compiling: list[RequestTracker] = []  # queued, their constraint still compiling (guarded too)
        self._refused: list[RequestTracker] = []  # their constraint was rejected: refused at the next step
        self._running: dict[str, RequestTracker] = {}  # insertion order is not the engine's row order
        self._steps: deque[StepRecord] = deque(maxlen=limits.step_history)
        self._outcomes: Counter[str] = Counter()
        self._planner = Planner(limits, engine)
        self._last_phase: StepKind | None = None  # of the latest prefill or decode: no two prefills in a row
        self._background = NO_STEP  # the record the prefill beside the decode steps writes once joined
        self._partial: list[Delivery] = []
        self._load = _Load(0, engine.batch_size, engine.kv_shape(), 0)
        self.last_step: StepRecord | None = None  # the latest step's record (replaced, never mutated)
        self._masks_seen = engine.mask_stats.copy()  # the masks' cost the metrics have been told of
        self._compiler: ConstraintCompiler | None = None  # the engine's, once a request has a constraint
        self._priorities: tuple[PriorityCounts, PriorityCounts] = ({}, {})  # as the metrics were last told
        self._swapped_bytes = 0  # the preempted requests' host memory, as the metrics were last told
        self._lora = lora_engine(engine)  # None: the engine serves no adapters
        self._updates: list[tuple[AdapterUpdate, Future[UpdateResult]]] = []  # made at the next step
        self._slot_counts = (0, 0)  # the engine's adapter loads and evictions the metrics were told of
        self._lora_requests: tuple[str, str] | None = None  # running and waiting adapters, as last told
        if metrics is not None:  # the gateway sees the slots, and the adapters loaded at start, at once
            self._publish_adapters(metrics)

    @property
    def max_total_tokens(self) -> int:
        """The most KV tokens one request may occupy: its slot, and the whole batch budget at most."""
        return min(self.engine.capacity, self.limits.batch_tokens)

    def track(self, request: GenerationRequest, *, stop_at_context: bool = False) -> RequestTracker:
        """Validate a request (InvalidRequest) and start its state machine, and its constraint's compile."""
        validate_request(
            request, self.engine.vocab_size, self.max_total_tokens, stop_at_context=stop_at_context
        )
        tracker = RequestTracker(
            request, self.engine.tokenizer, self.engine.eos_token_ids, self.max_total_tokens, time.monotonic()
        )
        if request.constraint is not None:
            self._compiler = self.engine.constraint_compiler
            tracker.compiled = self._compiler.submit(request.constraint)
        return tracker

    def enqueue(self, tracker: RequestTracker) -> None:
        """Queue a tracked request; one whose constraint still compiles joins the queue once it has."""
        with self._cv:  # an unload holds it too: a request never queues for an adapter being unloaded
            self._check_adapter(tracker.request)
            if self.waiting >= self.limits.max_queue:
                self.count("rejected")
                raise queue_full(tracker.request_id, self.limits.max_queue)
            compiled = tracker.compiled
            if compiled is None or compiled.done():
                self._queue(tracker)
            else:
                self._compiling.append(tracker)
                compiled.add_done_callback(functools.partial(self._compiled, tracker))
            self._cv.notify()

    def _check_adapter(self, request: GenerationRequest) -> None:
        """NotFound for an adapter unloaded since the front end checked the request."""
        if request.adapter and self._lora is not None and request.adapter not in self._lora.adapter_names:
            raise unknown_adapter(request.request_id, request.adapter, self._lora.adapter_names)

    def request_update(self, update: AdapterUpdate) -> Future[UpdateResult]:
        """Queue a change to the served adapters, made between two engine steps; the future gets the
        adapters served after it, or the error that left them as they were."""
        future: Future[UpdateResult] = Future()
        with self._cv:
            self._updates.append((update, future))
            self._cv.notify_all()
        return future

    def _compiled(self, tracker: RequestTracker, _done: Future[CompiledConstraint]) -> None:
        """A constraint's compile ended (on the compiler's thread): its request joins the queue."""
        with self._cv:
            if not any(t is tracker for t in self._compiling):  # cancelled or rejected meanwhile
                return
            self._compiling = [t for t in self._compiling if t is not tracker]
            self._queue(tracker)
            self._cv.notify_all()

    def _queue(self, tracker: RequestTracker) -> None:
        """Under the lock: into the queue, or among the refused if its constraint was rejected."""
        compiled = tracker.compiled
        if compiled is not None and compiled.exception() is not None:
            self._refused.append(tracker)
        else:
            self._waiting.append(tracker)

    def reject_waiting(self, error: Callable[[RequestTracker], TextgenError]) -> list[Delivery]:
        """Fail every queued request (used when draining: they can be retried elsewhere at once)."""
        with self._cv:
            # A preempted request stays: it is as far along as a running one, and resumes as rows free up.
            rejected = [*(t for t in self._waiting if not t.preempted), *self._compiling]
            self._waiting = deque(t for t in self._waiting if t.preempted)
            self._compiling = []
        deliveries: list[Delivery] = []
        self._refuse(deliveries)
        self._fail_all(rejected, error, deliveries)
        return deliveries

    def request_cancel(self, request_id: str) -> None:
        """Mark a queued or running request cancelled: it leaves at the next step (no effect once ended)."""
        with self._cv:
            tracker = self._running.get(request_id) or next(
                (t for t in (*self._waiting, *self._compiling) if t.request_id == request_id), None
            )
        if tracker is not None:
            tracker.request_cancel()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def wait_for_work(self, stop: Callable[[], bool]) -> None:
        """Until a step has something to do (requests only compiling give it nothing yet), or `stop()`."""
        with self._cv:
            self._cv.wait_for(lambda: self.ready or stop())

    @property
    def idle(self) -> bool:
        return not (self._running or self._waiting or self._compiling or self._refused or self._updates)

    @property
    def ready(self) -> bool:
        """Whether a step has something to do: requests running, queued, or to refuse, or an update."""
        return bool(self._running or self._waiting or self._refused or self._updates)

    @property
    def waiting(self) -> int:
        """Queued requests, those whose constraint still compiles included (any thread: a compile that ends
        moves its request between the two under the lock)."""
        with self._cv:
            return len(self._waiting) + len(self._compiling)

    def count(self, outcome: str) -> None:
        with self._stats_lock:
            self._outcomes[outcome] += 1

    def steps(self) -> list[StepRecord]:
        with self._stats_lock:
            return list(self._steps)

    def snapshot(self) -> SchedulerSnapshot:
        load = self._load  # one object, replaced whole by the engine thread after every step
        with self._stats_lock:
            outcomes = dict(self._outcomes)
        return SchedulerSnapshot(
            running=load.running,
            waiting=self.waiting,
            kv_slots_used=load.batch_size,
            kv_slots_capacity=self.engine.max_batch_size,
            kv_tokens_reserved=load.reserved,
            kv_shape=load.kv_shape,
            outcomes=outcomes,
        )

    def drop_updates(self, error: TextgenError) -> None:
        """Refuse the updates not made yet (the engine thread stops): their callers must not wait forever."""
        with self._cv:
            updates, self._updates = self._updates, []
        for _, future in updates:
            future.set_exception(error)

    def _refuse(self, out: list[Delivery]) -> None:
        """Refuse the requests whose constraint llguidance rejected, with its message."""
        with self._cv:
            refused, self._refused = self._refused, []
        now = time.monotonic()
        for tracker in refused:
            assert tracker.compiled is not None
            if tracker.done:
                continue
            tracker.end(RequestState.FAILED, now)
            self.count("rejected")
            reason = tracker.compiled.exception()
            out.append(Delivery(tracker, InvalidRequest(f"request {tracker.request_id}: {reason}")))

    def _fail_all(
        self,
        trackers: Sequence[RequestTracker],
        error: Callable[[RequestTracker], TextgenError],
        out: list[Delivery],
    ) -> None:
        now = time.monotonic()
        for tracker in trackers:
            if tracker.done:  # it ended earlier in this step; its outcome was already delivered
                continue
            tracker.end(RequestState.FAILED, now)
            self.count("failed")
            out.append(Delivery(tracker, error(tracker)))

    def _publish_load(self) -> None:
        running = self._running.values()
        self._load = _Load(
            len(running),
            self.engine.batch_size,
            self.engine.kv_shape(),
            sum(t.reserved_tokens for t in running),
        )
        if self._metrics is not None:
            self._metrics.set_load(self._load.running, self._load.batch_size, self.engine.max_batch_size)
            self._publish_priorities(self._metrics)
            swapped = self.engine.swapped_bytes
            if swapped != self._swapped_bytes:  # told only when it changed, as the priorities are
                self._swapped_bytes = swapped
                self._metrics.set_preempted_kv_bytes(swapped)
            self._publish_adapters(self._metrics)

    def _publish_priorities(self, metrics: EngineMetrics) -> None:
        """Waiting and running requests by priority, told only when they changed: most steps change neither,
        and with an engine process every call crosses the pipe."""
        with self._cv:
            waiting = priority_counts(t.request.priority for t in (*self._waiting, *self._compiling))
        running = priority_counts(t.request.priority for t in self._running.values())
        if (waiting, running) != self._priorities:
            self._priorities = (waiting, running)
            metrics.set_priorities(waiting, running)

    def _publish_adapters(self, metrics: EngineMetrics) -> None:
        """The adapters of running and waiting requests, and the slot loads and evictions since last told,
        each only when it changed (the gauge's value is the time it changed, as vLLM's)."""
        engine = self._lora
        if engine is None:
            return
        counts = engine.adapter_counts
        if counts != self._slot_counts:
            metrics.on_adapter_slots(counts[0] - self._slot_counts[0], counts[1] - self._slot_counts[1])
            self._slot_counts = counts
        with self._cv:
            waiting = _names(t.request.adapter for t in (*self._waiting, *self._compiling))
        lora_requests = (_names(t.request.adapter for t in self._running.values()), waiting)
        if lora_requests != self._lora_requests:
            self._lora_requests = lora_requests
            metrics.set_lora_requests(engine.lora_slots, *lora_requests)


class _Load(NamedTuple):
    running: int
    batch_size: int
    kv_shape: tuple[int, ...]
    reserved: int


def _names(adapters: Iterable[str]) -> str:
    """Distinct adapter names, comma-separated in the order first seen (vLLM's label format)."""
    return ",".join(dict.fromkeys(a for a in adapters if a))


def queue_full(request_id: str, max_queue: int) -> QueueFull:
    return QueueFull(f"request {request_id}: the queue is full ({max_queue} waiting); retry later")


def outcomes(deliveries: list[Delivery]) -> list[Outcome]:
    return [Outcome(tracker.request_id, item) for tracker, item in deliveries]


def draining(request_id: str) -> Draining:
    return Draining(f"request {request_id}: the server is shutting down; retry elsewhere")


def draining_error(tracker: RequestTracker) -> TextgenError:
    return draining(tracker.request_id)


def internal_error(tracker: RequestTracker) -> TextgenError:
    return EngineFailure(f"request {tracker.request_id}: internal scheduler error; see the server log")


def engine_failure(reason: str, exc: Exception) -> Callable[[RequestTracker], TextgenError]:
    """The error of each request an engine step's `exc` ended, saying why."""

    def error(tracker: RequestTracker) -> TextgenError:
        return EngineFailure(f"request {tracker.request_id}: {reason}: {type(exc).__name__}: {exc}")

    return error

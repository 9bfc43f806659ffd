"""`BatchRunner`: the synchronous core of continuous batching, one engine step at a time.

A step drops cancelled and expired requests, asks the planner (planner.py, where the admission policy is
described) what to do, makes the plan's engine call, and takes its tokens: stopping through
`RequestTracker`, failure isolation (a failed call fails exactly the plan's requests), step records. The
several tokens a speculating step gives a request are taken as one step: one event, the step's interval
spread over them, its proposal counted as far as the request kept them.
A constrained request's constraint is compiled when it is tracked, on the worker threads of the engine's
compiler (serve/engine/constraints.py; its cache lives as long as the engine); it joins the queue once
compiled, or is refused (InvalidRequest) at the next step if llguidance rejects it, so no compile ever
holds a step back. The split follows vLLM v1's `schedule()` / `update_from_output()`: the policy is tested
without an engine.
The offline API drives the runner in a plain loop; `Scheduler` runs it on ONE dedicated thread (ONNX
Runtime releases the GIL while it computes) and hands events to the event loop with
`loop.call_soon_threadsafe`, one call per step.

Over 400 lines: each step kind's engine call and the delivery of its tokens share the runner's queue and in-
flight rows; the admission policy is planner.py, the stopping rules request.py.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from serve.errors import (
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineFailure,
    InvalidRequest,
    QueueFull,
    TextgenError,
)
from serve.scheduling.adapters import (
    AdapterUpdate,
    UpdateResult,
    apply_update,
    lora_engine,
    retire_unused,
    unknown_adapter,
)
from serve.scheduling.engine_protocol import (
    BatchEngine,
    EngineMetrics,
    PriorityCounts,
    StepKind,
    priority_counts,
)
from serve.scheduling.handles import Outcome
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.planner import NO_STEP, Planner, RunnerState, StepPlan, StepShape
from serve.scheduling.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    RequestState,
    RequestTracker,
    TokenEvent,
    validate_request,
)

if TYPE_CHECKING:
    from serve.engine.constraints import ConstraintCompiler
    from serve.engine.types import CompiledConstraint, NewSequence, TokenOut

log = logging.getLogger(__name__)


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


class BatchRunner:
    """Admission and engine steps; every method but `enqueue`, `reject_waiting`, `wake` runs on one thread."""

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

    # -- called from any thread -------------------------------------------------------------------------
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

    # -- the engine thread ---------------------------------------------------------------------------------
    def step(self) -> list[Delivery]:
        """Drop cancelled/expired requests, join a prefill beside the decode steps once due, then run the
        step's plan: one prefill (admission) or one decode step."""
        deliveries: list[Delivery] = []
        self._partial = deliveries  # what `abort` still owes the callers should this step raise
        self._apply_updates()
        now = time.monotonic()
        self._refuse(deliveries)
        self._leave(self._sweep(list(self._running.values()), now, deliveries))
        joining = self._planner.join(self._state(now))  # reads no queue: the lock is not needed yet
        if joining is not None:
            self._execute(joining, deliveries)  # the next group may begin beside this step's decode at once
        with self._cv:
            preempted = [t for t in self._waiting if t.preempted]
            self._drop_waiting(self._sweep(list(self._waiting), now, deliveries))
            if self._compiling:
                gone = {id(t) for t in self._sweep(list(self._compiling), now, deliveries)}
                self._compiling = [t for t in self._compiling if id(t) not in gone]
            plan = self._planner.plan(self._state(now, tuple(self._waiting)))
            self._drop_waiting(plan.admitted)
        self._forget([t for t in preempted if t.done])
        self._preempt(plan.preempted, deliveries)
        self._resume(plan.resumed, deliveries)
        self._execute(plan, deliveries)
        self._retire_adapters()
        self._publish_load()
        self._partial = []
        return deliveries

    def _apply_updates(self) -> None:
        """Make the queued adapter updates; not while a group prefills beside the decode steps, whose run
        reads the slots on a thread of its own (they wait for the step that joins it)."""
        if not self._updates or self.engine.background_ids:  # unlocked: most steps have none to make
            return
        with self._cv:  # held: enqueue's adapter check sees the adapters before or after, never between
            updates, self._updates = self._updates, []
            users = self._adapter_users()
            for update, future in updates:
                try:
                    future.set_result(apply_update(self._lora, update, users))
                except TextgenError as exc:
                    future.set_exception(exc)
                except Exception as exc:  # a bug: the caller hears of it, the requests in flight go on
                    log.exception("adapter update %r failed", update.name)
                    reason = f"adapter {update.name!r}: the update failed: {type(exc).__name__}: {exc}"
                    future.set_exception(EngineFailure(reason))

    def _retire_adapters(self) -> None:
        """After a step: unregister the adapters of deferred unloads whose requests have all ended (not
        while a group prefills beside the decode steps, as for an update)."""
        if self._lora is None or not self._lora.retiring_adapters or self.engine.background_ids:
            return
        with self._cv:
            retire_unused(self._lora, self._adapter_users())

    def _adapter_users(self) -> list[str]:
        """Under the lock: the adapter of each running, queued (preempted included) or compiling request."""
        return [t.request.adapter for t in (*self._running.values(), *self._waiting, *self._compiling)]

    def drop_updates(self, error: TextgenError) -> None:
        """Refuse the updates not made yet (the engine thread stops): their callers must not wait forever."""
        with self._cv:
            updates, self._updates = self._updates, []
        for _, future in updates:
            future.set_exception(error)

    def safe_step(self) -> list[Delivery]:
        """`step`; a scheduler bug fails every request in flight instead of leaving its callers waiting."""
        try:
            return self.step()
        except Exception:
            log.exception("scheduler step failed; failing every request in flight")
            return self.abort(_internal_error)

    def abort(self, error: Callable[[RequestTracker], TextgenError]) -> list[Delivery]:
        """Fail everything queued or running (draining past its grace, or a scheduler bug)."""
        deliveries = [*self._partial, *self.reject_waiting(error)]
        self._partial = []
        with self._cv:
            preempted, self._waiting = list(self._waiting), deque()
        self._fail_all(preempted, error, deliveries)
        self._forget(preempted)
        running = list(self._running.values())
        self._fail_all(running, error, deliveries)
        self._leave(running)
        self._publish_load()
        return deliveries

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

    def _sweep(self, trackers: list[RequestTracker], now: float, out: list[Delivery]) -> list[RequestTracker]:
        gone: list[RequestTracker] = []
        for tracker in trackers:
            if tracker.cancel_requested:
                tracker.end(RequestState.CANCELLED, now)
                out.append(Delivery(tracker, Cancelled(f"request {tracker.request_id} was cancelled")))
            elif tracker.expired(now):
                tracker.end(RequestState.EXPIRED, now)
                out.append(Delivery(tracker, DeadlineExceeded(_deadline_message(tracker))))
            else:
                continue
            self.count(tracker.state.value)
            gone.append(tracker)
        return gone

    def _drop_waiting(self, trackers: Sequence[RequestTracker]) -> None:
        if trackers:
            taken = {id(t) for t in trackers}
            self._waiting = deque(t for t in self._waiting if id(t) not in taken)

    def _preempt(self, trackers: Sequence[RequestTracker], out: list[Delivery]) -> None:
        """Swap the plan's victims out and put them back in the queue; what pacing held of their output goes
        to their clients now, so nothing waits out the pause."""
        if not trackers:
            return
        try:
            self.engine.swap_out([t.request_id for t in trackers])
        except Exception as exc:  # a half-done swap leaves rows nobody can trust: they fail, as a step would
            log.exception("engine failed to preempt %d requests", len(trackers))
            self._fail(trackers, "the engine failed to preempt it", exc, out)
            return
        with self._cv:  # from running to queued at once: a cancel from another thread finds it either way
            for tracker in trackers:
                del self._running[tracker.request_id]
                tracker.preempt()
            self._waiting.extend(trackers)
        now = time.monotonic()
        for tracker in trackers:
            # A stream's held tokens go now; a request that does not stream still gets everything at the end.
            held = tracker.pace(None, now, self.limits.stream_interval_seconds, flush=tracker.request.stream)
            if held is not None:
                out.append(Delivery(tracker, held))
        if self._metrics is not None:
            self._metrics.on_preempted(len(trackers))

    def _resume(self, trackers: Sequence[RequestTracker], out: list[Delivery]) -> None:
        """Swap the plan's preempted requests back in: they decode in this step."""
        if not trackers:
            return
        with self._cv:  # from queued to running at once, as in _preempt
            self._drop_waiting(trackers)
            for tracker in trackers:
                tracker.resume()
                self._running[tracker.request_id] = tracker
        try:
            self.engine.swap_in([t.request_id for t in trackers])
        except Exception as exc:
            log.exception("engine failed to resume %d requests", len(trackers))
            self._fail(trackers, "the engine failed to resume it", exc, out)

    def _forget(self, trackers: Sequence[RequestTracker]) -> None:
        """Preempted requests that ended while queued: the engine drops the rows it keeps for them."""
        if not trackers:
            return
        try:
            self.engine.release([t.request_id for t in trackers])
        except Exception:  # as in _leave: they already ended
            log.exception("engine release failed for %s", [t.request_id for t in trackers])

    def _state(self, now: float, waiting: tuple[RequestTracker, ...] = ()) -> RunnerState:
        """What the planner decides on; `waiting` is read under the lock (other threads enqueue)."""
        running = tuple(self._running.values())
        return RunnerState(running, self._last_phase, now, waiting, self._background)

    def _execute(self, plan: StepPlan, deliveries: list[Delivery]) -> None:
        """Make the plan's engine call(s) and take their tokens."""
        match plan.kind:
            case StepKind.PREFILL:
                self._prefill(plan, deliveries)
            case StepKind.CONTINUE_PREFILL:
                call = self.engine.continue_prefill
                self._run_step(StepKind.PREFILL, plan.group, plan.prefill_sizes, call, deliveries)
            case StepKind.BEGIN_BACKGROUND:
                if self._begin_background(plan, deliveries):
                    self._decode(plan, deliveries)
            case StepKind.END_BACKGROUND:
                self._end_background(plan, deliveries)
            case StepKind.DECODE:
                self._decode(plan, deliveries)
            case StepKind.IDLE:
                pass

    def _admit(self, plan: StepPlan) -> list[NewSequence]:
        now = time.monotonic()
        for tracker, cached in zip(plan.group, plan.cached, strict=True):
            queued = tracker.admit(now, cached)
            self._running[tracker.request_id] = tracker
            if self._metrics is not None:
                self._metrics.on_admitted(queued)
                if tracker.request.adapter:
                    self._metrics.on_adapter_request(tracker.request.adapter)
        return [t.new_sequence() for t in plan.group]

    def _prefill(self, plan: StepPlan, deliveries: list[Delivery]) -> None:
        new = self._admit(plan)
        call = functools.partial(self.engine.prefill, new, plan.chunk)
        self._run_step(StepKind.PREFILL, plan.group, plan.prefill_sizes, call, deliveries)

    def _begin_background(self, plan: StepPlan, deliveries: list[Delivery]) -> bool:
        """Start the plan's group prefilling beside the decode steps; False: it failed (and so did they)."""
        new = self._admit(plan)
        try:
            self.engine.begin_prefill(new)
        except Exception as exc:
            log.exception("engine prefill failed to start for %d requests", len(plan.group))
            self._fail(plan.group, "the engine failed during prefill", exc, deliveries)
            return False
        self._background = plan.prefill_sizes
        return True

    def _end_background(self, plan: StepPlan, deliveries: list[Delivery]) -> None:
        """Join the group prefilled beside the decode steps (waits for it if nothing else runs)."""
        try:
            outs, seconds = self.engine.end_prefill()
        except Exception as exc:
            log.exception("engine prefill failed for %d requests", len(plan.group))
            self._fail(plan.group, "the engine failed during prefill", exc, deliveries)
            return
        self._record(StepKind.PREFILL, plan.prefill_sizes, seconds)
        self._accept(outs, deliveries)

    def _decode(self, plan: StepPlan, deliveries: list[Delivery]) -> None:
        self._run_step(StepKind.DECODE, plan.decoded, plan.decode_sizes, self.engine.decode, deliveries)

    def _run_step(
        self,
        phase: StepKind,
        trackers: Sequence[RequestTracker],
        sizes: StepShape,
        call: Callable[[], list[TokenOut]],
        deliveries: list[Delivery],
    ) -> None:
        self._last_phase = phase
        start = time.perf_counter()
        try:
            outs = call()
        except Exception as exc:  # ONNX Runtime errors: fail exactly this step's requests, keep serving
            log.exception("engine %s step failed for %d requests", phase, len(trackers))
            self._fail(trackers, f"the engine failed during {phase}", exc, deliveries)
            return
        self._record(phase, sizes, time.perf_counter() - start)
        self._accept(outs, deliveries)

    def _record(self, phase: StepKind, sizes: StepShape, seconds: float) -> None:
        record = StepRecord(phase, *sizes, seconds)
        with self._stats_lock:
            self._steps.append(record)
        self.last_step = record
        if self._metrics is not None:
            self._metrics.on_step(phase, record.rows, record.padding_ratio, record.seconds)
            self._record_constraints(self._metrics)

    def _record_constraints(self, metrics: EngineMetrics) -> None:
        """What masks and compiles cost since the previous step."""
        stats, seen = self.engine.mask_stats, self._masks_seen
        if stats.rows != seen.rows:
            metrics.on_masks(
                stats.rows - seen.rows,
                stats.fill_seconds - seen.fill_seconds,
                stats.wait_seconds - seen.wait_seconds,
            )
            self._masks_seen = stats.copy()
        if self._compiler is not None:
            for seconds in self._compiler.take_compile_seconds():
                metrics.on_constraint_compiled(seconds)

    def _accept(self, outs: list[TokenOut], deliveries: list[Delivery]) -> None:
        """Take a step's tokens request by request (a speculating step gives one several: one step's)."""
        now = time.monotonic()
        finished: list[RequestTracker] = []
        for seq_id, step in _by_sequence(outs).items():
            tracker = self._running[seq_id]
            if self._take(tracker, step, now, deliveries):
                finished.append(tracker)
        self._leave(finished)

    def _take(self, tracker: RequestTracker, step: list[TokenOut], now: float, out: list[Delivery]) -> bool:
        """Hand over what one step gave a request as one event (paced as one step), time and count it;
        True: the request ended (finished or failed)."""
        previous = tracker.times.last_token
        taken = self._take_tokens(tracker, step, now, out)
        if taken is None:
            return True
        events, finish, kept = taken
        self._time_tokens(tracker, previous, kept, now)
        self._speculated(tracker, step[0], kept)
        joined = TokenEvent.join(events) if events else None
        token = tracker.pace(joined, now, self.limits.stream_interval_seconds, flush=finish is not None)
        if token is not None:
            out.append(Delivery(tracker, token))
        if finish is None:
            return False
        out.append(Delivery(tracker, finish))
        self._on_finished(finish)
        if self._metrics is not None and tracker.speculated.proposed:
            self._metrics.on_speculation_done(tracker.speculated.acceptance)
        return True

    def _take_tokens(
        self, tracker: RequestTracker, step: list[TokenOut], now: float, out: list[Delivery]
    ) -> _Taken | None:
        """What one step's tokens gave the request (those after the one that ended it are dropped); None: it
        failed."""
        events: list[TokenEvent] = []
        for kept, token in enumerate(step, start=1):
            if token.error is not None:  # nothing could be sampled for it (or its constraint failed)
                self._refuse_row(tracker, token.error, out)
                return None
            try:
                event, finish = tracker.accept(
                    token.token_id, token.logprob, now, token.top, token.prompt, token.constraint
                )
            except Exception as exc:  # e.g. a token the tokenizer cannot decode: only this request fails
                log.exception("request %s: could not process token %d", tracker.request_id, token.token_id)
                self._fail_all([tracker], _engine_failure("its output could not be processed", exc), out)
                return None
            if event is not None:
                events.append(event)
            if finish is not None:
                return _Taken(events, finish, kept)
        return _Taken(events, None, len(step))

    def _time_tokens(self, tracker: RequestTracker, previous: float | None, kept: int, now: float) -> None:
        """The step's interval divided over the tokens it gave the request, once per token: the client gets
        them together, so a speculating step's accepted tokens do not count as instant."""
        if self._metrics is None:
            return
        if previous is None:  # a prefill gives a sequence one token: its first
            self._metrics.on_first_token(now - tracker.times.arrival)
            return
        gap = (now - previous) / kept
        for _ in range(kept):
            self._metrics.on_token(gap)

    def _speculated(self, tracker: RequestTracker, first: TokenOut, kept: int) -> None:
        """Count a speculating step as far as the request kept its tokens (`kept`, the one that ended it
        included; a plain step counts nothing). The last kept token stands for the one a plain decode step
        gives, those before it are accepted proposals (tokens without a step of their own): emitted =
        accepted + 1 per step, as the metrics say. Proposed: the whole proposal where the request kept every
        token of the step (judged up to its first miss, the rest lost with it); else only the accepted ones
        it kept, since proposals past its end were never needed and counting them would read a stop as a
        miss, and nothing where it ended at the step's first token."""
        whole = kept > first.accepted
        proposed, accepted = (first.proposed, first.accepted) if whole else (kept - 1, kept - 1)
        if not proposed:
            return
        tracker.speculated.add(proposed, accepted)
        if self._metrics is not None:
            self._metrics.on_speculated(proposed, accepted)

    def _refuse_row(self, tracker: RequestTracker, reason: str, out: list[Delivery]) -> None:
        position = tracker.completion_tokens + 1

        def error(t: RequestTracker) -> TextgenError:
            return InvalidRequest(f"request {t.request_id}: at output token {position}, {reason}")

        self._fail_all([tracker], error, out)

    def _on_finished(self, finish: FinishEvent) -> None:
        self.count("finished")
        if self._metrics is not None:
            self._metrics.on_finished(
                finish.finish_reason,
                finish.prompt_tokens,
                finish.completion_tokens,
                finish.cached_prompt_tokens,
            )

    def _fail(
        self, trackers: Sequence[RequestTracker], reason: str, exc: Exception, out: list[Delivery]
    ) -> None:
        self._fail_all(trackers, _engine_failure(reason, exc), out)
        self._leave(trackers)

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

    def _leave(self, trackers: Sequence[RequestTracker]) -> None:
        joined = [t.request_id for t in trackers if self._running.pop(t.request_id, None) is not None]
        if not joined:
            return
        try:
            self.engine.release(joined)
        except Exception:  # nothing left to fail: the requests already ended; keep serving the others
            log.exception("engine release failed for %s", joined)

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


class _Taken(NamedTuple):
    """What one step gave a request: its events, what ended it, and how many of the step's tokens it kept."""

    events: list[TokenEvent]
    finish: FinishEvent | None
    kept: int


class _Load(NamedTuple):
    running: int
    batch_size: int
    kv_shape: tuple[int, ...]
    reserved: int


def _by_sequence(outs: list[TokenOut]) -> dict[str, list[TokenOut]]:
    """A step's tokens per sequence, each sequence's in order (a speculating step gives one several)."""
    step: dict[str, list[TokenOut]] = {}
    for out in outs:
        step.setdefault(out.seq_id, []).append(out)
    return step


def _names(adapters: Iterable[str]) -> str:
    """Distinct adapter names, comma-separated in the order first seen (vLLM's label format)."""
    return ",".join(dict.fromkeys(a for a in adapters if a))


def _deadline_message(tracker: RequestTracker) -> str:
    where = "while queued" if tracker.times.admitted is None else "while generating"
    return f"request {tracker.request_id}: deadline exceeded {where}"


def queue_full(request_id: str, max_queue: int) -> QueueFull:
    return QueueFull(f"request {request_id}: the queue is full ({max_queue} waiting); retry later")


def outcomes(deliveries: list[Delivery]) -> list[Outcome]:
    return [Outcome(tracker.request_id, item) for tracker, item in deliveries]


def draining(request_id: str) -> Draining:
    return Draining(f"request {request_id}: the server is shutting down; retry elsewhere")


def draining_error(tracker: RequestTracker) -> TextgenError:
    return draining(tracker.request_id)


def _internal_error(tracker: RequestTracker) -> TextgenError:
    return EngineFailure(f"request {tracker.request_id}: internal scheduler error; see the server log")


def _engine_failure(reason: str, exc: Exception) -> Callable[[RequestTracker], TextgenError]:
    """The error of each request an engine step's `exc` ended, saying why."""

    def error(tracker: RequestTracker) -> TextgenError:
        return EngineFailure(f"request {tracker.request_id}: {reason}: {type(exc).__name__}: {exc}")

    return error

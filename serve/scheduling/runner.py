"""`BatchRunner`: the synchronous core of continuous batching, one engine step at a time.

A step drops cancelled and expired requests, asks the planner (planner.py, where the admission policy is
described) what to do, makes the plan's engine call, and takes its tokens: stopping through
`RequestTracker`, failure isolation (a failed call fails exactly the plan's requests), step records. The
split follows vLLM v1's `schedule()` / `update_from_output()`: the policy is tested without an engine.
The offline API drives the runner in a plain loop; `Scheduler` runs it on ONE dedicated thread (ONNX
Runtime releases the GIL while it computes) and hands events to the event loop with
`loop.call_soon_threadsafe`, one call per step.

The runner is built in layers, each in its own module: intake.py (the queue, the running requests, outcomes
and reports; what other threads call), delivery.py (a step's tokens taken request by request; failing and
releasing requests) and this module (the step: the plan's engine calls, preemption, adapter updates). The
admission policy is planner.py, the stopping rules request.py.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from serve.errors import Cancelled, DeadlineExceeded, EngineFailure, TextgenError
from serve.scheduling.adapters import apply_update, retire_unused
from serve.scheduling.delivery import TokenDelivery
from serve.scheduling.engine_protocol import StepKind
from serve.scheduling.intake import Delivery, internal_error
from serve.scheduling.planner import RunnerState, StepPlan, StepShape
from serve.scheduling.request import RequestState, RequestTracker

if TYPE_CHECKING:
    from serve.engine.types import NewSequence, TokenOut

log = logging.getLogger(__name__)


class BatchRunner(TokenDelivery):
    """Admission and engine steps; every method but `enqueue`, `reject_waiting`, `wake` runs on one thread."""

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

    def safe_step(self) -> list[Delivery]:
        """`step`; a scheduler bug fails every request in flight instead of leaving its callers waiting."""
        try:
            return self.step()
        except Exception:
            log.exception("scheduler step failed; failing every request in flight")
            return self.abort(internal_error)

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


def _deadline_message(tracker: RequestTracker) -> str:
    where = "while queued" if tracker.times.admitted is None else "while generating"
    return f"request {tracker.request_id}: deadline exceeded {where}"

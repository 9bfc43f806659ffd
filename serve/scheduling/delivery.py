"""A step's tokens taken request by request (serve/scheduling/runner.py): each through its
`RequestTracker` (stopping rules, text, pacing), timed and counted; and a failed call fails exactly its
requests. The several tokens a speculating step gives a request are taken as one step: one event, the step's
interval spread over them, its proposal counted as far as the request kept them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from serve.errors import InvalidRequest, TextgenError
from serve.scheduling.engine_protocol import EngineMetrics, StepKind
from serve.scheduling.intake import Delivery, Intake, StepRecord, engine_failure
from serve.scheduling.planner import StepShape
from serve.scheduling.request import FinishEvent, RequestTracker, TokenEvent

if TYPE_CHECKING:
    from serve.engine.types import TokenOut

log = logging.getLogger(__name__)


class TokenDelivery(Intake):
    """Taking tokens, failing and releasing requests, and recording steps."""

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
                self._fail_all([tracker], engine_failure("its output could not be processed", exc), out)
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
        self._fail_all(trackers, engine_failure(reason, exc), out)
        self._leave(trackers)

    def _leave(self, trackers: Sequence[RequestTracker]) -> None:
        joined = [t.request_id for t in trackers if self._running.pop(t.request_id, None) is not None]
        if not joined:
            return
        try:
            self.engine.release(joined)
        except Exception:  # nothing left to fail: the requests already ended; keep serving the others
            log.exception("engine release failed for %s", joined)


class _Taken(NamedTuple):
    """What one step gave a request: its events, what ended it, and how many of the step's tokens it kept."""

    events: list[TokenEvent]
    finish: FinishEvent | None
    kept: int


def _by_sequence(outs: list[TokenOut]) -> dict[str, list[TokenOut]]:
    """A step's tokens per sequence, each sequence's in order (a speculating step gives one several)."""
    step: dict[str, list[TokenOut]] = {}
    for out in outs:
        step.setdefault(out.seq_id, []).append(out)
    return step

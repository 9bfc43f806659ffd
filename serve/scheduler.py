"""Continuous, padding-aware batching on one engine thread, bridged to asyncio.

`BatchRunner` is the synchronous core (admission, one engine step at a time, stopping through
`RequestTracker`, failure isolation, step records); the offline API drives it in a plain loop.
`Scheduler` runs it on ONE dedicated thread (ONNX Runtime releases the GIL while it computes) and hands
events to the event loop with `loop.call_soon_threadsafe`, one call per step.

Admission policy, evaluated between every two engine steps:
- FCFS: the oldest waiting request heads the next prefill group; when it does not fit, nobody overtakes it,
  so the running batch drains until it does (a long prompt cannot be starved by a stream of short ones).
- Padding-aware grouping: younger requests join the head's group while the group's padding
  (rows x longest prompt vs. the sum of lengths) stays within `max_padding_ratio` and the group's padded
  size within `max_prefill_tokens` (large arrivals are split over several steps; a single prompt larger
  than the budget is prefilled alone).
- Chunked prefill (`prefill_chunk_tokens`): while others decode, a prefill step computes at most that many
  prompt tokens. Arrivals that fit go together and the rest wait for the next prefill step (which follows
  a decode step); a prompt longer than that is prefilled alone, that many tokens a step, with decode
  steps in between (the engine continues one sequence at a time).
- Prefill beside the decode steps (`prefill_beside_decode`, off by default): while others decode, a group
  with no prefix-cache hit and nothing to chunk is prefilled on the engine's own thread for it
  (`Engine.begin_prefill`) and every step decodes the running rows meanwhile; the first step after its run
  is over joins it (`end_prefill`) and may begin the next group. One such group at a time.
- KV budget: every request reserves prompt + max_new_tokens; the batch's padded footprint
  rows x largest reservation must stay within `max_batch_tokens`. Decode pads every row to the longest
  context, so this bounds every step; a long request gives its share back as soon as it leaves.
- Running streams are never stalled by two prefills in a row, and a partial group waits up to
  `max_wait_seconds` for company while others are decoding (no wait when the engine is idle).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import tokenizers
from pydantic import BaseModel, ConfigDict, Field

from serve.errors import (
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineFailure,
    InvalidRequest,
    QueueFull,
    TextgenError,
)
from serve.request import (
    Event,
    FinishEvent,
    GenerationRequest,
    RequestState,
    RequestTracker,
    TokenEvent,
    validate_request,
)

if TYPE_CHECKING:
    from serve.engine import NewSequence, TokenOut

log = logging.getLogger(__name__)


class BatchEngine(Protocol):
    """What the scheduler needs from `serve.engine.Engine`."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def tokenizer(self) -> tokenizers.Tokenizer: ...
    def cached_tokens(self, prompt_ids: Sequence[int]) -> int: ...
    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]: ...
    def continue_prefill(self) -> list[TokenOut]: ...
    def begin_prefill(self, new: Sequence[NewSequence]) -> None: ...
    def end_prefill(self) -> tuple[list[TokenOut], float]: ...
    @property
    def background_ids(self) -> list[str]: ...
    @property
    def background_done(self) -> bool: ...
    @property
    def staged_id(self) -> str | None: ...
    @property
    def staged_done(self) -> int: ...
    def decode(self) -> list[TokenOut]: ...
    def release(self, seq_ids: Iterable[str]) -> None: ...
    @property
    def batch_size(self) -> int: ...
    def kv_shape(self) -> tuple[int, ...]: ...


class EngineMetrics(Protocol):
    """The metric hooks the engine's side calls (serve.metrics.Metrics; in an engine process, a recorder
    whose calls the server's process replays)."""

    def on_admitted(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_token(self, inter_token_seconds: float) -> None: ...
    def on_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, cached_prompt_tokens: int
    ) -> None: ...
    def on_step(self, phase: str, batch_size: int, padding_ratio: float, seconds: float) -> None: ...
    def set_load(self, running: int, waiting: int, kv_used: int, kv_capacity: int) -> None: ...


class SchedulerLimits(BaseModel):
    """Batching limits. `None` means "as large as the engine allows" and is filled in by `resolve`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch_size: int | None = Field(
        default=None, ge=1, description="rows running at once (<= engine KV slots)"
    )
    max_batch_tokens: int | None = Field(
        default=None, ge=1, description="KV token slots incl. padding: rows x largest prompt+max_new_tokens"
    )
    # A prefill stalls every running stream for its whole duration, and on CPU its cost grows with its
    # tokens (bench-a: ~60 MFLOP a token at ~170 GFLOP/s, so 512 tokens ~0.2 s against ~10 ms a decode
    # step). 512 still takes the usual burst of 16 x 32-token prompts in one step.
    max_prefill_tokens: int = Field(
        default=512, ge=1, description="padded prompt tokens prefilled in one step"
    )
    # A prefill while others decode stalls them for its whole duration; bounded, each stall is at most one
    # piece long and decode steps run in between (the arrivals' first tokens come later instead).
    prefill_chunk_tokens: int = Field(
        default=0,
        ge=0,
        description="while others decode, the most prompt tokens a prefill step computes: arrivals are "
        "split over steps, a longer prompt prefilled in pieces of this many (0: no bound but "
        "max_prefill_tokens)",
    )
    # A prefill between two decode steps stalls every stream for its whole length; beside them it shares the
    # cores and the streams slow down instead. Off by default: on 2 cores it took ITL p99 / p50 from ~3 to ~2
    # under arrivals, but the prefill ran 2x longer: first tokens 2-3x later, 0.84-1x tokens at saturation.
    prefill_beside_decode: bool = Field(
        default=False,
        description="while others decode, prefill arrivals on a thread of their own beside the decode steps "
        "instead of between them (prompts with a prefix-cache hit, and prompts chunked, still run between)",
    )
    max_queue: int = Field(default=256, ge=0, description="waiting requests; more are refused at once")
    # No wait by default: grouping arrivals saves little on CPU (prefill cost follows tokens) and turns
    # several small stalls of the running streams into one large one, which is what inter-token p99 sees.
    max_wait_seconds: float = Field(
        default=0.0,
        ge=0.0,
        description="how long a partial prefill group may wait for company while others decode",
    )
    max_padding_ratio: float = Field(
        default=0.25, ge=0.0, le=1.0, description="length bucketing: most padding a prefill group may carry"
    )
    stream_interval_seconds: float = Field(
        default=0.0, ge=0.0, le=10.0, description="a stream's tokens go out at most once per this interval"
    )
    step_history: int = Field(default=1024, ge=1, description="engine steps kept for inspection")

    def resolve(self, engine: BatchEngine) -> SchedulerLimits:
        """These limits with the engine's sizes filled in; ValueError when they exceed the engine."""
        rows = self.max_batch_size or engine.max_batch_size
        if rows > engine.max_batch_size:
            raise ValueError(f"max_batch_size {rows} exceeds the engine's {engine.max_batch_size} KV slots")
        return self.model_copy(
            update={
                "max_batch_size": rows,
                "max_batch_tokens": self.max_batch_tokens or rows * engine.capacity,
            }
        )

    @property
    def batch_size(self) -> int:
        if self.max_batch_size is None:
            raise RuntimeError("SchedulerLimits.resolve(engine) was not called")
        return self.max_batch_size

    @property
    def batch_tokens(self) -> int:
        if self.max_batch_tokens is None:
            raise RuntimeError("SchedulerLimits.resolve(engine) was not called")
        return self.max_batch_tokens


@dataclass(frozen=True)
class StepRecord:
    """One engine step. `padded_tokens`: token slots it computed, padding included (decode: rows x longest
    context; prefill: rows prefilled together x their longest prompt, plus the uncached tokens of each
    prefix-cache hit, which runs alone); `real_tokens`: the tokens among them."""

    phase: str  # prefill | decode
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
    kv_slots_used: int
    kv_slots_capacity: int
    kv_tokens_reserved: int  # sum of running requests' prompt + max_new_tokens
    batch_size: int  # the engine's rows in use after the last step
    kv_shape: tuple[int, ...]  # the engine's live KV view after the last step
    outcomes: dict[str, int]  # finished / cancelled / expired / failed / rejected


Delivery = tuple[RequestTracker, "Event | TextgenError"]


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
        self._running: dict[str, RequestTracker] = {}  # insertion order is not the engine's row order
        self._steps: deque[StepRecord] = deque(maxlen=limits.step_history)
        self._outcomes: Counter[str] = Counter()
        self._last_phase = ""
        self._background = (0, (0, 0))  # the prefill beside the decode steps: its rows and the record's sizes
        self._partial: list[Delivery] = []
        self._load = _Load(0, engine.batch_size, engine.kv_shape(), 0)
        self.last_step: StepRecord | None = None  # the latest step's record (replaced, never mutated)

    @property
    def max_total_tokens(self) -> int:
        """The most KV tokens one request may occupy: its slot, and the whole batch budget at most."""
        return min(self.engine.capacity, self.limits.batch_tokens)

    def track(self, request: GenerationRequest, *, stop_at_context: bool = False) -> RequestTracker:
        """Validate a request (InvalidRequest) and start its state machine."""
        validate_request(
            request, self.engine.vocab_size, self.max_total_tokens, stop_at_context=stop_at_context
        )
        return RequestTracker(
            request, self.engine.tokenizer, self.engine.eos_token_id, self.max_total_tokens, time.monotonic()
        )

    # -- called from any thread -------------------------------------------------------------------------
    def enqueue(self, tracker: RequestTracker) -> None:
        with self._cv:
            if len(self._waiting) >= self.limits.max_queue:
                self.count("rejected")
                raise queue_full(tracker.request_id, self.limits.max_queue)
            self._waiting.append(tracker)
            self._cv.notify()

    def reject_waiting(self, error: Callable[[RequestTracker], TextgenError]) -> list[Delivery]:
        """Fail every queued request (used when draining: they can be retried elsewhere at once)."""
        with self._cv:
            rejected = list(self._waiting)
            self._waiting.clear()
        deliveries: list[Delivery] = []
        self._fail_all(rejected, error, deliveries)
        return deliveries

    def request_cancel(self, request_id: str) -> None:
        """Mark a queued or running request cancelled: it leaves at the next step (no effect once ended)."""
        with self._cv:
            tracker = self._running.get(request_id) or next(
                (t for t in self._waiting if t.request_id == request_id), None
            )
        if tracker is not None:
            tracker.request_cancel()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def wait_for_work(self, stop: Callable[[], bool]) -> None:
        with self._cv:
            self._cv.wait_for(lambda: bool(self._running or self._waiting) or stop())

    @property
    def idle(self) -> bool:
        return not self._running and not self._waiting

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
            waiting=len(self._waiting),
            kv_slots_used=load.batch_size,
            kv_slots_capacity=self.engine.max_batch_size,
            kv_tokens_reserved=load.reserved,
            batch_size=load.batch_size,
            kv_shape=load.kv_shape,
            outcomes=outcomes,
        )

    # -- the engine thread ---------------------------------------------------------------------------------
    def step(self) -> list[Delivery]:
        """Drop cancelled/expired requests, then run one prefill (admission) or one decode step."""
        deliveries: list[Delivery] = []
        self._partial = deliveries  # what `abort` still owes the callers should this step raise
        now = time.monotonic()
        self._leave(self._sweep(list(self._running.values()), now, deliveries))
        if self.engine.background_ids and (self.engine.background_done or not self._decoding):
            self._end_prefill(deliveries)  # and the next group may begin beside this step's decode at once
        with self._cv:
            self._drop_waiting(self._sweep(list(self._waiting), now, deliveries))
            staged = self._staged
            group = [] if staged is not None or self.engine.background_ids else self._select(now)
            self._drop_waiting(group)
        if staged is not None and not (self._decoding and self._last_phase == "prefill"):
            self._continue_prefill(staged, deliveries)
        elif group and self._beside(group):
            if self._begin_prefill(group, deliveries):
                self._decode(deliveries)
        elif group:
            self._prefill(group, deliveries)
        elif self._decoding:
            self._decode(deliveries)
        self._publish_load()
        self._partial = []
        return deliveries

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
                out.append((tracker, Cancelled(f"request {tracker.request_id} was cancelled")))
            elif tracker.expired(now):
                tracker.end(RequestState.EXPIRED, now)
                out.append((tracker, DeadlineExceeded(_deadline_message(tracker))))
            else:
                continue
            self.count(tracker.state.value)
            gone.append(tracker)
        return gone

    def _drop_waiting(self, trackers: list[RequestTracker]) -> None:
        if trackers:
            taken = {id(t) for t in trackers}
            self._waiting = deque(t for t in self._waiting if id(t) not in taken)

    def _select(self, now: float) -> list[RequestTracker]:
        """The next prefill group (empty: decode instead). Caller holds the lock."""
        free_rows = self.limits.batch_size - len(self._running)
        if not self._waiting or free_rows <= 0 or (self._running and self._last_phase == "prefill"):
            return []
        running = _Group.of(self._running.values())
        group = self._group_plus(_Group([]), self._waiting[0])
        if not self._fits_kv(running, group):
            return []  # FCFS: nobody overtakes the head; running requests leave until it fits
        left_out = False
        for candidate in itertools.islice(self._waiting, 1, None):
            if len(group.members) == free_rows:
                break
            bigger = self._group_plus(group, candidate)
            if self._acceptable(running, bigger):
                group = bigger
            else:
                left_out = True
        partial = len(group.members) < free_rows and not left_out
        if self._running and partial and now - group.members[0].times.arrival < self.limits.max_wait_seconds:
            return []  # let more arrivals share this prefill instead of stalling the decoders again soon
        return group.members

    def _group_plus(self, group: _Group, tracker: RequestTracker) -> _Group:
        """`group` and `tracker`, whose prefill computes only what the engine's prefix cache lacks."""
        return group.plus(tracker, self.engine.cached_tokens(tracker.request.prompt_ids))

    def _acceptable(self, running: _Group, group: _Group) -> bool:
        """Whether a group of two or more may prefill together (the head alone always may: a prompt longer
        than the chunk is chunked instead)."""
        # A prefix-cache hit runs alone (one weight pass each): two in a step save nothing, and the second
        # would hold back the first one's first token and stall the running streams twice as long.
        # While others decode, their stall is bounded by the chunk.
        chunk = self.limits.prefill_chunk_tokens if running.members else 0
        return (
            group.hits <= 1
            and group.prefill_tokens <= self.limits.max_prefill_tokens
            and not (chunk and group.prefill_tokens > chunk)
            and group.padding_ratio <= self.limits.max_padding_ratio
            and self._fits_kv(running, group)
        )

    def _fits_kv(self, running: _Group, group: _Group) -> bool:
        rows = len(running.members) + len(group.members)
        return rows * max(running.reserved, group.reserved) <= self.limits.batch_tokens

    def _admit(self, group: list[RequestTracker]) -> list[NewSequence]:
        now = time.monotonic()
        for tracker in group:
            queued = tracker.admit(now, self.engine.cached_tokens(tracker.request.prompt_ids))
            self._running[tracker.request_id] = tracker
            if self._metrics is not None:
                self._metrics.on_admitted(queued)
        return [t.new_sequence() for t in group]

    def _prefill(self, group: list[RequestTracker], deliveries: list[Delivery]) -> None:
        new = self._admit(group)
        # In pieces only while others decode: nobody is stalled when nothing else runs.
        chunk = self.limits.prefill_chunk_tokens if len(self._running) > len(group) else 0
        if chunk and len(group) == 1:  # the engine chunks a lone prompt only; the record shows one piece
            piece = min(chunk, group[0].prompt_len - group[0].cached_tokens)
            sizes = (piece, piece)
        else:
            sizes = _computed(group)
        self._run_step("prefill", group, sizes, lambda: self.engine.prefill(new, chunk), deliveries)

    def _beside(self, group: list[RequestTracker]) -> bool:
        """Whether `group` prefills beside the decode steps: some run, no prompt has a prefix-cache hit, and
        none is to be chunked."""
        chunk = self.limits.prefill_chunk_tokens
        return (
            self.limits.prefill_beside_decode
            and self._decoding
            and not (chunk and len(group) == 1 and group[0].prompt_len > chunk)
            and not any(self.engine.cached_tokens(t.request.prompt_ids) for t in group)
        )

    def _begin_prefill(self, group: list[RequestTracker], deliveries: list[Delivery]) -> bool:
        new = self._admit(group)
        try:
            self.engine.begin_prefill(new)
        except Exception as exc:
            log.exception("engine prefill failed to start for %d requests", len(group))
            self._fail(group, "the engine failed during prefill", exc, deliveries)
            return False
        self._background = (len(group), _computed(group))
        return True

    def _end_prefill(self, deliveries: list[Delivery]) -> None:
        """Join the group prefilled beside the decode steps (waits for it if nothing else runs)."""
        ids = self.engine.background_ids
        rows, sizes = self._background
        try:
            outs, seconds = self.engine.end_prefill()
        except Exception as exc:
            group = [self._running[i] for i in ids if i in self._running]
            log.exception("engine prefill failed for %d requests", len(group))
            self._fail(group, "the engine failed during prefill", exc, deliveries)
            return
        self._record("prefill", rows, sizes, seconds)
        self._accept(outs, deliveries)

    def _continue_prefill(self, staged: RequestTracker, deliveries: list[Delivery]) -> None:
        piece = min(self.limits.prefill_chunk_tokens, staged.prompt_len - self.engine.staged_done)
        self._run_step("prefill", [staged], (piece, piece), self.engine.continue_prefill, deliveries)

    @property
    def _staged(self) -> RequestTracker | None:
        """The request the engine is prefilling in chunks: it holds a row but does not decode yet."""
        staged = self.engine.staged_id
        return None if staged is None else self._running.get(staged)

    @property
    def _decoding(self) -> bool:
        """Some running request is past its prefill."""
        return len(self._running) > (self._staged is not None) + len(self.engine.background_ids)

    def _decode(self, deliveries: list[Delivery]) -> None:
        prefilling = {*self.engine.background_ids, self.engine.staged_id}
        rows = [t for t in self._running.values() if t.request_id not in prefilling]
        contexts = [t.context for t in rows]
        sizes = (len(rows) * max(contexts), sum(contexts))
        self._run_step("decode", rows, sizes, self.engine.decode, deliveries)

    def _run_step(
        self,
        phase: str,
        trackers: list[RequestTracker],
        sizes: tuple[int, int],  # the step record's padded and real tokens
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
        self._record(phase, len(trackers), sizes, time.perf_counter() - start)
        self._accept(outs, deliveries)

    def _record(self, phase: str, rows: int, sizes: tuple[int, int], seconds: float) -> None:
        record = StepRecord(phase, rows, *sizes, seconds)
        with self._stats_lock:
            self._steps.append(record)
        self.last_step = record
        if self._metrics is not None:
            self._metrics.on_step(phase, record.rows, record.padding_ratio, record.seconds)

    def _accept(self, outs: list[TokenOut], deliveries: list[Delivery]) -> None:
        now = time.monotonic()
        finished: list[RequestTracker] = []
        for out in outs:
            tracker = self._running[out.seq_id]
            previous = tracker.times.last_token
            try:
                token, finish = tracker.accept(out.token_id, out.logprob, now, out.top, out.prompt)
            except Exception as exc:  # e.g. a token the tokenizer cannot decode: only this request fails
                log.exception("request %s: could not process token %d", tracker.request_id, out.token_id)
                self._fail([tracker], "its output could not be processed", exc, deliveries)
                continue
            if self._metrics is not None:
                if previous is None:
                    self._metrics.on_first_token(now - tracker.times.arrival)
                else:
                    self._metrics.on_token(now - previous)
            token = tracker.pace(token, now, self.limits.stream_interval_seconds, flush=finish is not None)
            if token is not None:
                deliveries.append((tracker, token))
            if finish is not None:
                deliveries.append((tracker, finish))
                finished.append(tracker)
                self._on_finished(finish)
        self._leave(finished)

    def _on_finished(self, finish: FinishEvent) -> None:
        self.count("finished")
        if self._metrics is not None:
            self._metrics.on_finished(
                finish.finish_reason,
                finish.prompt_tokens,
                finish.completion_tokens,
                finish.cached_prompt_tokens,
            )

    def _fail(self, trackers: list[RequestTracker], reason: str, exc: Exception, out: list[Delivery]) -> None:
        def error(tracker: RequestTracker) -> TextgenError:
            return EngineFailure(f"request {tracker.request_id}: {reason}: {type(exc).__name__}: {exc}")

        self._fail_all(trackers, error, out)
        self._leave(trackers)

    def _fail_all(
        self,
        trackers: list[RequestTracker],
        error: Callable[[RequestTracker], TextgenError],
        out: list[Delivery],
    ) -> None:
        now = time.monotonic()
        for tracker in trackers:
            if tracker.done:  # it ended earlier in this step; its outcome was already delivered
                continue
            tracker.end(RequestState.FAILED, now)
            self.count("failed")
            out.append((tracker, error(tracker)))

    def _leave(self, trackers: list[RequestTracker]) -> None:
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
            self._metrics.set_load(
                self._load.running, len(self._waiting), self._load.batch_size, self.engine.max_batch_size
            )


def _computed(group: list[RequestTracker]) -> tuple[int, int]:
    """The padded and real tokens a prefill of `group` computes: the misses padded together, each hit's
    uncached part alone."""
    computed = _Group([])
    for tracker in group:
        computed = computed.plus(tracker, tracker.cached_tokens)
    return computed.prefill_tokens, computed.tokens + computed.alone


@dataclass(frozen=True)
class _Group:
    """Requests considered together, with the sizes admission checks (kept incrementally). The engine
    prefills the members that start from its prefix cache one at a time, only their uncached tokens, and
    the others as one right-padded run."""

    members: list[RequestTracker]
    padded_rows: int = 0  # members prefilled together
    longest: int = 0  # their longest prompt
    tokens: int = 0  # their prompt tokens, summed
    hits: int = 0  # members that start from the prefix cache
    alone: int = 0  # their uncached prompt tokens
    reserved: int = 0  # the largest prompt + max_new_tokens

    @classmethod
    def of(cls, trackers: Iterable[RequestTracker]) -> _Group:
        """For the KV budget only (`reserved`): prefix cache hits are not looked up."""
        group = cls([])
        for tracker in trackers:
            group = group.plus(tracker, 0)
        return group

    def plus(self, tracker: RequestTracker, cached: int) -> _Group:
        members, reserved = [*self.members, tracker], max(self.reserved, tracker.reserved_tokens)
        if cached:
            alone = self.alone + tracker.prompt_len - cached
            return _Group(
                members, self.padded_rows, self.longest, self.tokens, self.hits + 1, alone, reserved
            )
        longest, tokens = max(self.longest, tracker.prompt_len), self.tokens + tracker.prompt_len
        return _Group(members, self.padded_rows + 1, longest, tokens, self.hits, self.alone, reserved)

    @property
    def prefill_tokens(self) -> int:
        """Token slots the prefill computes, padding included."""
        return self.padded_rows * self.longest + self.alone

    @property
    def padding_ratio(self) -> float:
        padded = self.padded_rows * self.longest
        return 1.0 - self.tokens / padded if padded else 0.0


class _Load(NamedTuple):
    running: int
    batch_size: int
    kv_shape: tuple[int, ...]
    reserved: int


def _deadline_message(tracker: RequestTracker) -> str:
    where = "while queued" if tracker.times.admitted is None else "while generating"
    return f"request {tracker.request_id}: deadline exceeded {where}"


class RequestHandle:
    """A submitted request: iterate it for its events; `cancel()` frees its slot at the next step.

    Iteration yields TokenEvents then one FinishEvent, and raises the serve.errors exception of a request
    that was cancelled, expired or failed. Use it on the event loop that submitted it.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, cancel: Callable[[], None]):
        """`cancel` tells the engine's side that the request is to leave at its next step."""
        self.request_id = request_id
        self._loop = loop
        self._cancel = cancel
        self._items: deque[Event | TextgenError] = deque()
        self._arrived = asyncio.Event()  # set while _items is not empty, or once cancelled
        self._ended = False  # the scheduler delivered the last item
        self._exhausted = False  # the iterator returned or raised the last item
        self._cancelled = False

    def cancel(self) -> None:
        """Idempotent; no effect once the request has ended."""
        if self._cancelled or self._ended:
            return
        self._cancelled = True
        self._cancel()
        self._loop.call_soon_threadsafe(self._arrived.set)  # wakes a pending __anext__

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Event:
        if self._exhausted:
            raise StopAsyncIteration
        while not self._items and not self._cancelled:
            self._arrived.clear()
            await self._arrived.wait()
        if self._cancelled:
            self._exhausted = True
            raise Cancelled(f"request {self.request_id} was cancelled")
        item = self._items.popleft()
        if isinstance(item, TextgenError):
            self._exhausted = True
            raise item
        if isinstance(item, FinishEvent):
            self._exhausted = True
        return item

    def ready_tokens(self) -> list[TokenEvent]:
        """The TokenEvents already delivered, without waiting: a stream that fell behind the engine sends
        them in one message instead of one message per step."""
        ready: list[TokenEvent] = []
        while not self._cancelled and self._items and isinstance(self._items[0], TokenEvent):
            ready.append(self._items.popleft())  # type: ignore[arg-type]  # checked just above
        return ready

    def _push(self, item: Event | TextgenError) -> None:
        self._ended = isinstance(item, FinishEvent | TextgenError)
        self._items.append(item)
        self._arrived.set()


Outcome = tuple[str, "Event | TextgenError"]  # a request id and what the engine's side produced for it


class HandleTable:
    """The event loop's side of the requests in flight: their handles, fed with what the engine produced.
    A handle leaves the table with its request's last item (a FinishEvent or an error)."""

    def __init__(self) -> None:
        self._handles: dict[str, RequestHandle] = {}

    def __len__(self) -> int:
        return len(self._handles)

    def check_free(self, request_id: str) -> None:
        if request_id in self._handles:
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def open(
        self, request_id: str, loop: asyncio.AbstractEventLoop, cancel: Callable[[], None]
    ) -> RequestHandle:
        handle = RequestHandle(request_id, loop, cancel)
        self._handles[request_id] = handle
        return handle

    def deliver(self, outcomes: Iterable[Outcome]) -> None:
        for request_id, item in outcomes:
            handle = self._handles.get(request_id)
            if handle is None:
                continue
            handle._push(item)
            if isinstance(item, FinishEvent | TextgenError):
                del self._handles[request_id]

    def fail_all(self, error: Callable[[str], TextgenError]) -> None:
        """End every request in flight with `error(request_id)` (the engine's side is gone)."""
        self.deliver([(request_id, error(request_id)) for request_id in list(self._handles)])


class RequestScheduler(Protocol):
    """What the server needs of a scheduler: `Scheduler` (an engine thread in this process) or
    `serve.engine_process.ProcessScheduler` (the engine in a process of its own)."""

    @property
    def max_total_tokens(self) -> int: ...
    async def start(self) -> None: ...
    def submit(self, request: GenerationRequest) -> RequestHandle: ...
    def snapshot(self) -> SchedulerSnapshot: ...
    def steps(self) -> list[StepRecord]: ...
    async def drain(self, grace_seconds: float) -> None: ...


class Scheduler:
    """Continuous batching on one engine thread; `submit` and the handles live on the event loop."""

    def __init__(
        self, engine: BatchEngine, limits: SchedulerLimits | None = None, metrics: EngineMetrics | None = None
    ) -> None:
        self.limits = (limits or SchedulerLimits()).resolve(engine)
        self._engine = engine
        self._runner = BatchRunner(engine, self.limits, metrics)
        self._handles = HandleTable()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._draining = False
        self._stopping = False

    @property
    def max_total_tokens(self) -> int:
        """The most prompt + max_new_tokens one request may ask for."""
        return self._runner.max_total_tokens

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


def queue_full(request_id: str, max_queue: int) -> QueueFull:
    return QueueFull(f"request {request_id}: the queue is full ({max_queue} waiting); retry later")


def outcomes(deliveries: list[Delivery]) -> list[Outcome]:
    return [(tracker.request_id, item) for tracker, item in deliveries]


def draining(request_id: str) -> Draining:
    return Draining(f"request {request_id}: the server is shutting down; retry elsewhere")


def draining_error(tracker: RequestTracker) -> TextgenError:
    return draining(tracker.request_id)


def _internal_error(tracker: RequestTracker) -> TextgenError:
    return EngineFailure(f"request {tracker.request_id}: internal scheduler error; see the server log")

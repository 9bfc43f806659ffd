"""A generation request, the events it produces, and its state machine.

`RequestTracker` is the one place that decides when a request stops (max_new_tokens, EOS, stop strings,
context full, a constraint complete) and what it emits; the scheduler and the offline API both drive it
with the engine's tokens.
It records the timestamps the metrics need (all `time.monotonic()` values). Whether a request can be
served at all, request_checks.py decides.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import tokenizers

from serve.engine.sampling import Alternatives, PromptScores, SamplingParams
from serve.engine.types import Constraint, ConstraintState
from serve.scheduling.textstream import TextStream

if TYPE_CHECKING:
    from serve.engine.types import CompiledConstraint, NewSequence

_NO_SCORES = PromptScores([], [])


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    include_logprobs: bool = False
    deadline: float | None = None  # a time.monotonic() value
    # The caller reads tokens as they come (GenerateStream). False: it reads the whole completion, so the
    # engine thread hands it over once, at the end, instead of waking the event loop for every token.
    stream: bool = True
    # Token ids that end generation as EOS does (finish reason `stop`; the token itself is not returned).
    stop_token_ids: tuple[int, ...] = ()
    # Nothing ends the request before this many new tokens: EOS and the stop token ids are not sampled, stop
    # strings are looked for from that token's text on.
    min_new_tokens: int = 0
    # With include_logprobs: this many most likely tokens of each step, with their logprobs.
    top_logprobs: int = 0
    # The matched stop string ends the text instead of being cut off with what follows.
    include_stop_str_in_output: bool = False
    # Each prompt token's logprob after those before it, in the first TokenEvent (vLLM's prompt_logprobs).
    # With max_new_tokens 0 the request only scores its prompt: the token its prefill samples is dropped.
    prompt_logprobs: bool = False
    # With prompt_logprobs: this many most likely tokens at each prompt position, with their logprobs.
    prompt_top_logprobs: int = 0
    # The request id of another choice of the same request with the same prompt (n > 1): admitted in its
    # prefill group, this one's prompt is not computed but forked from that one's row (NewSequence.fork_of).
    fork_of: str | None = None
    # What the output must match (structured output), enforced token by token. It ends the request once
    # complete (finish reason `stop`, or `eos` where EOS may follow), whatever min_new_tokens and ignore_eos
    # say; EOS is allowed only where the constraint may end.
    constraint: Constraint | None = None
    # The most tokens speculation proposes per step for it (prompt lookup or a draft, within the server's
    # --num-speculative-tokens); None: the server's number, 0: none. Its tokens are the same either way.
    speculative_tokens: int | None = None
    # Under the server's priority policy: waiting requests are admitted lowest value first, arrival order
    # among equals (vLLM's convention); the fcfs policy ignores it.
    priority: int = 0
    # The LoRA adapter it runs with, by the name the server loaded it under; "": the base model.
    adapter: str = ""


@dataclass
class SpeculationCount:
    """A request's speculation so far: tokens proposed for it, and how many of them sampling picked."""

    proposed: int = 0
    accepted: int = 0

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@dataclass(frozen=True)
class TokenEvent:
    """What one engine step produced for a request: new token ids and the text they completed."""

    token_ids: list[int]
    text: str
    logprobs: list[float]  # empty unless the request asked for them
    top_logprobs: list[Alternatives] = field(default_factory=list)  # one per token if asked for
    prompt_logprobs: list[float] = field(default_factory=list)  # in the first event, if asked for
    prompt_top_logprobs: list[Alternatives] = field(default_factory=list)  # likewise, one per prompt logprob
    # In the first event: the prompt tokens read from the prefix cache (a stream's usage can say so at once).
    cached_prompt_tokens: int | None = None

    @staticmethod
    def join(events: list[TokenEvent]) -> TokenEvent:
        """Consecutive events as one (tokens, text and logprobs in order)."""
        if len(events) == 1:
            return events[0]
        return TokenEvent(
            token_ids=[t for e in events for t in e.token_ids],
            text="".join(e.text for e in events),
            logprobs=[lp for e in events for lp in e.logprobs],
            top_logprobs=[a for e in events for a in e.top_logprobs],
            prompt_logprobs=[p for e in events for p in e.prompt_logprobs],
            prompt_top_logprobs=[a for e in events for a in e.prompt_top_logprobs],
            cached_prompt_tokens=events[0].cached_prompt_tokens,
        )


@dataclass(frozen=True)
class FinishEvent:
    finish_reason: str  # length | eos | stop | context
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # of prompt_tokens, copied from the engine's prefix cache, not computed
    queue_seconds: float
    ttft_seconds: float
    total_seconds: float
    # A constrained request ended before its output matched the constraint in full (max_new_tokens, the
    # context, a stop string or stop token cut it short): the output is a prefix of a match, not one.
    constraint_incomplete: bool = False
    stop_string: str | None = None  # the stop string that ended the text (finish_reason "stop")


Event = TokenEvent | FinishEvent


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"  # its row given to a more urgent request; back in the queue to resume
    FINISHED = "finished"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"


_ENDINGS = frozenset(
    {RequestState.FINISHED, RequestState.CANCELLED, RequestState.EXPIRED, RequestState.FAILED}
)
_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.PREFILLING}) | (_ENDINGS - {RequestState.FINISHED}),
    RequestState.PREFILLING: frozenset({RequestState.DECODING}) | _ENDINGS,
    RequestState.DECODING: _ENDINGS | {RequestState.PREEMPTED},
    RequestState.PREEMPTED: frozenset({RequestState.DECODING}) | (_ENDINGS - {RequestState.FINISHED}),
}


@dataclass
class RequestTimes:
    arrival: float
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class RequestTracker:
    """One request's state machine: queued -> prefilling -> decoding -> finished|cancelled|expired|failed.

    Transitions happen on the thread that drives the engine; `request_cancel()` may be called from any thread
    and only sets a flag that the driver turns into the CANCELLED state at the next step.
    """

    def __init__(
        self,
        request: GenerationRequest,
        tokenizer: tokenizers.Tokenizer,
        eos_token_ids: int | Sequence[int],  # every id that ends a generation as EOS
        token_limit: int,
        arrival: float,
    ) -> None:
        self.request = request
        self.state = RequestState.QUEUED
        self.times = RequestTimes(arrival=arrival)
        # Tokens the engine sampled for it, EOS included: its KV row holds prompt + produced after a decode.
        self.produced = 0
        self.cached_tokens = 0  # prompt tokens its prefill copied from the prefix cache (set at admission)
        self.completion_tokens = 0  # tokens handed to the client (EOS excluded)
        self.cancel_requested = False
        self.speculated = SpeculationCount()
        self._prompt_scores = _NO_SCORES  # the prompt's, until the first event carries them
        self._first_event = True  # the next event is the first: it carries cached_tokens
        self._eos = (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids)
        self._eos_set = frozenset(self._eos)
        self._stop_ids = frozenset(request.stop_token_ids)
        self._limit = token_limit  # prompt + generated tokens may not exceed it
        self._text = TextStream(
            tokenizer,
            request.stop,
            incremental=request.stream,
            include_stop=request.include_stop_str_in_output,
            min_tokens=request.min_new_tokens,
        )
        self._held: list[TokenEvent] = []  # produced, not yet handed over (see `pace`)
        self._handed_at: float | None = None
        # The constraint's compile (the runner starts it when the request is tracked; admitted once done).
        self.compiled: Future[CompiledConstraint] | None = None
        self._constrained = request.constraint is not None
        self._matching = False  # the output handed over so far matches the constraint in full

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def context(self) -> int:
        """Tokens in this request's KV row once the next decode step has run (prompt + produced)."""
        return self.prompt_len + self.produced

    @property
    def reserved_tokens(self) -> int:
        """The most KV tokens this request can ever occupy."""
        return min(self.prompt_len + self.request.max_new_tokens, self._limit)

    @property
    def done(self) -> bool:
        return self.state in _ENDINGS

    def new_sequence(self) -> NewSequence:
        """What the engine needs to prefill this request: its sampling, its compiled constraint, and the
        tokens that would end it (EOS unless ignored, the stop token ids) banned until `min_new_tokens`."""
        from serve.engine.types import NewSequence

        request = self.request
        eos_ends = not request.ignore_eos or self._constrained  # a constrained request ends at EOS anyway
        ends = (*self._eos, *request.stop_token_ids) if eos_ends else request.stop_token_ids
        compiled = None
        if self.compiled is not None:
            compiled = self.compiled.result()  # admitted only once compiled
        return NewSequence(
            seq_id=request.request_id,
            prompt_ids=request.prompt_ids,
            sampling=request.sampling,
            logprobs=request.include_logprobs,
            banned=ends if request.min_new_tokens else (),
            banned_for=request.min_new_tokens,
            top_logprobs=request.top_logprobs,
            prompt_logprobs=request.prompt_logprobs,
            prompt_top_logprobs=request.prompt_top_logprobs,
            fork_of=request.fork_of,
            constraint=compiled,
            speculative_tokens=request.speculative_tokens,
            adapter=request.adapter,
        )

    def request_cancel(self) -> None:
        self.cancel_requested = True

    def expired(self, now: float) -> bool:
        return self.request.deadline is not None and now >= self.request.deadline

    def admit(self, now: float, cached_tokens: int = 0) -> float:
        """Move to PREFILLING, its prefill starting from `cached_tokens` prompt tokens the engine keeps;
        returns the seconds it waited in the queue."""
        self._move(RequestState.PREFILLING)
        self.times.admitted = now
        self.cached_tokens = cached_tokens
        return now - self.times.arrival

    def preempt(self) -> None:
        """Give up its row to a more urgent request: it waits in the queue, its output so far kept."""
        self._move(RequestState.PREEMPTED)

    def resume(self) -> None:
        """Take a row again after `preempt`, to go on where it stopped."""
        self._move(RequestState.DECODING)

    @property
    def preempted(self) -> bool:
        return self.state is RequestState.PREEMPTED

    def end(self, state: RequestState, now: float) -> None:
        """Leave without finishing normally (cancelled, expired or failed)."""
        self._move(state)
        self.times.finished = now

    def accept(
        self,
        token_id: int,
        logprob: float,
        now: float,
        top: Alternatives | None = None,
        prompt: PromptScores | None = None,
        constraint: ConstraintState | None = None,
    ) -> tuple[TokenEvent | None, FinishEvent | None]:
        """Take the engine's next token (with its logprob and, if asked for, the step's most likely tokens,
        with the first token the prompt's logprobs, and for a constrained request where its output stands
        after it); returns what to send (either may be None) and stops when due."""
        if self.state is RequestState.PREFILLING:
            self._move(RequestState.DECODING)
            self.times.first_token = now
            self._prompt_scores = prompt or _NO_SCORES
        self.times.last_token = now
        self.produced += 1
        if self.request.max_new_tokens == 0:  # scoring only: the prompt's logprobs, no token
            return self._event([], "", [], []), self._finish("length", now)
        if token_id in self._eos_set and (self._constrained or not self.request.ignore_eos):
            self._matching = self._constrained  # a constraint allows EOS only where its output matches
            return self._event([], self._text.flush(), [], []), self._finish("eos", now)
        if token_id in self._stop_ids:
            return self._event([], self._text.flush(), [], []), self._finish("stop", now)
        self.completion_tokens += 1
        delta = self._text.push(token_id)
        scores = ([logprob], [top] if top is not None else []) if self.request.include_logprobs else ([], [])
        if delta.stopped:  # the text is cut at the stop string: whether what is left matches is not known
            self._matching = False
            return self._event([token_id], delta.text, *scores), self._finish("stop", now)
        if constraint is not None:
            self._matching = constraint is not ConstraintState.PARTIAL
        reason = "stop" if constraint is ConstraintState.COMPLETE else self._limit_reached()
        if reason is None:
            return self._event([token_id], delta.text, *scores), None
        return self._event([token_id], delta.text + self._text.flush(), *scores), self._finish(reason, now)

    def pace(self, event: TokenEvent | None, now: float, interval: float, flush: bool) -> TokenEvent | None:
        """What to hand to the client now: the first tokens at once, then at most one event per `interval`
        seconds, carrying every token held since the previous one; `flush` (the request ends) hands over the
        rest. A client that reads each message costs the server the same whether it carries one token or ten,
        so a fast model need not pay that cost per token. A request that does not stream gets everything at
        the end."""
        if event is not None:
            self._held.append(event)
        if not self._held:
            return None
        if not flush and not self.request.stream:
            return None
        if not flush and self._handed_at is not None and now - self._handed_at < interval:
            return None
        self._handed_at = now
        held, self._held = self._held, []
        return TokenEvent.join(held)

    def _limit_reached(self) -> str | None:
        if self.completion_tokens >= self.request.max_new_tokens:
            return "length"
        # One more token would exceed the limit (the engine's contract: prompt + generated <= capacity).
        if self.context >= self._limit:
            return "context"
        return None

    def _event(
        self, token_ids: list[int], text: str, logprobs: list[float], top: list[Alternatives]
    ) -> TokenEvent | None:
        scores, self._prompt_scores = self._prompt_scores, _NO_SCORES
        if not token_ids and not text and not scores.logprobs:
            return None
        cached, self._first_event = self.cached_tokens if self._first_event else None, False
        return TokenEvent(token_ids, text, logprobs, top, scores.logprobs, scores.top, cached)

    def _finish(self, reason: str, now: float) -> FinishEvent:
        self._move(RequestState.FINISHED)
        self.times.finished = now
        return FinishEvent(
            finish_reason=reason,
            prompt_tokens=self.prompt_len,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
            queue_seconds=_since(self.times.admitted, self.times.arrival),
            ttft_seconds=_since(self.times.first_token, self.times.arrival),
            total_seconds=now - self.times.arrival,
            constraint_incomplete=self._constrained and not self._matching,
            stop_string=self._text.stop_string,
        )

    def _move(self, new: RequestState) -> None:
        if new not in _TRANSITIONS.get(self.state, frozenset()):
            raise RuntimeError(
                f"request {self.request_id}: illegal transition {self.state.value} -> {new.value}"
            )
        self.state = new


def _since(mark: float | None, start: float) -> float:
    if mark is None:
        raise RuntimeError("a finished request always has its admission and first-token times")
    return mark - start


@dataclass
class Completion:
    """A whole generation, assembled from a request's events (offline API and unary calls)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Alternatives] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[Alternatives] = field(default_factory=list)
    finish: FinishEvent | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, FinishEvent):
            self.finish = event
            return
        self.token_ids.extend(event.token_ids)
        self.text += event.text
        self.logprobs.extend(event.logprobs)
        self.top_logprobs.extend(event.top_logprobs)
        self.prompt_logprobs.extend(event.prompt_logprobs)
        self.prompt_top_logprobs.extend(event.prompt_top_logprobs)

    @property
    def finish_reason(self) -> str:
        if self.finish is None:
            raise RuntimeError(f"request {self.request_id} has not finished")
        return self.finish.finish_reason

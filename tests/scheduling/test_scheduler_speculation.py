"""Scheduler: a speculating step, which gives a request several tokens at once, is taken as one step: its
tokens reach the stream in one event, its interval is spread over them in the inter-token latency, and its
proposal is counted as far as the request kept its tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from scheduler_fakes import Instrumented, fake
from scheduler_runs import prompt_of, request, run, started
from tokenizers import Tokenizer

from serve.scheduling.engine_core import MetricRecorder
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, Event, GenerationRequest, TokenEvent

STEP_SECONDS = 0.02
# Each decode step proposes 4 tokens and accepts 3: the request gets 4 tokens a step, after the prefill's.
SPECULATION = (4, 3)
PER_STEP = SPECULATION[1] + 1


class Recorder(MetricRecorder):
    """The runner's metric calls, recorded, as a scheduler's metrics (which also read the queue's length)."""

    def watch_waiting(self, waiting: Callable[[], int]) -> None:
        pass  # the queue gauge is not what these tests look at


def served(
    engine: Instrumented, new: GenerationRequest, stream_interval_ms: float = 0.0
) -> tuple[list[Event], MetricRecorder]:
    """One request's events, and the metric calls its run made."""
    metrics = Recorder()

    async def main() -> list[Event]:
        limits = SchedulerLimits(max_wait_seconds=0.0, stream_interval_ms=stream_interval_ms)
        scheduler = await started(engine, limits, metrics=metrics)
        events = [event async for event in scheduler.submit(new)]
        await scheduler.drain(1.0)
        return events

    return run(main), metrics


def completion_of(events: list[Event]) -> Completion:
    completion = Completion("r")
    for event in events:
        completion.add(event)
    return completion


def calls(metrics: MetricRecorder, name: str) -> list[tuple[Any, ...]]:
    return [args for called, args in metrics.calls if called == name]


def speculating(tokenizer: Tokenizer, **kw: Any) -> Instrumented:
    return fake(tokenizer, STEP_SECONDS, speculation=SPECULATION, **kw)


def token_counts(events: list[Event]) -> list[int]:
    return [len(e.token_ids) for e in events if isinstance(e, TokenEvent)]


def test_a_steps_tokens_reach_the_stream_in_one_event_within_the_step(tokenizer: Tokenizer) -> None:
    engine = speculating(tokenizer)
    new = request("r", prompt_of(4), max_new=1 + 3 * PER_STEP)
    events, _ = served(engine, new, stream_interval_ms=STEP_SECONDS * 1000 / 4)  # shorter than a step
    assert token_counts(events) == [1, PER_STEP, PER_STEP, PER_STEP]  # the prefill's, then each step's
    assert completion_of(events).token_ids == engine.expected(prompt_of(4), 1 + 3 * PER_STEP)


def test_a_stream_interval_longer_than_a_step_holds_whole_steps(tokenizer: Tokenizer) -> None:
    engine = speculating(tokenizer)
    new = request("r", prompt_of(4), max_new=1 + 4 * PER_STEP)
    events, _ = served(engine, new, stream_interval_ms=STEP_SECONDS * 1000 * 2.5)
    first, *held = token_counts(events)
    assert first == 1 and sum(held) == 4 * PER_STEP
    assert all(n % PER_STEP == 0 for n in held)  # a step's tokens are never split over two events
    assert len(held) < 4  # and some events carry several steps


def test_inter_token_latency_divides_each_step_over_its_tokens(tokenizer: Tokenizer) -> None:
    steps = 3
    events, metrics = served(speculating(tokenizer), request("r", prompt_of(4), max_new=1 + steps * PER_STEP))
    gaps = [gap for (gap,) in calls(metrics, "on_token")]
    per_step = [gaps[i : i + PER_STEP] for i in range(0, len(gaps), PER_STEP)]
    assert len(per_step) == steps and all(len(set(step)) == 1 for step in per_step)  # one value a step
    assert min(gaps) >= STEP_SECONDS / PER_STEP  # not ~0: each token's share of a step of STEP_SECONDS
    finish = completion_of(events).finish
    assert finish is not None  # the shares add up to the time from the first token to the last
    assert sum(gaps) == pytest.approx(finish.total_seconds - finish.ttft_seconds)


@pytest.mark.parametrize(
    ("max_new", "counted"),
    [
        (1 + PER_STEP, [SPECULATION]),  # the first step's tokens, all of them
        (2 + PER_STEP, [SPECULATION]),  # ends at the second step's first token: none of its proposal needed
        (3 + PER_STEP, [SPECULATION, (1, 1)]),  # ends at its second, an accepted proposal
        (4 + PER_STEP, [SPECULATION, (2, 2)]),
        (1 + 2 * PER_STEP, [SPECULATION, SPECULATION]),  # ends at its last token: it kept them all
    ],
)
def test_a_step_cut_by_the_token_limit_counts_what_the_request_kept(
    tokenizer: Tokenizer, max_new: int, counted: list[tuple[int, int]]
) -> None:
    events, metrics = served(speculating(tokenizer), request("r", prompt_of(4), max_new=max_new))
    assert completion_of(events).finish_reason == "length"
    assert calls(metrics, "on_speculated") == counted
    proposed, accepted = (sum(n) for n in zip(*counted, strict=True))
    assert calls(metrics, "on_speculation_done") == [(accepted / proposed,)]


@pytest.mark.parametrize("end", ["eos", "stop string"])
def test_a_stop_inside_the_accepted_tokens_counts_only_those_kept(tokenizer: Tokenizer, end: str) -> None:
    ending = 3 + PER_STEP  # the second step's second token: an accepted proposal, two more follow it
    plain = speculating(tokenizer).expected(prompt_of(4), ending)
    if end == "eos":
        engine = speculating(tokenizer, eos_after=ending)
        new = request("r", prompt_of(4), max_new=20, ignore_eos=False)
    else:  # the first time the text holds it is at that token
        engine = speculating(tokenizer)
        new = request("r", prompt_of(4), max_new=20, stop=(tokenizer.decode(plain),))
    events, metrics = served(engine, new)
    assert completion_of(events).finish_reason == ("eos" if end == "eos" else "stop")
    assert calls(metrics, "on_speculated") == [SPECULATION, (1, 1)]
    assert calls(metrics, "on_speculation_done") == [(4 / 5,)]

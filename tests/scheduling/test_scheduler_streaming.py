"""Scheduler: how tokens reach a request's handle: stream pacing, unary requests, text decoded once, a stream
that falls behind."""

from __future__ import annotations

import asyncio

import pytest
from scheduler_runs import EngineFactory, prompt_of, request, run, started
from tokenizers import Tokenizer

from serve.scheduling.handles import RequestHandle
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, FinishEvent, RequestTracker, TokenEvent


def tracker_of(tokenizer: Tokenizer, max_new: int = 8) -> RequestTracker:
    return RequestTracker(request("p", prompt_of(3), max_new=max_new), tokenizer, 0, 64, arrival=0.0)


LETTERS_TEXT = "abcd"


def test_pace_hands_over_the_first_token_at_once_then_at_most_once_per_interval(tokenizer: Tokenizer) -> None:
    tracker = tracker_of(tokenizer)
    a, b, c, d = (TokenEvent([i], LETTERS_TEXT[i], [float(-i)]) for i in range(4))
    assert tracker.pace(a, now=1.0, interval=0.5, flush=False) == a
    assert tracker.pace(b, now=1.2, interval=0.5, flush=False) is None
    assert tracker.pace(None, now=1.3, interval=0.5, flush=False) is None  # a step that produced no text
    assert tracker.pace(c, now=1.5, interval=0.5, flush=False) == TokenEvent([1, 2], "bc", [-1.0, -2.0])
    assert tracker.pace(d, now=1.6, interval=0.5, flush=True) == d  # the request ends: nothing is held back
    assert tracker.pace(None, now=9.0, interval=0.5, flush=True) is None
    unpaced = tracker_of(tokenizer)
    assert [unpaced.pace(e, now=1.0, interval=0.0, flush=False) for e in (a, b)] == [a, b]


def test_a_request_that_does_not_stream_is_handed_over_once_at_the_end(tokenizer: Tokenizer) -> None:
    tracker = RequestTracker(request("u", prompt_of(3), stream=False), tokenizer, 0, 64, arrival=0.0)
    a, b, c = (TokenEvent([i], LETTERS_TEXT[i], []) for i in range(3))
    assert tracker.pace(a, now=1.0, interval=0.0, flush=False) is None  # not even the first token
    assert tracker.pace(b, now=5.0, interval=0.0, flush=False) is None
    assert tracker.pace(c, now=9.0, interval=0.0, flush=True) == TokenEvent([0, 1, 2], "abc", [])


def test_a_request_that_does_not_stream_gets_the_same_text_decoded_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("é a😀b").ids  # characters of several byte tokens (none is in the letters)

    decodes: list[list[int]] = []

    class Counting:
        def get_vocab_size(self) -> int:
            return tokenizer.get_vocab_size()

        def decode(self, window: list[int]) -> str:
            decodes.append(list(window))
            return tokenizer.decode(window)

    def text_of(stream: bool) -> tuple[str, str]:
        new = request("t", prompt_of(3), max_new=len(ids), stream=stream)
        tracker = RequestTracker(new, Counting(), 0, 64, 0.0)  # type: ignore[arg-type]
        tracker.admit(0.0)
        completion = Completion("t")
        for step, token in enumerate(ids):
            event, finish = tracker.accept(token, 0.0, now=float(step))
            for item in (tracker.pace(event, float(step), 0.0, flush=finish is not None), finish):
                if item is not None:
                    completion.add(item)
        return completion.text, completion.finish_reason

    assert text_of(stream=False) == ("é a😀b", "length")
    assert decodes == [ids]  # once, at the end
    assert text_of(stream=True) == ("é a😀b", "length") and len(decodes) > len(ids) > 4


def test_a_stream_that_falls_behind_takes_what_is_ready_in_one_go(tokenizer: Tokenizer) -> None:
    async def main() -> None:
        tracker = tracker_of(tokenizer)
        handle = RequestHandle(tracker.request_id, asyncio.get_running_loop(), lambda: None)
        events = [TokenEvent([i], "x", []) for i in range(3)]
        finish = FinishEvent("length", 3, 3, 0, 0.0, 0.0, 0.0)
        for item in (*events, finish):
            handle._push(item)
        coalesced = handle.coalesced()
        assert await anext(coalesced) == TokenEvent.join(events)  # the finish stays for the next read
        assert await anext(coalesced) == finish
        with pytest.raises(StopAsyncIteration):
            await anext(coalesced)

    run(main)


def test_stream_interval_through_the_scheduler_keeps_every_token(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2)

    async def main() -> list[list[TokenEvent | FinishEvent]]:
        scheduler = await started(engine, SchedulerLimits(stream_interval_ms=10_000))
        handles = [scheduler.submit(request(f"r{i}", prompt_of(4 + i), max_new=10)) for i in range(2)]

        async def events(handle: RequestHandle) -> list[TokenEvent | FinishEvent]:
            return [event async for event in handle]

        done = await asyncio.gather(*(events(h) for h in handles))
        await scheduler.drain(1.0)
        return done

    for i, events in enumerate(run(main)):
        *tokens, finish = events
        assert isinstance(finish, FinishEvent) and finish.completion_tokens == 10
        assert [len(e.token_ids) for e in tokens if isinstance(e, TokenEvent)] == [1, 9]
        assert [t for e in tokens if isinstance(e, TokenEvent) for t in e.token_ids] == engine.expected(
            prompt_of(4 + i), 10
        )


def test_unary_requests_get_one_event_beside_streams_that_get_every_step(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2)

    async def main() -> list[list[TokenEvent | FinishEvent]]:
        scheduler = await started(engine)
        handles = [
            scheduler.submit(request("unary", prompt_of(5), max_new=12, stream=False)),
            scheduler.submit(request("stream", prompt_of(6), max_new=12)),
        ]

        async def events(handle: RequestHandle) -> list[TokenEvent | FinishEvent]:
            return [event async for event in handle]

        done = await asyncio.gather(*(events(h) for h in handles))
        await scheduler.drain(1.0)
        return done

    unary, stream = run(main)
    assert len(unary) == 2 and isinstance(unary[1], FinishEvent)
    assert isinstance(unary[0], TokenEvent) and unary[0].token_ids == engine.expected(prompt_of(5), 12)
    assert isinstance(stream[-1], FinishEvent) and len(stream) > 2
    tokens = [t for e in stream if isinstance(e, TokenEvent) for t in e.token_ids]
    assert tokens == engine.expected(prompt_of(6), 12)

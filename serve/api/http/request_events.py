"""One HTTP request's choices as the scheduler runs them: submitted together, their events merged as they
come, waited for until done or until the client goes away (which cancels them all), and their usage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import Request

from serve.api.common import LoadedModel
from serve.api.http.translate import (
    Plan,
)
from serve.errors import Cancelled
from serve.scheduling.handles import RequestHandle
from serve.scheduling.request import Completion, Event, FinishEvent, GenerationRequest

T = TypeVar("T")


def submit_all(model: LoadedModel, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
    handles: list[RequestHandle] = []
    try:
        for request in requests:
            handles.append(model.scheduler.submit(request))
    except BaseException:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read already: the next message is the end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise Cancelled("the client went away")


async def complete(handle: RequestHandle) -> Completion:
    completion = Completion(handle.request_id)
    async for event in handle:
        completion.add(event)
    return completion


async def until_done(
    tasks: Sequence[asyncio.Future[Any]], request: Request, handles: Sequence[RequestHandle]
) -> None:
    """Waits for every task; the first error (or the client going away) cancels the rest and is raised."""
    watcher = asyncio.ensure_future(_disconnected(request))
    pending: set[asyncio.Future[Any]] = {*tasks, watcher}
    try:
        while any(not t.done() for t in tasks):
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                if future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
    finally:
        watcher.cancel()
        for handle in handles:
            handle.cancel()  # no effect once finished
        for task in tasks:
            task.cancel()


async def merged(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, Event]]:
    """Every choice's events as they come, tagged with its index; a stream that fell behind the engine gets
    what arrived meanwhile in one event."""
    queue: asyncio.Queue[tuple[int, Event | Exception]] = asyncio.Queue()

    async def pump(index: int, handle: RequestHandle) -> None:
        try:
            async for event in handle.coalesced():
                queue.put_nowait((index, event))
        except Exception as exc:
            queue.put_nowait((index, exc))

    if len(handles) == 1:  # the usual case, without a task
        handle = handles[0]
        async for event in handle.coalesced():
            yield 0, event
        return
    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if isinstance(item, FinishEvent):
                left -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _merged_finish(finishes: Sequence[FinishEvent], prompt_tokens: int, cached: int) -> FinishEvent:
    """One log line's finish for all of a request's choices."""
    first = finishes[0]
    return FinishEvent(
        finish_reason=first.finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=sum(f.completion_tokens for f in finishes),
        cached_prompt_tokens=cached,
        queue_seconds=min(f.queue_seconds for f in finishes),
        ttft_seconds=min(f.ttft_seconds for f in finishes),
        total_seconds=max(f.total_seconds for f in finishes),
    )


def plan_usage(
    plan: Plan, finishes: Sequence[FinishEvent | None]
) -> tuple[dict[str, Any], FinishEvent | None]:
    done = [f for f in finishes if f is not None]
    prompt = sum(len(p.ids) for p in plan.prompts)
    # The prompt is counted once per prompt, not once per choice (as OpenAI does).
    cached = (
        sum((finishes[i * plan.n] or done[0]).cached_prompt_tokens for i in range(len(plan.prompts)))
        if done
        else 0
    )
    completion = sum(f.completion_tokens for f in done)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    return usage, (_merged_finish(done, prompt, cached) if done else None)


async def with_keepalives(
    events: AsyncIterator[tuple[int, Event]], seconds: float
) -> AsyncIterator[tuple[int, Event] | None]:
    """`events`, and None each time `seconds` pass without one (a queued request, a long prefill)."""
    pending: asyncio.Future[tuple[int, Event]] | None = None
    try:
        while True:
            pending = asyncio.ensure_future(events.__anext__())
            while not (await asyncio.wait({pending}, timeout=seconds))[0]:
                yield None
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()  # no effect once done


async def first_event(events: AsyncIterator[T], request: Request) -> T:
    """The first event, unless the client goes away first (Cancelled)."""
    nxt = asyncio.ensure_future(events.__anext__())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done():
            nxt.cancel()
            await asyncio.wait({nxt})  # the generator must have stopped before it is closed
            watcher.result()  # raises Cancelled
        return nxt.result()
    finally:
        watcher.cancel()


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    yield first
    async for item in rest:
        yield item

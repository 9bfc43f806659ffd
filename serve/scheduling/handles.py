"""The event loop's side of the requests in flight: a handle per request, fed what the engine produced."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import NamedTuple

from serve.errors import Cancelled, InvalidRequest, TextgenError
from serve.scheduling.request import Event, FinishEvent, TokenEvent


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

    async def coalesced(self) -> AsyncIterator[Event]:
        """The events, each TokenEvent joined with those already delivered behind it: a stream that fell
        behind the engine sends them in one message instead of one message per step."""
        async for event in self:
            if isinstance(event, TokenEvent):
                event = TokenEvent.join([event, *self._ready_tokens()])
            yield event

    def _ready_tokens(self) -> list[TokenEvent]:
        ready: list[TokenEvent] = []
        while not self._cancelled and self._items and isinstance(self._items[0], TokenEvent):
            ready.append(self._items.popleft())  # type: ignore[arg-type]  # checked just above
        return ready

    def _push(self, item: Event | TextgenError) -> None:
        self._ended = isinstance(item, FinishEvent | TextgenError)
        self._items.append(item)
        self._arrived.set()


class Outcome(NamedTuple):
    """What the engine's side produced for one request, addressed by its id (crosses the process pipe)."""

    request_id: str
    item: Event | TextgenError


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
        self.deliver([Outcome(request_id, error(request_id)) for request_id in list(self._handles)])

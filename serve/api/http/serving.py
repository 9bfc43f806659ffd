"""The one serving skeleton of /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages.

A route's translation (translate_*.py) makes a `Plan`; its `Renderer` (completions.py, chat.py, responses.py,
anthropic/messages.py) says what the answer looks like; `Serving.run` submits the plan's requests and answers
when they are done, with the whole body, or as they go, with a stream of server-sent events. A stream begins
with its first event, so a request refused before it (a constraint llguidance rejects, a drain, a failed
prefill) gets its HTTP status and one whose client leaves while queued is cancelled, unless its renderer opens
the stream at once (/v1/responses' response.created); an error after the stream began is the route's failure
events, then the end of the stream. Either way the call is accounted once, when it ends. A route may keep a
quiet stream alive (/v1/messages pings while its request waits for the engine): its stream begins with the
first event, or once it has waited that long for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.api.common import CallRecord, LoadedModel
from serve.api.http.request_events import (
    complete,
    first_event,
    merged,
    plan_usage,
    prepend,
    submit_all,
    until_done,
    with_keepalives,
)
from serve.api.http.translate import Plan
from serve.api.http.vocabulary import Vocabulary
from serve.api.http_status import HttpError, http_error
from serve.api.state import ServingState
from serve.errors import Draining
from serve.scheduling.handles import RequestHandle
from serve.scheduling.request import Completion, Event, FinishEvent, TokenEvent

log = logging.getLogger("textgen.http")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

P = TypeVar("P", bound=Plan)


def finish_reason(reason: str) -> str:
    """textgen's finish reason as OpenAI's: EOS and stop sequences are "stop", the limits "length"."""
    return "stop" if reason in ("eos", "stop") else "length"


def context_filled(finish: FinishEvent, context_length: int, asked: int | None) -> bool:
    """Whether an output cut short ("length") was cut by the model's context: the tracker's limit, or the
    context full before the `asked` tokens (None: the server's default, which the context shortens)."""
    if finish.finish_reason == "context":
        return True
    full = finish.prompt_tokens + finish.completion_tokens >= context_length
    return full and (asked is None or finish.completion_tokens < asked)


DONE = "data: [DONE]\n\n"


def sse_data(obj: dict[str, Any], usage_field: bool = False) -> str:
    if usage_field:
        obj["usage"] = None  # OpenAI: every chunk but the last has "usage": null when usage is asked for
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class Renderer(ABC, Generic[P]):
    """How a route shows one call's results: the whole body of its finished requests, or a stream of
    server-sent events. One per call: a stream's renderer keeps what it has sent.

    A stream sends `opening()` as soon as the requests are submitted, when the route has something to say
    then; one with nothing to say begins with the first event, so that a request refused before it gets its
    HTTP status, or with its first keepalive() if it has one and waits that long."""

    prefix: ClassVar[str]  # of the response's id
    keepalive_seconds: ClassVar[float | None] = None  # a stream this long without events sends keepalive()

    def __init__(self, plan: P, model: str, request_id: str, vocab: Vocabulary) -> None:
        self.plan = plan
        self.id = f"{self.prefix}{request_id}"
        self.created = int(time.time())
        self.model = model
        self.vocab = vocab

    @abstractmethod
    def body(self, done: Sequence[Completion]) -> Mapping[str, Any]:
        """The whole answer, from the finished requests (one per request of the plan)."""

    def opening(self) -> list[str]:
        """The stream's first events, before any request's (none by default)."""
        return []

    @abstractmethod
    def events(self, index: int, event: Event) -> list[str]:
        """The stream's events for one event of request `index`."""

    @abstractmethod
    def closing(self, finishes: Sequence[FinishEvent | None]) -> list[str]:
        """The stream's last events, once every request has finished."""

    @abstractmethod
    def failure(self, error: HttpError) -> list[str]:
        """The events that end a stream which failed after it began."""

    def keepalive(self) -> list[str]:
        """What a stream sends when it has waited keepalive_seconds for the engine (none by default): the
        stream's beginning, if it has not begun."""
        return []


class ChunkRenderer(Renderer[P]):
    """A route whose stream is chunks of its object, each a `data:` event of one choice, then `data:
    [DONE]` (completions, chat): a subclass says what the object and its choices hold."""

    def __init__(self, plan: P, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self._started = [False] * len(plan.requests)

    @abstractmethod
    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        """The response object around `choices`: the whole body's, or a stream chunk's (`chunk`)."""

    @abstractmethod
    def choices(self, done: Sequence[Completion]) -> list[dict[str, Any]]:
        """The whole body's choices, one per request of the plan."""

    @abstractmethod
    def on_tokens(self, index: int, event: TokenEvent) -> list[dict[str, Any]]:
        """The chunks' choices that choice `index`'s new tokens make (none while there is nothing to send)."""

    @abstractmethod
    def on_finish(self, index: int, event: FinishEvent) -> list[dict[str, Any]]:
        """The chunks' choices that end choice `index`; the last one carries its finish reason."""

    def chunks(self, index: int, event: Event) -> list[dict[str, Any]]:
        """The stream's chunks for one event of choice `index`, one choice each."""
        if isinstance(event, FinishEvent):
            choices = self.on_finish(index, event)
        else:
            choices = self.on_tokens(index, event)
        return [self.envelope([choice], chunk=True) for choice in choices]

    def body(self, done: Sequence[Completion]) -> dict[str, Any]:
        usage, _ = plan_usage(self.plan, [c.finish for c in done])
        return self.envelope(self.choices(done), chunk=False) | {"usage": usage}

    def usage_chunk(self, finishes: Sequence[FinishEvent | None]) -> dict[str, Any]:
        """A stream's last chunk when usage is asked for: no choices, the usage of all of them."""
        usage, _ = plan_usage(self.plan, finishes)
        return self.envelope([], chunk=True) | {"usage": usage}

    def events(self, index: int, event: Event) -> list[str]:
        return [sse_data(chunk, self.plan.include_usage) for chunk in self.chunks(index, event)]

    def closing(self, finishes: Sequence[FinishEvent | None]) -> list[str]:
        usage = [sse_data(self.usage_chunk(finishes))] if self.plan.include_usage else []
        return [*usage, DONE]

    def failure(self, error: HttpError) -> list[str]:
        return [sse_data(error.body()), DONE]

    def _first(self, index: int) -> bool:
        """Whether this is choice `index`'s first chunk; from now on it is not."""
        first, self._started[index] = not self._started[index], True
        return first


def _keepalives(
    events: AsyncIterator[tuple[int, Event]], quiet: float | None
) -> AsyncIterator[tuple[int, Event] | None]:
    """`events`, with a None each `quiet` seconds without one (none if `quiet` is None)."""
    return events if quiet is None else with_keepalives(events, quiet)


class Serving:
    """Runs a generation route's calls: a plan's requests, answered as its renderer says; `account` writes
    a call's record (its log line, metric and span)."""

    def __init__(self, state: ServingState, account: Callable[[CallRecord], None]) -> None:
        self._state = state
        self._account = account

    async def run(
        self, renderer: Renderer[Any], model: LoadedModel, request: Request, record: CallRecord
    ) -> Response:
        plan = renderer.plan
        if self._state.draining:  # the drain may have begun while the prompt was being tokenized
            raise Draining("the server is shutting down: retry on another replica")
        handles = submit_all(model, plan.requests)
        headers = {"X-Request-Id": record.request_id}
        if not plan.stream:
            tasks = [asyncio.ensure_future(complete(h)) for h in handles]
            await until_done(tasks, request, handles)
            completions = [t.result() for t in tasks]
            body = renderer.body(completions)
            _, record.finish = plan_usage(plan, [c.finish for c in completions])
            record.text = completions[0].text
            record.status = 200
            self._account(record)
            return JSONResponse(body, headers=headers)
        events = _keepalives(merged(handles), renderer.keepalive_seconds)
        opening = renderer.opening()
        if not opening:
            try:
                first = await first_event(events, request)  # None: keepalive_seconds without one
            except BaseException:
                for handle in handles:
                    handle.cancel()
                with contextlib.suppress(Exception):
                    await events.aclose()  # type: ignore[attr-defined]  # an async generator
                raise
            events = prepend(first, events)
        sse = self._sse(renderer, opening, events, handles, record)
        return StreamingResponse(sse, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})

    async def _sse(
        self,
        renderer: Renderer[Any],
        opening: list[str],
        events: AsyncIterator[tuple[int, Event] | None],
        handles: Sequence[RequestHandle],
        record: CallRecord,
    ) -> AsyncIterator[str]:
        """The stream, one write per engine event (all the route's events for it); None: a keepalive."""
        finishes: list[FinishEvent | None] = [None] * len(handles)
        record.status = 200
        try:
            if opening:
                yield "".join(opening)
            async for item in events:
                if item is None:
                    yield "".join(renderer.keepalive())
                    continue
                index, event = item
                if isinstance(event, FinishEvent):
                    finishes[index] = event
                sent = renderer.events(index, event)
                if sent:
                    yield "".join(sent)
            yield "".join(renderer.closing(finishes))
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: starlette cancels the stream
            record.code = "CANCELLED"
            raise
        except Exception as exc:  # after the response began: the route's failure events end the stream
            error = http_error(exc, record.request_id)
            record.code, record.error = error.code, error.message
            if error.code == "INTERNAL":
                log.error("request %s failed", record.request_id, exc_info=exc)
            yield "".join(renderer.failure(error))
        finally:
            for handle in handles:
                handle.cancel()  # frees the rows of a stream whose client went away; no effect once finished
            _, record.finish = plan_usage(renderer.plan, finishes)
            self._account(record)

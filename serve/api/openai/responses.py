"""/v1/responses' answers: OpenAI's `response` object, whole or as the Responses API's typed events.

The request is served as the chat it means (translate_responses.py `responses_plan`), and its text is read as
its tools say (serve/api/tool_calls.py `Reply`) into output items: a message of output_text (with its tokens'
logprobs when `include` asks for them), function_call items. A stream opens with response.created and
response.in_progress as soon as the request is submitted, before its first token; then each item in turn is
added (response.output_item.added), grows (response.output_text.delta, response.function_call_arguments.delta)
and is done (its .done events, response.output_item.done) before the next is added, as OpenAI streams them;
the last event is response.completed, response.incomplete or response.failed. The whole body is the same
output read from the whole text at once.

A response's id is its own (`resp_` and random hex): the client's X-Request-Id names the HTTP request (its
logs, its header), not the response, and two requests may send the same one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from serve.api.http.request_events import plan_usage
from serve.api.http.serving import Renderer, context_filled, finish_reason
from serve.api.http.vocabulary import Vocabulary
from serve.api.http_status import HttpError
from serve.api.openai.logprobs import chat_logprobs
from serve.api.openai.protocol import (
    FunctionCallOut,
    IncompleteDetails,
    ItemStatus,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    TokenLogprob,
)
from serve.api.openai.translate_responses import ResponsesPlan
from serve.api.reply_blocks import ApiEvent, Ended, ReplyBlocks
from serve.api.tool_calls import ToolPlan
from serve.engine.sampling import Alternatives
from serve.scheduling.request import Completion, Event, FinishEvent


@dataclass
class _Message:
    id: str
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens', when `include` asks for them
    sent: int = 0  # how many of them went out in deltas

    def item(self, status: ItemStatus) -> OutputMessage:
        """The item as response.output_item.added shows it (in_progress: no content yet), or with its text."""
        content = [] if status == "in_progress" else [self.part()]
        return {"type": "message", "id": self.id, "status": status, "role": "assistant", "content": content}

    def part(self) -> OutputText:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}


@dataclass
class _Call:
    call_id: str
    name: str
    arguments: str = ""

    @property
    def id(self) -> str:
        return f"fc_{self.call_id}"

    def item(self, status: ItemStatus) -> FunctionCallOut:
        """The item as response.output_item.added shows it (in_progress: no arguments yet), or with them."""
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": "" if status == "in_progress" else self.arguments,
            "status": status,
        }


class _Output(ReplyBlocks[_Message, _Call]):
    """A response's output items as its text comes (ReplyBlocks: an item's place is its output_index), and
    the events each piece of text makes (numbered when sent). The text is one message's, its item added at
    its first text; adding the next item ends the one before, completed."""

    def __init__(self, tools: ToolPlan) -> None:
        super().__init__(tools)
        self._message = _Message(f"msg_{uuid.uuid4().hex}")
        self._places: dict[str, int] = {}  # an item's id -> its output_index
        self._ended: dict[str, Ended] = {}  # the items done, by id -> how they ended

    def feed(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> list[ApiEvent]:
        """The events of this piece of text; `logprobs`: its tokens' (they are the message's: logprobs are
        served without tools, whose output is all message). Tokens of no text yet keep theirs for the next
        delta, or the done events."""
        self._message.logprobs += logprobs
        return super().feed(text)

    def finish(self, reason: str, status: Ended) -> list[ApiEvent]:
        """The events that end the output: what was held to the end (auto's content and calls), then the
        last item done with `status`."""
        events, _ = self._end(reason)
        if not self.blocks:  # an answer of nothing is an empty message
            events += self._begin(self._message)
        return events + self._close(status)

    def output(self, status: ItemStatus) -> list[OutputMessage | FunctionCallOut]:
        """The items: those done as they ended, the open one with `status`."""
        return [item.item(self._ended.get(item.id, status)) for item in self.blocks]

    def _text(self, text: str) -> list[ApiEvent]:
        message = self._message
        if not text:
            return []
        events = [] if message.id in self._places else self._begin(message)
        message.text += text
        delta = {
            "type": "response.output_text.delta",
            **self._where(message),
            "content_index": 0,
            "delta": text,
            "logprobs": message.logprobs[message.sent :],
        }
        message.sent = len(message.logprobs)
        return [*events, delta]

    def _call(self, call_id: str, name: str) -> _Call:
        return _Call(call_id, name)

    def _grown(self, call: _Call, piece: str) -> list[ApiEvent]:
        return [{"type": "response.function_call_arguments.delta", **self._where(call), "delta": piece}]

    def _opened(self, item: _Message | _Call) -> list[ApiEvent]:
        place = self._places[item.id] = len(self.blocks) - 1
        events: list[ApiEvent] = [
            {"type": "response.output_item.added", "output_index": place, "item": item.item("in_progress")}
        ]
        if isinstance(item, _Message):
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(item),
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                }
            )
        return events

    def _closed(self, item: _Message | _Call, ended: Ended) -> list[ApiEvent]:
        self._ended[item.id] = ended
        where = self._where(item)
        done = {
            "type": "response.output_item.done",
            "output_index": where["output_index"],
            "item": item.item(ended),
        }
        if isinstance(item, _Call):
            arguments = {
                "type": "response.function_call_arguments.done",
                **where,
                "name": item.name,
                "arguments": item.arguments,
            }
            return [arguments, done]
        text = {
            "type": "response.output_text.done",
            **where,
            "content_index": 0,
            "text": item.text,
            "logprobs": item.logprobs,
        }
        part = {"type": "response.content_part.done", **where, "content_index": 0, "part": item.part()}
        return [text, part, done]

    def _where(self, item: _Message | _Call) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self._places[item.id]}


class ResponsesRenderer(Renderer[ResponsesPlan]):
    prefix = "resp_"

    def __init__(self, plan: ResponsesPlan, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self.id = f"{self.prefix}{uuid.uuid4().hex}"  # the response's own: X-Request-Id names the request
        self._output = _Output(plan.tools)  # a stream's, as it goes
        self._sent = 0  # the next event's sequence_number

    def body(self, done: Sequence[Completion]) -> ResponseObject:
        (completion,) = done
        assert completion.finish is not None
        output = _Output(self.plan.tools)
        output.feed(
            completion.text,
            self._logprobs(completion.token_ids, completion.logprobs, completion.top_logprobs),
        )
        output.finish(finish_reason(completion.finish.finish_reason), self._status(completion.finish))
        return self._final(output, completion.finish)

    def opening(self) -> list[str]:
        response = self._response("in_progress", [])
        return self._sse(
            [
                {"type": "response.created", "response": response},
                {"type": "response.in_progress", "response": response},
            ]
        )

    def events(self, index: int, event: Event) -> list[str]:
        if isinstance(event, FinishEvent):
            reason = finish_reason(event.finish_reason)
            return self._sse(self._output.finish(reason, self._status(event)))
        logprobs = self._logprobs(event.token_ids, event.logprobs, event.top_logprobs)
        return self._sse(self._output.feed(event.text, logprobs))

    def closing(self, finishes: Sequence[FinishEvent | None]) -> list[str]:
        (finish,) = finishes
        assert finish is not None
        response = self._final(self._output, finish)
        return self._sse([{"type": f"response.{response['status']}", "response": response}])

    def failure(self, error: HttpError) -> list[str]:
        failed: ResponseError = {"code": error.type, "message": error.message}
        response = self._response("failed", self._output.output("incomplete"), error=failed)
        # The error beside the response too, in OpenAI's shape: the openai SDK raises an event that has one
        # (APIError, its message), as it does chat's error chunk, instead of ending without a response.
        return self._sse([{"type": "response.failed", "response": response, **error.body()}])

    def _sse(self, events: list[dict[str, Any]]) -> list[str]:
        out = []
        for event in events:
            data = {"type": event["type"], "sequence_number": self._sent, **event}
            self._sent += 1
            out.append(f"event: {event['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n")
        return out

    def _logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[Alternatives]
    ) -> list[TokenLogprob]:
        """The tokens' logprobs as output_text shows them, if `include` asks for them."""
        return chat_logprobs(self.vocab, token_ids, logprobs, tops) if self.plan.logprobs else []

    @staticmethod
    def _status(finish: FinishEvent) -> Ended:
        return "incomplete" if finish_reason(finish.finish_reason) == "length" else "completed"

    def _final(self, output: _Output, finish: FinishEvent) -> ResponseObject:
        status = self._status(finish)
        incomplete = self._incomplete(finish) if status == "incomplete" else None
        return self._response(status, output.output(status), incomplete, usage=self._usage(finish))

    def _incomplete(self, finish: FinishEvent) -> IncompleteDetails:
        """The context filled up before max_output_tokens (given, or the server's default, which the
        context shortens) was reached, or it was reached."""
        if context_filled(finish, self.plan.context_length, self.plan.request.max_output_tokens):
            return {"reason": "context_length"}
        return {"reason": "max_output_tokens"}

    def _usage(self, finish: FinishEvent) -> ResponseUsage:
        usage, _ = plan_usage(self.plan, [finish])
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        }

    def _response(
        self,
        status: ResponseStatus,
        output: list[OutputMessage | FunctionCallOut],
        incomplete: IncompleteDetails | None = None,
        error: ResponseError | None = None,
        usage: ResponseUsage | None = None,
    ) -> ResponseObject:
        """The response object: its state, and the request's fields echoed."""
        body = self.plan.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "incomplete_details": incomplete,
            "error": error,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,  # translate.py's default
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": body.text or {"format": {"type": "text"}},
            "previous_response_id": None,
            "store": False,
            "metadata": body.metadata or {},
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "usage": usage,
        }

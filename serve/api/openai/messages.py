"""/v1/messages' answers: Anthropic's `message` object, whole or as the Messages API's stream of events.

The request is served as the chat it means (translate.py `messages_plan`), and its text is read as its tools
say (serve/api/tool_calls.py `Reply`) into content blocks: text, and tool_use. A stream opens with
message_start and a ping as soon as the request is submitted, before its first token (and a ping each
keepalive_seconds it waits for the engine); then each block is
started (content_block_start), grows (content_block_delta: text_delta, input_json_delta) and is stopped
(content_block_stop), one at a time; message_delta carries the stop reason and the usage, message_stop ends
it. A failure after it began is an `error` event. The whole body is the same content read from the whole
text at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve.api.http_status import HttpError, anthropic_error
from serve.api.openai.logprobs import Vocabulary
from serve.api.openai.messages_protocol import MessageObject, MessagesUsage, StopReason, TextOut, ToolUseOut
from serve.api.openai.request_events import plan_usage
from serve.api.openai.serving import Renderer, finish_reason
from serve.api.openai.translate import ChatPlan
from serve.api.tool_calls import Reply, ToolPlan
from serve.scheduling.request import Completion, Event, FinishEvent

# Reply's finish reasons (OpenAI's) as Anthropic's stop reasons; a stop string is told apart by its finish.
STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
Block = TextOut | ToolUseOut
Stop = tuple[StopReason, str | None]  # the stop reason and stop sequence


@dataclass
class _Text:
    text: str = ""

    def block(self, whole: bool) -> TextOut:
        return {"type": "text", "text": self.text if whole else ""}


@dataclass
class _ToolUse:
    id: str
    name: str
    arguments: str = ""  # JSON text, as it streams

    def block(self, whole: bool) -> ToolUseOut:
        """The block as content_block_start shows it (an empty input), or with its input."""
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": self._input() if whole else {}}

    def _input(self) -> dict[str, Any]:
        """The arguments as an object; arguments cut short (max_tokens) are no object: empty then."""
        try:
            value = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class _Content:
    """A message's content blocks as its text comes, in the order they begin (a block's place is its
    index), at most one open at a time, and the events (type, data) each piece of text makes."""

    def __init__(self, tools: ToolPlan) -> None:
        self._reply = Reply(tools)
        self._calls: dict[int, _ToolUse] = {}  # by the call's index in the reply
        self._open = False  # the last block has not been stopped
        self.blocks: list[_Text | _ToolUse] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        content, pieces = self._reply.read(text)
        events = self._text(content)
        for piece in pieces:
            if piece.name is not None:
                assert piece.id is not None  # a call's first piece names it
                self._calls[piece.index] = _ToolUse(piece.id, piece.name)
                events += self._start(self._calls[piece.index])
            events += self._arguments(self._calls[piece.index], piece.arguments)
        return events

    def finish(self, reason: str) -> tuple[list[dict[str, Any]], str]:
        """The events that end the content (what was held to the end: auto's text and calls, then the last
        block stopped) and Reply's finish reason."""
        content, calls, reason = self._reply.end(reason)
        events = self._text(content)
        for index, whole in enumerate(calls):
            if index not in self._calls:  # auto's calls are read at the end
                call = self._calls[index] = _ToolUse(whole.id, whole.name)
                events += self._start(call) + self._arguments(call, whole.arguments)
        return events + self._stop(), reason

    def content(self) -> list[Block]:
        return [block.block(whole=True) for block in self.blocks]

    def _text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        last = self.blocks[-1] if self._open else None
        events = []
        if not isinstance(last, _Text):
            last = _Text()
            events = self._start(last)
        last.text += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _arguments(self, call: _ToolUse, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        call.arguments += piece
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    def _start(self, block: _Text | _ToolUse) -> list[dict[str, Any]]:
        events = self._stop()
        self.blocks.append(block)
        self._open = True
        index = len(self.blocks) - 1
        start = {"type": "content_block_start", "index": index, "content_block": block.block(whole=False)}
        return [*events, start]

    def _stop(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


class MessagesRenderer(Renderer[ChatPlan]):
    prefix = "msg_"
    keepalive_seconds = 10.0

    def __init__(self, plan: ChatPlan, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self._content = _Content(plan.tools)  # a stream's, as it goes
        self._stop: Stop | None = None  # a stream's, once it finished

    def body(self, done: Sequence[Completion]) -> MessageObject:
        (completion,) = done
        assert completion.finish is not None
        content = _Content(self.plan.tools)
        content.feed(completion.text)
        _, reason = content.finish(finish_reason(completion.finish.finish_reason))
        stop = self._stop_reason(reason, completion.finish)
        return self._message(content.content(), stop, self._usage(completion.finish))

    def opening(self) -> list[str]:
        prompt = len(self.plan.prompts[0].ids)
        usage: MessagesUsage = {"input_tokens": prompt, "output_tokens": 0, "cache_read_input_tokens": 0}
        start = {"type": "message_start", "message": self._message([], None, usage)}
        return self._sse([start, {"type": "ping"}])

    def events(self, index: int, event: Event) -> list[str]:
        if isinstance(event, FinishEvent):
            events, reason = self._content.finish(finish_reason(event.finish_reason))
            self._stop = self._stop_reason(reason, event)
            return self._sse(events)
        return self._sse(self._content.feed(event.text))

    def closing(self, finishes: Sequence[FinishEvent | None]) -> list[str]:
        (finish,) = finishes
        assert finish is not None and self._stop is not None
        reason, sequence = self._stop
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return self._sse(
            [
                {"type": "message_delta", "delta": delta, "usage": self._usage(finish)},
                {"type": "message_stop"},
            ]
        )

    def failure(self, error: HttpError) -> list[str]:
        _, body = anthropic_error(error)
        return self._sse([body])

    def keepalive(self) -> list[str]:
        return self._sse([{"type": "ping"}])

    @staticmethod
    def _sse(events: list[dict[str, Any]]) -> list[str]:
        """Anthropic's server-sent events: each names its type in an `event:` line too."""
        return [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]

    @staticmethod
    def _stop_reason(reason: str, finish: FinishEvent) -> Stop:
        """Anthropic's stop reason and stop sequence, from Reply's reason and the finish."""
        if reason == "stop" and finish.stop_string is not None:
            return "stop_sequence", finish.stop_string
        return STOP_REASONS[reason], None

    def _usage(self, finish: FinishEvent) -> MessagesUsage:
        usage, _ = plan_usage(self.plan, [finish])
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached,
        }

    def _message(self, content: list[Block], stop: Stop | None, usage: MessagesUsage) -> MessageObject:
        reason, sequence = stop if stop is not None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

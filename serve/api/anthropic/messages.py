"""/v1/messages' answers: Anthropic's `message` object, whole or as the Messages API's stream of events.

The request is served as the chat it means (translate.py `messages_plan`), and its text is read as its tools
say (serve/api/tool_calls.py `Reply`) into content blocks: text, and tool_use (whitespace alone makes no text
block beside a tool_use). A stream opens with message_start and a ping at its first event, so that what
fails before it (a constraint llguidance rejects, a failed prefill) gets its HTTP status; a request that
waits keepalive_seconds for the engine opens it then, and is pinged each keepalive_seconds it waits on.
Then each block is started (content_block_start), grows (content_block_delta: text_delta, input_json_delta)
and is stopped (content_block_stop), one at a time; message_delta carries the stop reason and the usage,
message_stop ends it. A failure after it began is an `error` event. The whole body is the same content read
from the whole text at once.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve.api.anthropic.protocol import MessageObject, MessagesUsage, StopReason, TextOut, ToolUseOut
from serve.api.anthropic.translate import MessagesPlan
from serve.api.http.serving import Renderer, context_filled, finish_reason
from serve.api.http.vocabulary import Vocabulary
from serve.api.http_status import HttpError, anthropic_error
from serve.api.reply_blocks import ApiEvent, Ended, ReplyBlocks
from serve.api.tool_calls import ToolPlan
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


def _tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call (`toolu_...`), from the chat's (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


class _Content(ReplyBlocks[_Text, _ToolUse]):
    """A message's content blocks as its text comes (ReplyBlocks), and the events (type, data) each piece
    of text makes.

    Whitespace alone opens no text block: it is held until text follows, and dropped if a tool_use comes
    first or the message ends with blocks (a model writes a newline before its call); a message of nothing
    but whitespace keeps it."""

    def __init__(self, tools: ToolPlan) -> None:
        super().__init__(tools)
        self._blank = ""  # whitespace held until a text block begins

    def finish(self, reason: str) -> tuple[list[ApiEvent], str]:
        """The events that end the content (what was held to the end: auto's text and calls, then the last
        block stopped) and Reply's finish reason."""
        events, reason = self._end(reason)
        blank, self._blank = self._blank, ""
        if blank and not self.blocks:
            events += self._text(blank, blank=True)
        return events + self._close("completed"), reason

    def content(self) -> list[Block]:
        return [block.block(whole=True) for block in self.blocks]

    def _text(self, text: str, blank: bool = False) -> list[ApiEvent]:
        """The events of more text: a text block's delta, the block started first unless one is open."""
        if not text:
            return []
        last = self.blocks[-1] if self._is_open else None
        events = []
        if not isinstance(last, _Text):
            text, self._blank = self._blank + text, ""
            if not text.strip() and not blank:
                self._blank = text
                return []
            last = _Text()
            events = self._begin(last)
        last.text += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _call(self, call_id: str, name: str) -> _ToolUse:
        return _ToolUse(_tool_use_id(call_id), name)

    def _opened(self, block: _Text | _ToolUse) -> list[ApiEvent]:
        self._blank = ""
        index = len(self.blocks) - 1
        return [{"type": "content_block_start", "index": index, "content_block": block.block(whole=False)}]

    def _closed(self, block: _Text | _ToolUse, ended: Ended) -> list[ApiEvent]:
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _grown(self, call: _ToolUse, piece: str) -> list[ApiEvent]:
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    def _delta(self, delta: dict[str, Any]) -> ApiEvent:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


class MessagesRenderer(Renderer[MessagesPlan]):
    prefix = "msg_"
    keepalive_seconds = 10.0

    def __init__(self, plan: MessagesPlan, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self._content = _Content(plan.tools)  # a stream's, as it goes
        self._stop: Stop | None = None  # a stream's, once it finished
        self._input: MessagesUsage | None = None  # a stream's usage as message_start told it

    def body(self, done: Sequence[Completion]) -> MessageObject:
        (completion,) = done
        finish = completion.finish
        assert finish is not None
        content = _Content(self.plan.tools)
        content.feed(completion.text)
        _, reason = content.finish(finish_reason(finish.finish_reason))
        usage = self._usage(finish.cached_prompt_tokens, finish.completion_tokens)
        return self._message(content.content(), self._stop_reason(reason, finish), usage)

    def events(self, index: int, event: Event) -> list[str]:
        start = self._start(event.cached_prompt_tokens)
        if isinstance(event, FinishEvent):
            events, reason = self._content.finish(finish_reason(event.finish_reason))
            self._stop = self._stop_reason(reason, event)
            return start + self._sse(events)
        return start + self._sse(self._content.feed(event.text))

    def closing(self, finishes: Sequence[FinishEvent | None]) -> list[str]:
        (finish,) = finishes
        assert finish is not None and self._stop is not None and self._input is not None
        reason, sequence = self._stop
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        usage = {**self._input, "output_tokens": finish.completion_tokens}  # the input counts as told
        return self._sse(
            [
                {"type": "message_delta", "delta": delta, "usage": usage},
                {"type": "message_stop"},
            ]
        )

    def failure(self, error: HttpError) -> list[str]:
        _, body = anthropic_error(error)
        return self._sse([body])

    def keepalive(self) -> list[str]:
        """A ping; the stream's start if it has not begun (its request waits for the engine)."""
        return self._start(None) or self._sse([{"type": "ping"}])

    def _start(self, cached: int | None) -> list[str]:
        """message_start and a ping, unless sent already. Its usage splits the prompt as the first event
        tells (`cached`: its tokens read from the prefix cache); one sent before the first event counts the
        whole prompt as input. message_delta repeats the same input counts."""
        if self._input is not None:
            return []
        self._input = self._usage(cached or 0, 0)
        start = {"type": "message_start", "message": self._message([], None, self._input)}
        return self._sse([start, {"type": "ping"}])

    @staticmethod
    def _sse(events: list[dict[str, Any]]) -> list[str]:
        """Anthropic's server-sent events: each names its type in an `event:` line too."""
        return [f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]

    def _stop_reason(self, reason: str, finish: FinishEvent) -> Stop:
        """Anthropic's stop reason and stop sequence, from Reply's reason and the finish."""
        if reason == "stop" and finish.stop_string is not None:
            return "stop_sequence", finish.stop_string
        if reason == "length" and context_filled(finish, self.plan.context_length, self.plan.max_tokens):
            return "model_context_window_exceeded", None
        return STOP_REASONS[reason], None

    def _usage(self, cached: int, output: int) -> MessagesUsage:
        """Anthropic's usage: `input_tokens` are the prompt's tokens computed, not read from the prefix cache
        (which is written as it goes: no cache_creation_input_tokens)."""
        prompt = len(self.plan.prompts[0].ids)
        return {
            "input_tokens": prompt - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output,
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

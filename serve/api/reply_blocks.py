"""A reply's blocks as its text comes: the state machine the Responses and Messages renderers share.

A reply (serve/api/tool_calls.py `Reply`) gives, piece by piece, text and the pieces of tool calls as its
request's tools read them. OpenAI's Responses API shows them as output items, Anthropic's Messages API as
content blocks: either way a list of blocks that begin in the order their text comes, one open at a time, the
one before closed when the next begins. `ReplyBlocks` keeps that order and that one open block, makes a
block of each call (from its first piece, or at the end for the calls `auto` reads from the whole text) and
grows it with its arguments; a renderer's subclass says where text goes and which events a block's start,
growth and end make.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Literal, Protocol, TypeVar

from serve.api.tool_calls import Reply, ToolPlan

ApiEvent = dict[str, Any]  # one stream event, as the API's JSON has it
Ended = Literal["completed", "incomplete"]  # how a closed block ended


class CallBlock(Protocol):
    arguments: str  # the call's JSON arguments, as they stream


T = TypeVar("T")  # the text block's type
C = TypeVar("C", bound=CallBlock)  # a call block's type


class ReplyBlocks(ABC, Generic[T, C]):
    """A reply's blocks as its text comes, in the order they begin (a block's place is its index in
    `blocks`), at most one open at a time, and the events each piece of text makes."""

    def __init__(self, tools: ToolPlan) -> None:
        self._reply = Reply(tools)
        self._calls: dict[int, C] = {}  # by the call's index in the reply
        self._is_open = False  # the last block has not been closed
        self.blocks: list[T | C] = []

    def feed(self, text: str) -> list[ApiEvent]:
        """The events of this piece of text: its content's, then its calls' pieces'."""
        content, pieces = self._reply.read(text)
        events = self._text(content)
        for piece in pieces:
            if piece.name is not None:
                assert piece.id is not None  # a call's first piece names it
                self._calls[piece.index] = self._call(piece.id, piece.name)
                events += self._begin(self._calls[piece.index])
            events += self._arguments(self._calls[piece.index], piece.arguments)
        return events

    def _end(self, reason: str) -> tuple[list[ApiEvent], str]:
        """The events of what the reply held to the end (auto's content and calls; the last block stays
        open) and Reply's finish reason."""
        content, calls, reason = self._reply.end(reason)
        events = self._text(content)
        for index, whole in enumerate(calls):
            if index not in self._calls:  # auto's calls are read at the end
                call = self._calls[index] = self._call(whole.id, whole.name)
                events += self._begin(call) + self._arguments(call, whole.arguments)
        return events, reason

    def _begin(self, block: T | C) -> list[ApiEvent]:
        """The events that open `block`: blocks do not overlap, so the open one is closed first, completed."""
        events = self._close("completed")
        self.blocks.append(block)
        self._is_open = True
        return events + self._opened(block)

    def _close(self, ended: Ended) -> list[ApiEvent]:
        """The events that close the open block (none if no block is open)."""
        if not self._is_open:
            return []
        self._is_open = False
        return self._closed(self.blocks[-1], ended)

    def _arguments(self, call: C, piece: str) -> list[ApiEvent]:
        if not piece:
            return []
        call.arguments += piece
        return self._grown(call, piece)

    @abstractmethod
    def _text(self, text: str) -> list[ApiEvent]:
        """The events of more content text (none for ""): it grows a text block, opened if need be."""

    @abstractmethod
    def _call(self, call_id: str, name: str) -> C:
        """A new call's block, from the reply's id of it (`call_...`) and its function's name."""

    @abstractmethod
    def _opened(self, block: T | C) -> list[ApiEvent]:
        """The events that say `block` (now the last) begins."""

    @abstractmethod
    def _closed(self, block: T | C, ended: Ended) -> list[ApiEvent]:
        """The events that say `block` is done, as `ended` says."""

    @abstractmethod
    def _grown(self, call: C, piece: str) -> list[ApiEvent]:
        """The events of a piece of a call's arguments (already added to it)."""

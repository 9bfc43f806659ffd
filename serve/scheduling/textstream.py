"""Incremental detokenization of one sequence, with stop strings.

Byte-level BPE splits characters across tokens, so decoding one token at a time would emit half a character
as U+FFFD. The prefix/read-offset technique (as in TGI) decodes a short window of recent tokens instead: the
tokens already emitted (for context) plus the unread ones, and emits the new suffix only once it does not end
in U+FFFD. The window is dropped up to the previous read offset on every emission, so a step costs O(window),
not O(text).

Stop strings are matched on the decoded text, across token boundaries: text that could still be the start of
a stop string is held back until the next tokens settle it, and everything after a matched stop string is
never returned; the stop string itself neither, unless `include_stop` (vLLM's `include_stop_str_in_output`).
The match is the stop string that starts earliest (the shortest of those starting there). With `min_tokens`
N (vLLM's `min_tokens`), stop strings are looked for only from the N-th token on: the text of earlier tokens
goes out as it comes, so a match must lie wholly in the text of tokens N, N + 1, ...

Text that nobody reads before the end (`incremental=False`: a unary call or the offline API, without stop
strings) is decoded once, at the end: the tokenizer's decode of all the tokens, which is what the increments
add up to, for one decode call per sequence instead of two per token (the demo model offline at batch 16:
+10%, median of 6 alternated rounds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"
# A character waiting for its last bytes spans at most 3 more tokens; a window that still ends in U+FFFD after
# this many unread tokens holds invalid bytes that no later token will complete, so it is emitted as decoded
# rather than held (and re-decoded) forever.
MAX_UNREAD_TOKENS = 16


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text newly released by one token, and whether a stop string ended the sequence."""

    text: str
    stopped: bool


_NOTHING = TextDelta("", stopped=False)


class TextStream:
    """Turns one sequence's tokens, pushed one at a time, into text deltas safe to stream."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        incremental: bool = True,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not one string")
        if not all(stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.get_vocab_size()
        self._stop = tuple(stop)
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._pushed = 0
        # Stop strings are matched on text as it comes, so they need the increments whoever reads them.
        self._deferred = not incremental and not self._stop
        self._window: list[int] = []  # tokens from the prefix offset on (deferred: all tokens)
        self._read = 0  # index in the window of the first token whose text is not yet out
        self._prefix_text = ""  # the window's tokens before the read offset, decoded
        self._held = ""  # decoded text that could begin a stop string
        self._emitted: list[str] = []
        self._matched: str | None = None  # the stop string that ended the sequence
        self._flushed = False

    @property
    def text(self) -> str:
        """All text released so far (deltas and flush)."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        """True once a stop string matched."""
        return self._matched is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that matched (None while none has)."""
        return self._matched

    def push(self, token_id: int) -> TextDelta:
        """Add the next token; returns the text it releases (possibly empty)."""
        if self._flushed:
            raise RuntimeError("push() after flush(): the stream is finished")
        if self.stopped:
            return TextDelta("", True)
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(
                f"token id {token_id} is outside the vocabulary: allowed 0..{self._vocab_size - 1}"
            )
        self._window.append(token_id)
        self._pushed += 1
        if self._deferred:
            return _NOTHING
        return self._release(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """End of sequence: release what was held back (an incomplete character is emitted as U+FFFD)."""
        if self._flushed or self.stopped:
            self._flushed = True
            return ""
        self._flushed = True
        if self._deferred:
            return self._emit(self._tokenizer.decode(self._window), stopped=False).text
        return self._release(self._decode_new(final=True), final=True).text

    def _decode_new(self, final: bool) -> str:
        """Text of the unread tokens, once it is complete UTF-8 (or at the end); advances the offsets."""
        if self._read == len(self._window):
            return ""
        text = self._tokenizer.decode(self._window)
        # Shorter than the prefix: these bytes rewrite the end of an already emitted U+FFFD.
        unsettled = text.endswith(REPLACEMENT) or len(text) < len(self._prefix_text)
        if unsettled and not final and len(self._window) - self._read < MAX_UNREAD_TOKENS:
            return ""
        # Empty when the tokens decode to nothing (special tokens): they are read all the same, so that
        # a run of them cannot grow the window.
        new = text[len(self._prefix_text) :]
        # The tokens just read become the next prefix: enough context for the next token's text.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._tokenizer.decode(self._window)
        return new

    def _release(self, new: str, final: bool) -> TextDelta:
        """Split held + new text into what goes out now and what may still begin a stop string."""
        # Nothing is held back without stop strings (this runs for every token of every request) or before
        # they apply.
        if not self._stop or self._pushed < self._min_tokens:
            return self._emit(new, stopped=False)
        buffer = self._held + new
        match = self._first_stop(buffer)
        if match is not None:
            cut, stop = match
            self._matched = stop
            self._held = ""
            return self._emit(buffer[: cut + len(stop) if self._include_stop else cut], stopped=True)
        keep = 0 if final else self._stop_prefix_length(buffer)
        self._held = buffer[len(buffer) - keep :]
        return self._emit(buffer[: len(buffer) - keep], stopped=False)

    def _emit(self, text: str, stopped: bool) -> TextDelta:
        if text:
            self._emitted.append(text)
        return TextDelta(text, stopped)

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """The stop string that starts earliest in `buffer` (the shortest of those), and where it starts."""
        found = [(i, len(stop), stop) for stop in self._stop if (i := buffer.find(stop)) >= 0]
        if not found:
            return None
        start, _, stop = min(found)
        return start, stop

    def _stop_prefix_length(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that is the beginning of a stop string."""
        longest = 0
        for stop in self._stop:
            start = buffer.find(stop[0], max(0, len(buffer) - len(stop) + 1))
            while start != -1:
                if stop.startswith(buffer[start:]):
                    longest = max(longest, len(buffer) - start)
                    break  # the first start is the longest for this stop
                start = buffer.find(stop[0], start + 1)
        return longest

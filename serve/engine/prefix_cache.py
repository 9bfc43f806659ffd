"""Which finished sequences' keys and values the engine keeps, and which one a new prompt can start from.

The engine's KV buffers have a few rows beyond the running batch's. When a sequence leaves, the engine may
copy its prompt's keys and values there (`store` says where); a later prompt that begins with the same
tokens (a shared system prompt, the next turn of a chat: prompt + answer + new message) copies that row into
its own and prefills only the rest (`match`). A sequence still running is as good a source: a burst of
prompts sharing a system prompt reuses the first one's row as soon as it runs. This module holds only the
bookkeeping: which token ids each kept row holds, and which row to give up (least recently stored or
matched). It never touches the buffers.

A reused prefix must hold the keys and values a prefill of the whole prompt would compute, bit for bit, so
that a request's tokens and logprobs do not depend on what ran before it. A decode step computes a position
otherwise (`MIN_PIECE` in serve/engine/types.py says how), so the engine offers only prompt positions (never
generated ones), and a prompt always prefills at least its last `MIN_PIECE` tokens itself.

A row is worth keeping or reusing only from `min_tokens` tokens up: copying a row costs about as much as
prefilling a few tokens, and a reused prefix is prefilled alone rather than with the rest of its group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from serve.engine.types import MIN_PIECE


@dataclass
class _Kept:
    row: int  # the engine's KV row that holds it
    tokens: np.ndarray  # int64 token ids whose keys and values fill the row's first len(tokens) positions
    used: int  # the cache's clock when last stored or matched
    head: bytes = b""  # its first min_tokens token ids: a prompt can reuse the row only if it starts so
    adapter: int = 0  # the LoRA slot its keys and values were computed with (0: none)


class PrefixHit(NamedTuple):
    """A row to copy a prompt's prefix from, and how many of the prompt's tokens it gives."""

    row: int
    tokens: int


class PrefixCache:
    def __init__(self, rows: Sequence[int], min_tokens: int) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.rows = tuple(rows)
        self.min_tokens = min_tokens
        self._kept: list[_Kept] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._kept)

    def match(
        self, prompt_ids: Sequence[int], running: Sequence[tuple[int, np.ndarray]] = (), adapter: int = 0
    ) -> PrefixHit | None:
        """The row sharing the longest prefix with `prompt_ids`, and how many of its tokens the prompt can
        reuse (its last `MIN_PIECE` tokens are always left to prefill), or None when no row offers
        `min_tokens` (or the cache has no rows: prefix caching is off). The rows are the kept ones and
        `running`: (row, token ids of its prompt's positions) of sequences still running, whose prompt
        positions are as good a source. Only rows computed with the prompt's `adapter` (a LoRA slot) match:
        another adapter's keys and values differ. Pure: `use` marks a kept row as used."""
        if not self.rows or not (self._kept or running):
            return None
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        head = prompt[: self.min_tokens].tobytes()
        kept = ((k.row, k.tokens) for k in self._kept if k.head == head and k.adapter == adapter)
        best: PrefixHit | None = None
        for row, tokens in [*kept, *running]:
            reusable = min(_common_prefix(tokens, prompt), len(prompt) - MIN_PIECE)
            if reusable >= self.min_tokens and (best is None or reusable > best.tokens):
                best = PrefixHit(row, reusable)
        return best

    def use(self, row: int) -> None:
        for kept in self._kept:
            if kept.row == row:
                kept.used = self._tick()

    def store(self, tokens: np.ndarray, adapter: int = 0) -> int | None:
        """The row to copy a leaving sequence into, which then holds `tokens`; None: it is not worth a copy
        (too short, or a kept row already holds these tokens and more). Replaces a kept row that `tokens`
        extend (the previous turn of the same chat), else takes a free row, else the least recently used."""
        if not self.rows or len(tokens) < self.min_tokens:
            return None
        extended: list[_Kept] = []
        for kept in self._kept:
            if kept.adapter != adapter:
                continue
            shared = _common_prefix(kept.tokens, tokens)
            if shared == len(tokens):  # already kept, in full
                kept.used = self._tick()
                return None
            if shared == len(kept.tokens):
                extended.append(kept)
        if extended:  # all of them hold less than `tokens` will: one row takes it, the others are free
            target, dropped = extended[0], {id(kept) for kept in extended[1:]}
            self._kept = [kept for kept in self._kept if id(kept) not in dropped]
        else:
            taken = {kept.row for kept in self._kept}
            free = [row for row in self.rows if row not in taken]
            if free:
                target = _Kept(free[0], tokens, 0, adapter=adapter)
                self._kept.append(target)
            else:
                target = min(self._kept, key=lambda kept: kept.used)
        target.adapter = adapter
        target.tokens = np.array(tokens, dtype=np.int64)
        target.head = target.tokens[: self.min_tokens].tobytes()
        target.used = self._tick()
        return target.row

    def forget(self, adapter: int) -> None:
        """Forget the rows computed with `adapter` (its slot now holds another)."""
        self._kept = [kept for kept in self._kept if kept.adapter != adapter]

    def clear(self) -> None:
        """Forget every kept row (their contents can no longer be trusted)."""
        self._kept.clear()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n

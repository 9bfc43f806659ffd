"""Speculative decoding's proposals: from the sequence's own text (prompt lookup) or from a draft model.

A decode step on a CPU is bound by reading the weights, so scoring a few positions of one sequence in one run
costs little more than scoring one. A proposer guesses the next tokens; the engine scores the pending token
and the guess in one run and keeps the guessed tokens the model itself picks (serve/engine/step.py,
`_speculate`).
- `PromptLookup` (n-gram speculation: vLLM's `ngram`, llama-server's `--spec-ngram`) proposes, after the
  longest recent n-gram of the sequence that occurred before in its prompt or output, the tokens that
  followed it then.
- `DraftModel` (vLLM's and llama-server's draft model) proposes a smaller model's greedy continuation.

Why nothing changes in what a request gets: position j's token is sampled from the logits of that position
exactly as a plain decode step would sample it (same processors, same random stream, one draw per token), and
a proposed token counts only when it equals that sample. A proposal is a guess of what sampling will pick; it
never replaces it. For a proposer that is deterministic, as both are, this is the standard rejection-sampling
rule (accept with probability min(1, p/q), q being 1 on the proposed token) and keeps the target's
distribution. A wrong guess costs the extra positions of that one run, which `Pace` keeps few on text that
does not repeat itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class Proposer(Protocol):
    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        """Up to `k` token ids to follow `context` (the sequence so far, its pending token last)."""
        ...


@dataclass(frozen=True)
class PromptLookup:
    ngram_min: int
    ngram_max: int

    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        return propose(context, self.ngram_min, self.ngram_max, k)


class GreedyModel(Protocol):
    def greedy_next(self, ids: Sequence[int], start: int) -> int:
        """Append ids[start:] to the one row, whose cache holds ids[:start]; the argmax token after them."""
        ...


class DraftModel:
    """A smaller model's greedy continuation, from an engine of its own whose one row stays resident: the
    row keeps the tokens it was fed, and each proposal rolls it back to the longest prefix they share with
    the sequence (as the target's row drops the rejected tokens past its length), then feeds only the rest:
    what the sequence gained since the last proposal, then each proposed token but the last."""

    def __init__(self, engine: GreedyModel) -> None:
        self.engine = engine
        self._fed: list[int] = []  # the tokens in the draft's row

    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        if k <= 0:
            return context[:0]
        ids = context.tolist()
        start = min(shared_prefix(self._fed, ids), len(ids) - 1)  # at least one token runs: its logits
        self._fed = []  # until the runs below succeed, the row holds nothing to trust
        tokens = [self.engine.greedy_next(ids, start)]
        while len(tokens) < k:
            ids.append(tokens[-1])
            tokens.append(self.engine.greedy_next(ids, len(ids) - 1))
        self._fed = ids
        return np.array(tokens, np.int64)


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def propose(context: np.ndarray, ngram_min: int, ngram_max: int, k: int) -> np.ndarray:
    """Up to `k` token ids that followed the most recent earlier occurrence of the longest suffix n-gram of
    `context` (n from `ngram_max` down to `ngram_min`); empty when no such n-gram occurred before."""
    length = len(context)
    if k <= 0:
        return context[:0]
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = context[length - n :]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence with at least one token after it.
        windows = np.lib.stride_tricks.sliding_window_view(context[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent occurrence: nearest text repeats most reliably
            return context[start : start + k]
    return context[:0]


@dataclass
class Pace:
    """How much a row proposes, and when, from how its proposals fared (as transformers' assisted generation
    adapts its number of assistant tokens): a proposal wholly accepted lets the next be 2 tokens longer, up to
    the row's limit; one cut short makes the next 1 token shorter, down to 1. After a proposal wholly rejected
    the row waits 1, then 2, 4, ... up to `longest` steps before proposing again; any accepted token ends the
    wait. A rejected position costs a share of a step, so on text that does not repeat itself (where lookups
    still find short n-grams by chance) the row pays for a few short proposals, not a long one per step."""

    limit: int  # the most tokens a proposal may have
    longest: int = 16
    tokens: int = 0  # the next proposal's length (set to `limit` at first)
    wait: int = 0  # steps left before the next proposal
    next_wait: int = 1

    def __post_init__(self) -> None:
        self.tokens = self.tokens or self.limit

    def ready(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return False
        return True

    def record(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.tokens = min(self.tokens + 2, self.limit)
        else:
            self.tokens = max(self.tokens - 1, 1)
        if accepted > 0:
            self.next_wait = 1
            return
        self.wait = self.next_wait
        self.next_wait = min(self.next_wait * 2, self.longest)

"""A small deterministic engine that honours serve.engine.Engine's interface, for scheduling tests.

Each sequence's next token is a pure function of its own context (so any batching gives the same tokens),
drawn from the ids of single ASCII letters so that text is easy to reason about. Tests can slow steps down,
hold them on a gate, or make the next prefill/decode raise.
"""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer

from export.tokenizer import EOS_ID, train_tokenizer
from serve.engine import NewSequence, TokenOut

LETTERS = string.ascii_lowercase[:12]


def letter_tokenizer() -> Tokenizer:
    return train_tokenizer([LETTERS * 3, "the quick brown fox"], vocab_size=300)


class FakeEngine:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_batch_size: int = 4,
        capacity: int = 64,
        eos_after: int | None = None,
        step_seconds: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.capacity = capacity
        self.context_length = capacity
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token_id = EOS_ID
        self.eos_after = eos_after  # emit EOS as this many-th generated token
        self.step_seconds = step_seconds
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: set[str] = set()
        self.calls: list[tuple[str, list[str]]] = []  # (phase, the rows it ran on), in call order
        self._alphabet = [tokenizer.token_to_id(c) for c in LETTERS]
        self._ids: list[str] = []
        self._context: dict[str, list[int]] = {}
        self._generated: dict[str, int] = {}

    @property
    def batch_size(self) -> int:
        return len(self._ids)

    @property
    def running_ids(self) -> list[str]:
        return list(self._ids)

    def kv_shape(self) -> tuple[int, ...]:
        return (len(self._ids), 2, self.capacity, 4)

    def next_token(self, context: Sequence[int], generated: int) -> int:
        if self.eos_after is not None and generated + 1 == self.eos_after:
            return self.eos_token_id
        return self._alphabet[(sum(context) * 31 + len(context)) % len(self._alphabet)]

    def prefill(self, new: Sequence[NewSequence]) -> list[TokenOut]:
        self._enter("prefill", [s.seq_id for s in new])
        if len(self._ids) + len(new) > self.max_batch_size:
            raise ValueError("more rows than KV slots")
        for seq in new:
            if not 1 <= len(seq.prompt_ids) < self.capacity or seq.seq_id in self._context:
                raise ValueError(f"bad sequence {seq.seq_id}")
            self._ids.append(seq.seq_id)
            self._context[seq.seq_id] = list(seq.prompt_ids)
            self._generated[seq.seq_id] = 0
        return [self._sample(s.seq_id) for s in new]

    def decode(self) -> list[TokenOut]:
        self._enter("decode", list(self._ids))
        if not self._ids:
            raise RuntimeError("decode() with no running sequence")
        for seq_id in self._ids:
            if len(self._context[seq_id]) >= self.capacity:
                raise ValueError(f"{seq_id} overflowed its KV slot")
        return [self._sample(seq_id) for seq_id in self._ids]

    def release(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self._context:
                row = self._ids.index(seq_id)
                self._ids[row] = self._ids[-1]
                self._ids.pop()
                del self._context[seq_id], self._generated[seq_id]

    def expected(self, prompt: Sequence[int], n: int) -> list[int]:
        """The tokens a sequence gets alone (EOS included, as the engine emits them)."""
        context, out = list(prompt), []
        for generated in range(n):
            token = self.next_token(context, generated)
            out.append(token)
            context.append(token)
        return out

    def _enter(self, phase: str, rows: list[str]) -> None:
        self.calls.append((phase, rows))
        if not self.gate.wait(10):
            raise TimeoutError("test gate never opened")
        time.sleep(self.step_seconds)
        if phase in self.fail_next:
            self.fail_next.discard(phase)
            raise RuntimeError(f"injected {phase} failure")

    def _sample(self, seq_id: str) -> TokenOut:
        # Feeding the previous token into the "cache" happens lazily: the context holds all sampled tokens.
        token = self.next_token(self._context[seq_id], self._generated[seq_id])
        self._context[seq_id].append(token)
        self._generated[seq_id] += 1
        return TokenOut(seq_id, token, -0.5)

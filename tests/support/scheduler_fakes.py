"""Engines for scheduling tests: a small deterministic fake, and test controls around any engine.

`FakeEngine` honours the engine's interface (BatchEngine, the planner's EngineView with it); each sequence's
next token is a pure function of its own context (so any batching gives the same tokens), drawn from the ids
of single ASCII letters so that text is easy to reason about; it can speculate (`speculation`), giving each
sequence several tokens a decode step. `Instrumented` wraps a fake or a real engine:
it can slow steps down, hold them on a gate, make the next prefill/decode raise, and logs every call with the
rows it ran on. `hold_compiles` keeps requests' constraints compiling until a test lets them go.
"""

from __future__ import annotations

import string
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pytest
from tokenizers import Tokenizer

from export.tokenizer import EOS_ID, train_tokenizer
from serve.engine.constraints import ConstraintCompiler, MaskStats
from serve.engine.engine import Engine
from serve.engine.types import MIN_PIECE, Constraint, NewSequence, TokenOut, next_piece

LETTERS = string.ascii_lowercase[:12]
SWAPPED_BYTES_PER_TOKEN = 64  # what a preempted sequence's fake host copy counts per token of its context


def letter_tokenizer() -> Tokenizer:
    return train_tokenizer([LETTERS * 3, "the quick brown fox"], vocab_size=300)


class FakeEngine:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_batch_size: int = 4,
        capacity: int = 64,
        eos_after: int | None = None,
        keeps_prefixes: bool = False,
        speculation: tuple[int, int] = (0, 0),
    ) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.capacity = capacity
        self.context_length = capacity
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_token_id = EOS_ID
        self.eos_token_ids: tuple[int, ...] = (EOS_ID,)
        self.eos_after = eos_after  # emit EOS as this many-th generated token
        self.lora_slots = 0
        # (proposed, accepted): each decode step speculates for every sequence as the engine's do, proposing
        # that many tokens (fewer where its slot lacks room) of which sampling picks that many.
        self.speculation = speculation
        self._alphabet = [tokenizer.encode(c).ids[0] for c in LETTERS]
        self._ids: list[str] = []
        self._context: dict[str, list[int]] = {}
        self._generated: dict[str, int] = {}
        self._staged: tuple[NewSequence, int, int] | None = None  # (sequence, chunk, prompt tokens done)
        self._background: list[NewSequence] = []  # begun, not ended
        self._released: set[str] = set()  # of them, released meanwhile
        self._swapped: set[str] = set()  # preempted: their context kept, no row
        self.background_steps = 0  # decode steps a background prefill takes (0: done at once)
        self._background_left = 0
        # A prefix cache in bookkeeping only: tokens are a function of the context, wherever its KV came from.
        self._kept: list[list[int]] | None = [] if keeps_prefixes else None
        self._compiler: ConstraintCompiler | None = None
        self.mask_stats = MaskStats()  # a fake samples no masks: it stays at zero

    @property
    def constraint_compiler(self) -> ConstraintCompiler:
        """The real compiler (its constraints are compiled, then ignored: a fake samples no masks)."""
        if self._compiler is None:
            self._compiler = ConstraintCompiler(self.tokenizer, self.vocab_size, [self.eos_token_id])
        return self._compiler

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

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int:
        """The longest prefix a finished sequence's prompt shares with the prompt, all but its last tokens."""
        shared = [shared_prefix(kept, prompt_ids) for kept in self._kept or []]
        return max(0, min(max(shared, default=0), len(prompt_ids) - MIN_PIECE))

    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]:
        if self._staged is not None or self._background:
            raise RuntimeError("a chunked or background prefill is in progress")
        if len(self._ids) + len(new) > self.max_batch_size:
            raise ValueError("more rows than KV slots")
        for seq in new:
            if not 1 <= len(seq.prompt_ids) < self.capacity or seq.seq_id in self._context:
                raise ValueError(f"bad sequence {seq.seq_id}")
        if chunk and len(new) == 1 and len(new[0].prompt_ids) > chunk:
            first = next_piece(0, chunk, len(new[0].prompt_ids))
            self._staged = (new[0], chunk, first)  # the first piece ran
            return []
        for seq in new:
            self._ids.append(seq.seq_id)
            self._context[seq.seq_id] = list(seq.prompt_ids)
            self._generated[seq.seq_id] = 0
        return [self._sample(s.seq_id) for s in new]

    def begin_prefill(self, new: Sequence[NewSequence]) -> None:
        if not self._ids or self.cached_tokens(new[0].prompt_ids):
            raise ValueError("a background prefill needs running rows and no prefix-cache hit")
        self.prefill([])  # the same checks as a prefill
        if len(self._ids) + len(new) > self.max_batch_size:
            raise ValueError("more rows than KV slots")
        self._background, self._background_left = list(new), self.background_steps

    @property
    def background_ids(self) -> list[str]:
        return [s.seq_id for s in self._background]

    @property
    def background_done(self) -> bool:
        return bool(self._background) and self._background_left == 0

    def end_prefill(self) -> tuple[list[TokenOut], float]:
        new, self._background = self._background, []
        released, self._released = self._released, set()
        outs = self.prefill(new)
        self.release(released)
        return [o for o in outs if o.seq_id not in released], 0.001

    @property
    def staged_id(self) -> str | None:
        return None if self._staged is None else self._staged[0].seq_id

    @property
    def staged_done(self) -> int:
        return 0 if self._staged is None else self._staged[2]

    def continue_prefill(self) -> list[TokenOut]:
        if self._staged is None:
            raise RuntimeError("no chunked prefill in progress")
        seq, chunk, done = self._staged
        done += next_piece(done, chunk, len(seq.prompt_ids))
        if done < len(seq.prompt_ids):
            self._staged = (seq, chunk, done)
            return []
        self._staged = None
        return self.prefill([seq])

    def decode(self) -> list[TokenOut]:
        if not self._ids:
            raise RuntimeError("decode() with no running sequence")
        for seq_id in self._ids:
            if len(self._context[seq_id]) >= self.capacity:
                raise ValueError(f"{seq_id} overflowed its KV slot")
        self._background_left = max(0, self._background_left - 1)
        return [out for seq_id in self._ids for out in self._step(seq_id)]

    def release(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            if seq_id in self.background_ids:
                self._released.add(seq_id)
            if self._staged is not None and self._staged[0].seq_id == seq_id:
                self._staged = None
            if seq_id in self._swapped:
                self._swapped.discard(seq_id)
                del self._context[seq_id], self._generated[seq_id]
            elif seq_id in self._context:
                if self._kept is not None:
                    context = self._context[seq_id]  # its prompt: the engine keeps no generated position
                    self._kept.append(context[: len(context) - self._generated[seq_id]])
                row = self._ids.index(seq_id)
                self._ids[row] = self._ids[-1]
                self._ids.pop()
                del self._context[seq_id], self._generated[seq_id]

    def swap_out(self, seq_ids: Iterable[str]) -> None:
        if self._staged is not None or self._background:
            raise RuntimeError("a chunked or background prefill is in progress")
        for seq_id in seq_ids:
            row = self._ids.index(seq_id)
            self._ids[row] = self._ids[-1]
            self._ids.pop()
            self._swapped.add(seq_id)  # its context and count stay: its tokens go on from them

    def swap_in(self, seq_ids: Sequence[str]) -> None:
        if not self._swapped.issuperset(seq_ids) or len(self._ids) + len(seq_ids) > self.max_batch_size:
            raise ValueError(f"cannot resume {list(seq_ids)}")
        self._swapped.difference_update(seq_ids)
        self._ids.extend(seq_ids)

    @property
    def swapped_bytes(self) -> int:
        return sum(map(self._swap_bytes, self._swapped))

    def swap_bytes(self, seq_id: str) -> int:
        if seq_id not in self._ids:
            raise ValueError(f"sequence {seq_id} is not running")
        return self._swap_bytes(seq_id)

    def _swap_bytes(self, seq_id: str) -> int:
        return SWAPPED_BYTES_PER_TOKEN * len(self._context[seq_id])

    def expected(self, prompt: Sequence[int], n: int) -> list[int]:
        """The tokens a sequence gets alone (EOS included, as the engine emits them)."""
        context, out = list(prompt), []
        for generated in range(n):
            token = self.next_token(context, generated)
            out.append(token)
            context.append(token)
        return out

    def _step(self, seq_id: str) -> list[TokenOut]:
        """One decode step's tokens for a sequence: one, or a speculating step's accepted proposals and the
        token after them, the first carrying the counts (the tokens are the same either way)."""
        room = self.capacity - len(self._context[seq_id]) - 1
        proposed = min(self.speculation[0], room)
        if proposed <= 0:
            return [self._sample(seq_id)]
        accepted = min(self.speculation[1], proposed)
        outs = [self._sample(seq_id) for _ in range(accepted + 1)]
        outs[0] = outs[0]._replace(proposed=proposed, accepted=accepted)
        return outs

    def _sample(self, seq_id: str) -> TokenOut:
        # Feeding the previous token into the "cache" happens lazily: the context holds all sampled tokens.
        token = self.next_token(self._context[seq_id], self._generated[seq_id])
        self._context[seq_id].append(token)
        self._generated[seq_id] += 1
        return TokenOut(seq_id, token, -0.5)


class Instrumented:
    """Test controls around an engine (fake or real); the scheduler sees the engine interface."""

    def __init__(
        self,
        engine: FakeEngine | Engine,
        reference: Callable[[Sequence[int], int], list[int]],
        step_seconds: float = 0.0,
    ) -> None:
        self.inner = engine
        self.tokenizer = engine.tokenizer
        self.max_batch_size = engine.max_batch_size
        self.capacity = engine.capacity
        self.vocab_size = engine.vocab_size
        self.eos_token_id = engine.eos_token_id
        self.constraint_compiler = engine.constraint_compiler
        self.mask_stats = engine.mask_stats
        self.eos_token_ids = engine.eos_token_ids
        self.step_seconds = step_seconds
        self.gate = threading.Event()
        self.gate.set()
        self.fail_next: set[str] = set()
        self.poisoned: set[str] = set()  # sequences whose tokens are replaced by an id outside the vocabulary
        self.stray_decode = False  # the next decode also returns a token for a sequence nobody submitted
        self.calls: list[tuple[str, list[str]]] = []  # (phase, the rows it ran on), in call order
        self.shapes: list[tuple[int, ...]] = []  # the engine's KV view after each successful call
        self._reference = reference

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    @property
    def running_ids(self) -> list[str]:
        return self.inner.running_ids

    def kv_shape(self) -> tuple[int, ...]:
        return self.inner.kv_shape()

    def expected(self, prompt: Sequence[int], n: int) -> list[int]:
        """The tokens a greedy sequence gets when it runs alone."""
        return self._reference(prompt, n)

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int:
        return self.inner.cached_tokens(prompt_ids, adapter)

    @property
    def lora_slots(self) -> int:
        return self.inner.lora_slots

    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]:
        self._enter("prefill", [s.seq_id for s in new])
        return self._leave(self.inner.prefill(new, chunk))

    @property
    def staged_id(self) -> str | None:
        return self.inner.staged_id

    @property
    def staged_done(self) -> int:
        return self.inner.staged_done

    def continue_prefill(self) -> list[TokenOut]:
        self._enter("prefill", [])
        return self._leave(self.inner.continue_prefill())

    def begin_prefill(self, new: Sequence[NewSequence]) -> None:
        self._enter("prefill", [s.seq_id for s in new])
        self.inner.begin_prefill(new)

    @property
    def background_ids(self) -> list[str]:
        return self.inner.background_ids

    @property
    def background_done(self) -> bool:
        return self.inner.background_done

    def end_prefill(self) -> tuple[list[TokenOut], float]:
        outs, seconds = self.inner.end_prefill()
        if "end_prefill" in self.fail_next:  # the background run failed: its sequences are gone
            self.fail_next.discard("end_prefill")
            self.inner.release([o.seq_id for o in outs])
            raise RuntimeError("injected end_prefill failure")
        return self._leave(outs), seconds

    def decode(self) -> list[TokenOut]:
        self._enter("decode", self.inner.running_ids)
        outs = self._leave(self.inner.decode())
        if self.stray_decode:
            self.stray_decode = False
            outs.append(TokenOut("stray", 5, 0.0))
        return outs

    def release(self, seq_ids: Iterable[str]) -> None:
        self.inner.release(seq_ids)

    def swap_out(self, seq_ids: Iterable[str]) -> None:
        seq_ids = list(seq_ids)
        self.calls.append(("swap_out", seq_ids))
        if "swap_out" in self.fail_next:
            self.fail_next.discard("swap_out")
            raise RuntimeError("injected swap_out failure")
        self.inner.swap_out(seq_ids)

    def swap_in(self, seq_ids: Sequence[str]) -> None:
        self.calls.append(("swap_in", list(seq_ids)))
        self.inner.swap_in(seq_ids)

    @property
    def swapped_bytes(self) -> int:
        return self.inner.swapped_bytes

    def swap_bytes(self, seq_id: str) -> int:
        return self.inner.swap_bytes(seq_id)

    def _leave(self, outs: list[TokenOut]) -> list[TokenOut]:
        self.shapes.append(self.inner.kv_shape())
        bad = self.tokenizer.get_vocab_size() + 5
        return [TokenOut(o.seq_id, bad, o.logprob) if o.seq_id in self.poisoned else o for o in outs]

    def _enter(self, phase: str, rows: list[str]) -> None:
        self.calls.append((phase, rows))
        if not self.gate.wait(10):
            raise TimeoutError("test gate never opened")
        time.sleep(self.step_seconds)
        if phase in self.fail_next:
            self.fail_next.discard(phase)
            raise RuntimeError(f"injected {phase} failure")


def fake(tokenizer: Tokenizer, step_seconds: float = 0.0, **kw: Any) -> Instrumented:
    engine = FakeEngine(tokenizer, **kw)
    return Instrumented(engine, engine.expected, step_seconds)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences have in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def hold_compiles(monkeypatch: pytest.MonkeyPatch, gate: threading.Event) -> None:
    """Every constraint's compile waits for `gate` (10 s at most): its request stays compiling until then."""
    real = ConstraintCompiler._compile

    def held(self: ConstraintCompiler, constraint: Constraint) -> Any:
        gate.wait(10)
        return real(self, constraint)

    monkeypatch.setattr(ConstraintCompiler, "_compile", held)

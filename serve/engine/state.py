"""What every layer of the engine reads and writes, and the records of sequences that hold rows off the batch.

The engine (serve/engine/engine.py) is one object over one KV cache, its methods grouped by concept in layers
that build on one another, each in its own module:

    EngineState (here)  what the engine holds: the cache, each row's bookkeeping, the sequences in the rows
    Adapters            adapters.py: which LoRA adapter is in which slot, and binding their weights to a run
    KvRows              rows.py: the rows' moves (forks, release, swap out / swap in, the prefix cache)
    Steps               step.py: a run over rows, the decode step and speculation's step
    Prefills            prefill.py: prefill, in chunks or beside decode steps, and joining the batch
    Engine              engine.py: made from a bundle, warmed up, and what the scheduler reads

A layer calls only those below it. `Engine.__init__` fills the attributes declared here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from serve.engine.constraints import ConstraintCompiler, ConstraintRows, MaskWorker, PendingMasks
from serve.engine.kv_cache import KvCache
from serve.engine.lora.residency import Residency
from serve.engine.lora.slots import LoraSlots
from serve.engine.prefix_cache import PrefixCache
from serve.engine.prompt_scoring import PromptScorer
from serve.engine.runtime import Device
from serve.engine.sampling import RowState, SamplingBatch
from serve.engine.speculation import Pace, Proposer
from serve.engine.types import ModelSpec, NewSequence, SpeculationSettings, next_piece

if TYPE_CHECKING:
    import onnxruntime as ort
    from llguidance import LLMatcher


class Joining(NamedTuple):
    """The constraint rows of sequences about to join, and the fill of their first masks."""

    rows: ConstraintRows
    first_masks: PendingMasks | None  # None: no sequence of theirs is constrained


@dataclass
class Background:
    """A prefill group running beside decode steps (`begin_prefill`), in rows [first, first + len(new))."""

    new: Sequence[NewSequence]
    first: int
    run: Future[float]  # the seconds its run took
    inputs: dict[str, np.ndarray]  # bound to the run: alive until it is over
    joining: Joining  # their matchers, and their first masks computed meanwhile
    released: set[str] = field(default_factory=set)  # left while it ran


@dataclass
class Swapped:
    """A preempted sequence (`Engine.swap_out`): its row's valid keys and values ([heads, length, head_dim]
    per buffer) and token ids, the token it still has to be fed, and the state that decides its next
    tokens."""

    kv: list[np.ndarray]
    tokens: np.ndarray
    pending: int
    sampling: RowState
    matcher: LLMatcher | None
    pace: Pace
    adapter: str  # its LoRA adapter ("": none): resident again, maybe in another slot, when it resumes
    prefilled: int  # its first positions computed by prefill runs (Engine._prefilled)

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.kv) + self.tokens.nbytes


@dataclass
class Staged:
    """A sequence whose prompt is being prefilled in chunks: it sits in the row after the running ones."""

    seq: NewSequence
    chunk: int  # prompt tokens per step
    done: int = 0  # prompt tokens already in its cache

    def piece_end(self) -> int:
        """Where its next piece ends (`next_piece`: never a lone token)."""
        return self.done + next_piece(self.done, self.chunk, len(self.seq.prompt_ids))


class EngineState:
    """The engine's attributes (set by `Engine.__init__`), and which sequences hold rows."""

    spec: ModelSpec
    tokenizer: Tokenizer
    max_batch_size: int
    prefix_cache_rows: int
    capacity: int  # tokens per KV row
    session: ort.InferenceSession  # the serving graph's
    # a LoRA bundle's serving graph without branches (prepared), which runs the steps with no adapter row
    _branch_free: ort.InferenceSession | None
    providers: list[str]
    kv_device: Device
    _kv: KvCache  # max_batch_size running rows, then prefix_cache_rows kept ones
    _lengths: np.ndarray  # per running row: tokens in its cache
    _pending: np.ndarray  # per running row: the token sampled, not yet in the cache
    _tokens: np.ndarray  # per running row: its cached token ids
    _prefilled: np.ndarray  # per running row: its first positions computed by prefill runs
    _row_index: np.ndarray  # arange(max_batch_size)
    _lora: LoraSlots | None  # the slots' weights; None: the graph has no LoRA branches
    _lora_values: dict[tuple[int, int], dict[str, Any]]  # a span of slots -> its LoRA inputs' values
    _lora_bound: dict[int, tuple[int, int]]  # by a binding's id: the span it has bound
    _adapters: Residency  # which adapter is in which slot
    _row_adapter: np.ndarray  # per KV row (running and kept): its adapter's slot; 0: none
    _prefix: PrefixCache
    _untrusted: set[str]  # running when a step failed: their rows are not kept
    _scorer: PromptScorer | None
    _ids: list[str]  # the running sequences, in row order
    _staged: Staged | None  # the sequence being prefilled in chunks
    _swapped: dict[str, Swapped]  # preempted sequences, by id, in the order they left
    _sampling: SamplingBatch  # the running rows' sampling state
    _masks: MaskWorker
    _constraints: ConstraintRows  # the running rows' matchers
    _compiler: ConstraintCompiler | None
    _compiler_lock: threading.Lock
    speculation: SpeculationSettings
    _verifier: ort.InferenceSession | None  # the verification graph's, with speculation
    _positions: int  # the most positions the verification graph scores a run
    _verify_bindings: dict[int, Any]  # by the run's tokens
    proposer: Proposer
    _speculating: list[Pace]  # how each running row proposes, in row order
    _logits: np.ndarray
    _side_logits: np.ndarray  # a prefill's beside a decode step
    _side: ThreadPoolExecutor | None  # the thread of a prefill beside decode steps
    _background: Background | None  # that prefill, while it runs
    last_logits: np.ndarray
    _bindings: dict[tuple[int, int, bool, bool], Any]  # (first row, end row, side, branch-free) -> binding

    @property
    def batch_size(self) -> int:
        return len(self._ids)

    @property
    def staged_id(self) -> str | None:
        """The sequence being prefilled in chunks (it has a row, but decode steps leave it alone)."""
        return None if self._staged is None else self._staged.seq.seq_id

    @property
    def staged_done(self) -> int:
        """Prompt tokens the staged sequence already has in its cache (0 when none is staged)."""
        return 0 if self._staged is None else self._staged.done

    @property
    def background_ids(self) -> list[str]:
        """The sequences `begin_prefill` is prefilling (they have rows, but decode steps leave them alone)."""
        return [] if self._background is None else [s.seq_id for s in self._background.new]

    @property
    def background_done(self) -> bool:
        """Whether `end_prefill` would return without waiting."""
        return self._background is not None and self._background.run.done()

"""The generation engine: one prefill or one decode step at a time over a slot-based, in-place KV cache.

The cache (serve/engine/kv_cache.py: its buffers on the session's device, how a run binds rows and how a row
is copied) has `max_batch_size + prefix_cache_rows` rows of `capacity` tokens. Rows [0, n) hold the running
sequences, right-padded: row r's valid cache entries are [0, lengths[r]). A prefill group is written straight
into rows [n, n + k), a contiguous range, so joining copies nothing; a sequence that leaves is replaced by the
last row (swap-remove), which copies that row. The rows past max_batch_size are the prefix cache's
(serve/engine/prefix_cache.py). A preempted sequence (`swap_out`) leaves its row as a released one does, its
row's valid part and its sampling state kept in host memory until `swap_in` puts them in the row after the
running ones. A run's rows are bound as both the past input and the present output of the serving graph,
so each step appends its keys and values in place. Small inputs are bound from host arrays
and logits are written into a host array (ONNX Runtime copies them from the device): sampling is numpy.

Not thread-safe: the scheduler calls it from its one engine thread.

Over 400 lines on purpose: prefill, chunked and background prefill, forks, decode, speculation and the
prefix cache all move rows of the same cache under the same run bindings, so they stay one class; what stands
apart has its own module (kv_cache, prefix_cache, runtime, row_pad, sampling, constraints, prompt_scoring,
speculation, verify_graph).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from tokenizers import Tokenizer

from serve.bundle import LoraLayout
from serve.engine.constraints import ConstraintCompiler, ConstraintRows, MaskStats, MaskWorker, PendingMasks
from serve.engine.kv_cache import KvCache
from serve.engine.lora import (
    Adapter,
    LoraSlots,
    Residency,
    check_graph_inputs,
    model_names,
    read_adapter,
    token_slots,
)
from serve.engine.prefix_cache import PrefixCache, PrefixHit
from serve.engine.prepared import engine_graphs
from serve.engine.prompt_scoring import PromptScorer, scoring_session
from serve.engine.runtime import (
    Device,
    InMemoryGraph,
    create_session,
    kv_device,
    ortvalue,
    session_device_id,
)
from serve.engine.sampling import Alternatives, PromptScores, RowState, SamplingBatch, SamplingParams
from serve.engine.speculation import DraftModel, Pace, PromptLookup, Proposer
from serve.engine.types import (
    MIN_PIECE,
    ConstraintState,
    EngineInfo,
    EngineSettings,
    ModelSpec,
    NewSequence,
    TokenOut,
    next_piece,
)
from serve.engine.verify_graph import PICK_INDEX, chained_present_outputs, verification_graph
from serve.errors import BundleError
from serve.process import trim_heap

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from serve.bundle import Bundle


log = logging.getLogger("textgen.engine")

_NUMPY_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


# What a refused row's TokenOut says (SamplingBatch.refused).
NO_ALLOWED_TOKEN = (
    "no token is allowed at this step: its constraint, its logit_bias (-100 bans a token) and min_new_tokens "
    "(EOS and the stop token ids are banned until then) leave nothing to sample"
)
# Per row of a step: a constrained row's state after its token, and why the row cannot go on (or None).
_Notes = dict[int, tuple[ConstraintState | None, str | None]]


class _Joining(NamedTuple):
    """The constraint rows of sequences about to join, and the fill of their first masks."""

    rows: ConstraintRows
    first_masks: PendingMasks | None  # None: no sequence of theirs is constrained


class _RunInputs(NamedTuple):
    input_ids: np.ndarray  # [rows, tokens]
    position_ids: np.ndarray  # [rows, tokens]
    seqlens_k: np.ndarray  # [rows]: each row's tokens after the run, minus one
    total: int  # the longest row's tokens after the run
    last_index: np.ndarray  # [rows]: the position in the run whose logits each row returns


@dataclass
class _Background:
    """A prefill group running beside decode steps (`begin_prefill`), in rows [first, first + len(new))."""

    new: Sequence[NewSequence]
    first: int
    run: Future[float]  # the seconds its run took
    inputs: dict[str, np.ndarray]  # bound to the run: alive until it is over
    joining: _Joining  # their matchers, and their first masks computed meanwhile
    released: set[str] = field(default_factory=set)  # left while it ran


def _timed(call: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


@dataclass
class _Swapped:
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
class _Staged:
    """A sequence whose prompt is being prefilled in chunks: it sits in the row after the running ones."""

    seq: NewSequence
    chunk: int  # prompt tokens per step
    done: int = 0  # prompt tokens already in its cache

    def piece_end(self) -> int:
        """Where its next piece ends (`next_piece`: never a lone token)."""
        return self.done + next_piece(self.done, self.chunk, len(self.seq.prompt_ids))


class Engine:
    def __init__(
        self,
        graph: str | InMemoryGraph,  # the serving graph's path, or the graph rewritten at load
        tokenizer: Tokenizer,
        spec: ModelSpec,
        settings: EngineSettings,
        # the bundle's standard graph, asked for when a prompt is first scored (prompt_scoring.py)
        scoring_graph: Callable[[], Path] | None = None,
        proposer: Proposer | None = None,  # with speculation: what guesses; prompt lookup by default
        # with speculation: the graph that scores a proposal (serve/engine/verify_graph.py), for as many
        # positions as speculation.num_tokens + 1
        verifier: str | InMemoryGraph | None = None,
        lora: LoraLayout | None = None,  # the graph's LoRA branches (serve/engine/lora.py); None: none
    ) -> None:
        if settings.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {settings.max_batch_size}")
        if settings.prefix_cache_rows < 0:
            raise ValueError(f"prefix_cache_rows must be >= 0, got {settings.prefix_cache_rows}")
        capacity = settings.capacity or spec.context_length
        if not 2 <= capacity <= spec.context_length:
            raise ValueError(
                f"capacity must be in [2, {spec.context_length}] (the context length), got {capacity}"
            )
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_batch_size = settings.max_batch_size
        self.prefix_cache_rows = settings.prefix_cache_rows
        self.capacity = capacity
        self.session = create_session(graph, settings.session)
        self.providers: list[str] = self.session.get_providers()
        if lora is not None:  # before the KV cache is allocated: a mismatch would surface at the first run
            where = graph if isinstance(graph, str) else str(graph.folder)
            check_graph_inputs(lora, {i.name: i.shape for i in self.session.get_inputs()}, where)
        self.kv_device: Device = kv_device(self.providers, session_device_id(self.session))
        rows = settings.max_batch_size + settings.prefix_cache_rows
        # The graph decides the precision (an fp16 bundle has fp16 caches and logits).
        types = {
            t.name: _NUMPY_TYPES[t.type] for t in [*self.session.get_inputs(), *self.session.get_outputs()]
        }
        kv_types = {
            f"{kind}.{layer}": types[f"past_{kind}.{layer}"]
            for layer in range(spec.n_layers)
            for kind in ("key", "value")
        }
        self._kv = KvCache(rows, (spec.kv_heads, capacity, spec.head_dim), kv_types, self.kv_device)
        self._lengths = np.zeros(settings.max_batch_size, np.int64)  # tokens in each row's cache
        self._pending = np.zeros(settings.max_batch_size, np.int64)  # sampled, not yet in the cache
        self._tokens = np.zeros((settings.max_batch_size, capacity), np.int64)  # each row's cached token ids
        # Each row's first positions computed by prefill runs (its prompt), the only ones the prefix cache
        # reuses: a decode step computes a position otherwise (MIN_PIECE says how).
        self._prefilled = np.zeros(settings.max_batch_size, np.int64)
        self._row_index = np.arange(settings.max_batch_size)
        self._lora = None if lora is None else LoraSlots(lora)
        # the span of slots a run uses (first, last; (0, 0): none) -> the LoRA inputs' values, made on first
        # use; what each binding has bound, by its id
        self._lora_values: dict[tuple[int, int], dict[str, Any]] = {}
        self._lora_bound: dict[int, tuple[int, int]] = {}
        slots = 0 if lora is None else lora.slots
        self._adapters = Residency(slots, settings.max_cpu_loras)  # which adapter is in which slot
        self._row_adapter = np.zeros(rows, np.int64)  # the slot of the sequence in each KV row; 0: none
        self._prefix = PrefixCache(range(settings.max_batch_size, rows), settings.prefix_cache_min_tokens)
        self._untrusted: set[str] = set()  # running when a step failed: their rows are not kept
        self._scorer = (
            None
            if scoring_graph is None
            else PromptScorer(scoring_graph, scoring_session(settings.session, self.providers))
        )
        self._ids: list[str] = []
        self._staged: _Staged | None = None
        self._swapped: dict[str, _Swapped] = {}  # preempted sequences, by id, in the order they left
        self._sampling = SamplingBatch()
        self._masks = MaskWorker(spec.vocab_size)
        self._constraints = ConstraintRows(self._masks)  # the running rows' matchers, as _sampling's rows
        self._compiler: ConstraintCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.speculation = settings.speculation
        self.speculation.validate()
        if self.speculation.enabled != (verifier is not None):
            raise ValueError(
                "speculation needs the verification graph (serve/engine/verify_graph.py); only it does"
            )
        # A second session over the same weights: from a prepared graph it maps the same packed weights, from
        # the bundle's graph ONNX Runtime packs a copy of its own (docs/benchmarks.md).
        self._verifier = None if verifier is None else create_session(verifier, settings.session)
        self._positions = self.speculation.num_tokens + 1  # the most the verification graph scores a run
        self._verify_bindings: dict[int, Any] = {}  # by the run's tokens
        self.proposer = proposer or PromptLookup(self.speculation.ngram_min, self.speculation.ngram_max)
        self._speculating: list[Pace] = []  # how each running row proposes, in row order
        # A speculating row returns the logits of its pending token and of each proposed one.
        logit_rows = max(settings.max_batch_size, self.speculation.num_tokens + 1)
        self._logits = np.zeros((logit_rows, spec.vocab_size), types["logits"])
        # the prefill that runs beside a decode step
        self._side_logits = np.zeros((settings.max_batch_size, spec.vocab_size), types["logits"])
        self._side: ThreadPoolExecutor | None = None  # its thread, started by the first such prefill
        self._background: _Background | None = None
        self.last_logits = self._logits[:0]
        # (first row, end row, side) -> its binding
        self._bindings: dict[tuple[int, int, bool], Any] = {}

    @classmethod
    def from_bundle(cls, bundle: Bundle, settings: EngineSettings) -> Engine:
        m = bundle.manifest
        if m.graphs.inplace is None:
            raise BundleError(
                f"{bundle.root}: the bundle has no in-place serving graph (graphs.inplace); "
                "re-export it with this version's `textgen-export`"
            )
        arch = m.architecture
        spec = ModelSpec(
            n_layers=arch.n_layers,
            n_heads=arch.n_heads,
            head_dim=arch.head_dim,
            vocab_size=arch.vocab_size,
            context_length=arch.context_length,
            eos_token_id=m.eos_token_id,
            pad_token_id=m.pad_token_id,
            n_kv_heads=arch.n_kv_heads,
            eos_token_ids=tuple(m.eos_token_ids),
        )
        # The bundle's optimization profile names the standard graph's inputs; the serving graph's
        # GroupQueryAttention runs on CUDA anyway, so TensorRT gets only its engine cache and precision.
        trt = {k: v for k, v in bundle.tensorrt_options().items() if not k.startswith("trt_profile_")}
        session = replace(settings.session, tensorrt_options=trt)
        if settings.speculation.enabled:  # sessions take turns: one's threads spinning on would slow the next
            session = replace(session, spin_between_runs=False)
        settings = replace(settings, session=session)
        # The prepared graphs (their packed weights mapped) where a cache is set, else the bundle's.
        graphs = engine_graphs(bundle, settings)
        graph = graphs.graph if isinstance(graphs.graph, InMemoryGraph) else str(graphs.graph)
        proposer: Proposer | None = None
        verifier = None
        if settings.speculation.enabled:
            positions = settings.speculation.num_tokens + 1
            verifier = verification_graph(Path(graph) if isinstance(graph, str) else graph, positions)
            if settings.speculation.draft_bundle is not None:
                proposer = DraftModel(_draft_engine(bundle, settings))
        engine = cls(graph, bundle.tokenizer, spec, settings, graphs.scoring, proposer, verifier, m.lora)
        for name, path in settings.adapters:
            if m.lora is None:
                raise BundleError(
                    f"{bundle.root}: the bundle has no LoRA slots, so it cannot serve adapter {name!r}; "
                    "export it with --lora-slots N --max-lora-rank R"
                )
            try:
                engine.register_adapter(name, read_adapter(path, m.lora, model_names(m)))
            except ValueError as exc:  # AdapterError included: the folder and what differs
                raise BundleError(f"adapter {name!r}: {exc}") from exc
        return engine

    def warm_up(self) -> None:
        """One prefill and one decode step, so the first request does not pay for ONNX Runtime's lazy
        set-up; run before the scheduler starts, so no metric counts it as a request."""
        warm = NewSequence(seq_id="warm-up", prompt_ids=[self.eos_token_id], sampling=SamplingParams())
        self.prefill([warm])
        if self._verifier is not None and self.capacity > 2:
            self._verify(1, np.full(2, self.eos_token_id, np.int64))
        self.decode()
        self.release(["warm-up"])

    # -- what the scheduler reads ------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        return self.spec.context_length

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.spec.eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, eos_token_id first."""
        return self.spec.eos_ids

    @property
    def batch_size(self) -> int:
        return len(self._ids)

    @property
    def running_ids(self) -> list[str]:
        return list(self._ids)

    def kv_shape(self) -> tuple[int, ...]:
        """Shape of the live KV view the graph runs on: (rows, kv heads, capacity, head_dim)."""
        return (self.batch_size, *self._kv.row_shape)

    @property
    def kv_bytes(self) -> int:
        """Memory of every KV row, running and prefix cache, on the engine's device."""
        return self._kv.kv_bytes

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type, as numpy names it ("float32", "float16")."""
        return self._kv.dtype_name

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            max_batch_size=self.max_batch_size,
            capacity=self.capacity,
            eos_token_id=self.eos_token_id,
            providers=tuple(self.providers),
            kv_device=self.kv_device.type,
            prefix_cache_rows=self.prefix_cache_rows,
            kv_bytes=self.kv_bytes,
            eos_token_ids=self.eos_token_ids,
            speculation=self.speculation,
            adapters=self.adapter_names,
            lora_slots=self.lora_slots,
        )

    def kv_buffer_devices(self) -> list[str]:
        """The device ONNX Runtime reports for each KV buffer ("cpu", "cuda"), K and V per layer."""
        return self._kv.kv_buffer_devices()

    def kv_host(self, layer: int, kind: str) -> np.ndarray:
        """A host copy of the live rows [0, n) of one layer's "key" or "value" buffer, for tests and checks.
        Copies on every call (on a GPU the whole buffer, device to host); the engine never calls it."""
        return self._kv.kv_host(layer, kind, self.batch_size)

    @property
    def constraint_compiler(self) -> ConstraintCompiler:
        """Compiles constraints for this model, with a cache that lives as long as the engine; made on first
        use. Thread-safe, unlike the engine: requests are tracked on another thread than the one stepping."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = ConstraintCompiler(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
            return self._compiler

    @property
    def constrained_rows(self) -> int:
        """Running sequences with a constraint (each holds a matcher until it leaves)."""
        return self._constraints.constrained

    @property
    def mask_stats(self) -> MaskStats:
        """What the constrained rows' masks have cost so far."""
        return self._masks.stats

    def lengths(self) -> dict[str, int]:
        """Tokens in each running sequence's cache."""
        return {seq_id: int(self._lengths[r]) for r, seq_id in enumerate(self._ids)}

    # -- steps -------------------------------------------------------------------------------------------
    @property
    def staged_id(self) -> str | None:
        """The sequence being prefilled in chunks (it has a row, but decode steps leave it alone)."""
        return None if self._staged is None else self._staged.seq.seq_id

    @property
    def staged_done(self) -> int:
        """Prompt tokens the staged sequence already has in its cache (0 when none is staged)."""
        return 0 if self._staged is None else self._staged.done

    def score_prompt(self, prompt_ids: Sequence[int], top: int = 0) -> PromptScores:
        """Each prompt token's logprob after the ones before it (len - 1 values) and, with `top`, the most
        likely tokens of each position; RuntimeError for an engine made without the bundle's standard
        graph."""
        if self._scorer is None:
            raise RuntimeError("this engine was made without a scoring graph: it cannot score prompts")
        return self._scorer.score(prompt_ids, top)

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int:
        """How many of this prompt's tokens a prefill now would copy from the prefix cache (0: none)."""
        slot = self._adapters.resident.get(adapter) if adapter else 0
        return 0 if slot is None else _reusable(self._hit(prompt_ids, slot))  # another's rows were forgotten

    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]:
        """Run the prompts of `new` as one right-padded group; they join the batch. Returns first tokens.

        A prompt that begins with a prefix the prefix cache keeps (`cached_tokens`) starts from a copy of
        that row instead and runs only the rest, alone (a piece over a cached prefix is one row: see below).
        A sequence that forks another of the group (`NewSequence.fork_of`: n choices of one prompt) is not
        run: it takes a copy of that one's row and first-step logits once the group has run.

        With `chunk` > 0, one sequence whose prompt (the part not cached) is longer than `chunk` is
        prefilled `chunk` tokens at a time instead: this call runs the first piece and returns nothing;
        `continue_prefill` runs the others (decode steps of the running batch may come in between) and the
        last one returns its first token.
        """
        n, k = self.batch_size, len(new)
        if not new:
            return []
        self._check_joining(new)
        self._make_resident({seq.adapter for seq in new if seq.adapter})
        forks = _forks(new)
        if forks:
            new = [seq for seq in new if seq.seq_id not in forks]
        hits = [self._hit(seq.prompt_ids, self.slot(seq.adapter)) for seq in new]
        # One sequence only: GroupQueryAttention (ONNX Runtime 1.32) refuses a piece over a cached prefix for
        # more than one row ("batch_size must be 1 when sequence_length > 1 and past context is given").
        if chunk > 0 and k == 1 and len(new[0].prompt_ids) - _reusable(hits[0]) > chunk:
            self._staged = _Staged(new[0], chunk)
            try:
                self._staged.done = self._reuse(hits[0], n, new[0])
                self._prefill_piece()
            except Exception:
                self._staged = None
                raise
            return []
        misses = [seq for seq, hit in zip(new, hits, strict=True) if hit is None]
        reused = [(seq, hit) for seq, hit in zip(new, hits, strict=True) if hit is not None]
        ordered = [*misses, *(seq for seq, _ in reused)]
        # Their first masks (the forks' too, which take the rows after them), computed while the prompts run.
        joining = self._joining([*ordered, *forks.values()])
        try:
            parts = [self._prefill_group(n, misses)] if misses else []
            for row, (seq, hit) in enumerate(reused, start=n + len(misses)):
                if parts:  # every run writes the same logits buffer
                    parts[-1] = parts[-1].copy()
                parts.append(self._prefill_rows(row, seq.prompt_ids, self._reuse(hit, row, seq)))
        except BaseException:
            _settle(joining)
            raise
        self.last_logits = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if forks:
            ordered, self.last_logits = self._fork(n, ordered, list(forks.values()), self.last_logits)
        lens = np.array([len(s.prompt_ids) for s in ordered])
        return self._join(ordered, self.last_logits, lens, joining)

    def _fork(
        self, n: int, ordered: list[NewSequence], forks: list[NewSequence], logits: np.ndarray
    ) -> tuple[list[NewSequence], np.ndarray]:
        """Rows [n, n + len(ordered)) are prefilled; each fork takes the next row, a copy of its parent's
        (the prompt's keys and values and tokens), and a copy of its parent's logits for its first token."""
        parent_row = {seq.seq_id: i for i, seq in enumerate(ordered)}
        sources = []
        for j, fork in enumerate(forks):
            assert fork.fork_of is not None
            source = parent_row[fork.fork_of]
            length = len(fork.prompt_ids)
            self._kv.copy_row(n + source, n + len(ordered) + j, length)
            self._tokens[n + len(ordered) + j, :length] = self._tokens[n + source, :length]
            self._row_adapter[n + len(ordered) + j] = self._row_adapter[n + source]
            sources.append(source)
        return [*ordered, *forks], np.concatenate([logits, logits[sources]])

    def continue_prefill(self) -> list[TokenOut]:
        """The next piece of the chunked prefill; the last piece joins the sequence and returns its token."""
        staged = self._staged
        if staged is None:
            raise RuntimeError("continue_prefill() with no chunked prefill in progress")
        last = staged.piece_end() >= len(staged.seq.prompt_ids)
        joining = self._joining([staged.seq]) if last else None
        try:
            logits = self._prefill_piece()
        except BaseException:
            _settle(joining)
            raise
        if staged.done < len(staged.seq.prompt_ids):
            return []
        self._staged = None
        return self._join([staged.seq], logits, np.array([staged.done], np.int64), joining)

    def decode(self) -> list[TokenOut]:
        """One step for every running sequence: feed each its pending token, sample the next."""
        n = self.batch_size
        if n == 0:
            raise RuntimeError("decode() with no running sequence")
        lengths = self._lengths[:n]
        if int(lengths.max()) >= self.capacity:
            full = [s for s, length in zip(self._ids, lengths, strict=True) if length >= self.capacity]
            raise ValueError(
                f"sequences {full} filled their {self.capacity}-token KV slot; release them first"
            )
        if n == 1 and self._speculating[0].limit:
            proposal = self._proposal()
            if proposal.size:
                return self._speculate(proposal)
        # The constrained rows' masks are computed on the masks' thread while ONNX Runtime runs the step.
        pending = self._constraints.start_fill()
        try:
            logits = self._run(
                slice(0, n),
                _RunInputs(
                    self._pending[:n, None],
                    lengths[:, None],
                    lengths,  # after this step each row holds lengths + 1 tokens; seqlens_k is that minus one
                    int(lengths.max()) + 1,
                    np.zeros(n, np.int64),
                ),
            )
        except BaseException:
            if pending is not None:
                pending.settle()
            raise
        self._tokens[self._row_index[:n], lengths] = self._pending[:n]
        self._lengths[:n] += 1
        tokens, logprobs, notes = self._pick(self._sampling, self._constraints, logits, pending)
        return self._emit(0, tokens, logprobs, self._sampling.alternatives, notes)

    def _proposal(self) -> np.ndarray:
        """The tokens proposed after the one running row's pending token (empty: none), no more than its
        slot has room for: the run writes the keys and values of every proposed position."""
        pace = self._speculating[0]
        length = int(self._lengths[0])
        room = min(pace.tokens, self.capacity - length - 1)
        if room <= 0 or not pace.ready():
            return self._pending[:0]
        context = np.append(self._tokens[0, :length], self._pending[0])
        return self.proposer.propose(context, room)

    def _speculate(self, proposal: np.ndarray) -> list[TokenOut]:
        """One run over the row's pending token and the proposal; then each position's token is sampled as a
        decode step would sample it, in order, while the proposal agrees: the tokens sampled (the agreeing
        proposed ones, then the first that differs or the one after the last), each a TokenOut.

        The keys and values of the rejected positions stay in the slot past the row's length, where the next
        run overwrites them (a row's cache is valid up to its length only)."""
        length, k = int(self._lengths[0]), len(proposal)
        ids = np.concatenate([self._pending[:1], proposal])
        logits = self._verify(length, ids)
        self._tokens[0, length : length + k + 1] = ids
        outs: list[TokenOut] = []
        for j in range(k + 1):
            tokens, logprobs, notes = self._pick(self._sampling, self._constraints, logits[j : j + 1], None)
            outs.extend(self._emit(0, tokens, logprobs, self._sampling.alternatives, notes))
            if notes or j == k or int(tokens[0]) != int(proposal[j]):
                break
        accepted = len(outs) - 1
        self._lengths[0] = length + 1 + accepted
        self._speculating[0].record(k, accepted)
        outs[0] = outs[0]._replace(proposed=k, accepted=accepted)
        return outs

    def _verify(self, length: int, ids: np.ndarray) -> np.ndarray:
        """The logits of each of `ids` appended to row 0's `length` tokens, by the verification graph."""
        assert self._verifier is not None
        binding = self._verify_bindings.get(len(ids))
        if binding is None:
            binding = self._verify_bindings[len(ids)] = self._verifier.io_binding()
            binding.bind_ortvalue_output("logits", ortvalue(self._logits[: len(ids)]))
            self._kv.bind(binding, slice(0, 1), chained_present_outputs(self._positions))
        steps = np.arange(length, length + len(ids), dtype=np.int64)
        span = self._lora_span(slice(0, 1))
        inputs = {
            "input_ids": ids[None],
            "position_ids": steps[None],
            "seqlens_k": steps[-1:].astype(np.int32),
            "total_sequence_length": np.array(steps[-1] + 1, np.int32),
            PICK_INDEX: np.arange(len(ids), dtype=np.int64),
            **self._lora_routes(slice(0, 1), len(ids), span),
        }
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        self._bind_adapters(binding, span)
        try:
            self._verifier.run_with_iobinding(binding)
        except Exception:  # as _run: the row may be half written
            self._untrusted.update(self._ids[:1])
            raise
        self.last_logits = self._logits[: len(ids)]
        return self.last_logits

    def greedy_next(self, ids: Sequence[int], start: int) -> int:
        """Append ids[start:] to row 0, whose cache holds ids[:start], and return the argmax token after
        them: a draft model's proposal step (speculation.DraftModel), in an engine that runs no sequence.
        No sampling processors, constraints or prefix cache: a proposal needs none of them."""
        if self._ids or self._staged is not None or self._background is not None:
            raise RuntimeError("greedy_next() on an engine that runs sequences")
        logits = self._prefill_rows(0, ids, start)
        return int(np.argmax(logits[0]))

    def begin_prefill(self, new: Sequence[NewSequence]) -> None:
        """Start prefilling `new` into the rows after the running ones, on a thread of its own: decode steps
        of the running sequences go on meanwhile, and `end_prefill` joins `new` to the batch.

        A prefill between two decode steps stalls every running stream for its whole length; beside them,
        it shares the cores and the streams slow down instead (docs/benchmarks.md, "Latency under
        arrivals", `--prefill-beside-decode`). The two runs write
        disjoint rows of the cache, and logits of their own. Prompts with a prefix-cache hit are not taken:
        theirs is a row copy and a piece run alone (`prefill`).
        """
        self._check_joining(new)
        if not new:
            raise ValueError("begin_prefill() with no sequence")
        self._make_resident({seq.adapter for seq in new if seq.adapter})
        if any(self._hit(seq.prompt_ids, self.slot(seq.adapter)) is not None for seq in new):
            raise ValueError("a prompt with a prefix-cache hit cannot be prefilled beside decode steps")
        if _forks(new):
            raise ValueError("forked sequences (n choices of one prompt) are prefilled between decode steps")
        first = self.batch_size
        rows = slice(first, first + len(new))
        binding, inputs = self._bound(rows, self._group_inputs(first, new), side=True)
        if self._side is None:
            self._side = ThreadPoolExecutor(1, thread_name_prefix="textgen-prefill")
        joining = self._joining(new)
        run = self._side.submit(_timed, self.session.run_with_iobinding, binding)
        self._background = _Background(new, first, run, inputs, joining)

    @property
    def background_ids(self) -> list[str]:
        """The sequences `begin_prefill` is prefilling (they have rows, but decode steps leave them alone)."""
        return [] if self._background is None else [s.seq_id for s in self._background.new]

    @property
    def background_done(self) -> bool:
        """Whether `end_prefill` would return without waiting."""
        return self._background is not None and self._background.run.done()

    def end_prefill(self) -> tuple[list[TokenOut], float]:
        """Wait for the background prefill, join its sequences (those released meanwhile leave at once) and
        return their first tokens and the seconds its run took; raises what the run raised (they are gone)."""
        background = self._background
        if background is None:
            raise RuntimeError("end_prefill() with no background prefill")
        try:
            seconds = background.run.result()
        except BaseException:
            _settle(background.joining)
            raise
        finally:  # over either way: its rows are free again until joined
            self._background = None
        n, k = self.batch_size, len(background.new)
        lens = np.array([len(s.prompt_ids) for s in background.new], np.int64)
        if background.first != n:  # sequences that left meanwhile opened a gap below the group: close it
            for i, length in enumerate(lens.tolist()):  # row by row upwards: a source is never overwritten
                self._move_row(background.first + i, n + i, length)  # its length: set by _join
        outs = self._join(background.new, self._side_logits[:k], lens, background.joining)
        gone = background.released
        if gone:
            self.release(gone)
            outs = [out for out in outs if out.seq_id not in gone]
        return outs, seconds

    def release(self, seq_ids: Iterable[str]) -> None:
        """The sequences leave the batch; each is replaced by the current last row. The prefix cache may
        keep a copy of the leaving row first."""
        for seq_id in seq_ids:
            if seq_id == self.staged_id:
                self._staged = None  # its row is simply free again
                continue
            if seq_id in self.background_ids:
                assert self._background is not None
                self._background.released.add(seq_id)  # its run is writing its row: it leaves once joined
                continue
            if self._swapped.pop(seq_id, None) is not None:  # preempted: its host copy is all there is
                continue
            try:
                row = self._ids.index(seq_id)
            except ValueError:
                continue  # already gone: release is idempotent
            self._keep(row)
            self._remove_row(row)  # its matcher goes with it

    # -- preemption ----------------------------------------------------------------------------------------
    def swap_out(self, seq_ids: Iterable[str]) -> None:
        """Preempt running sequences: each one's row (its valid keys and values, token ids, pending token)
        and its sampling, constraint and speculation state move to host memory, and its row is freed (the
        last row takes its place). `swap_in` resumes it exactly where it stopped: the tokens it then gives
        are those it would have given without the pause (vLLM's swapping; recomputing the keys and values by
        a prefill would sum attention in another order than the decode steps did, and drift)."""
        if self._staged is not None or self._background is not None:
            raise RuntimeError("cannot preempt while a prefill is in progress: it holds the rows after them")
        for seq_id in seq_ids:
            row = self._row_of(seq_id)
            length = int(self._lengths[row])
            kv = self._kv.read_row(row, length)
            tokens, pending = self._tokens[row, :length].copy(), int(self._pending[row])
            adapter, prefilled = self._adapter_in(int(self._row_adapter[row])), int(self._prefilled[row])
            sampling, matcher, pace = self._remove_row(row)
            self._swapped[seq_id] = _Swapped(kv, tokens, pending, sampling, matcher, pace, adapter, prefilled)

    def swap_in(self, seq_ids: Sequence[str]) -> None:
        """Resume preempted sequences (`swap_out`) in the rows after the running ones; the next decode step
        feeds each its pending token. Sequences not preempted are refused (ValueError) before any moves."""
        if self._staged is not None or self._background is not None:
            raise RuntimeError("cannot resume while a prefill is in progress: it holds the rows after them")
        missing = [seq_id for seq_id in seq_ids if seq_id not in self._swapped]
        if missing:
            raise ValueError(f"sequences {missing} are not preempted")
        n, k = self.batch_size, len(seq_ids)
        if n + k > self.max_batch_size:
            raise ValueError(f"{n} running + {k} resumed exceed max_batch_size {self.max_batch_size}")
        self._make_resident({self._swapped[seq_id].adapter for seq_id in seq_ids} - {""})
        for seq_id in seq_ids:
            kept = self._swapped.pop(seq_id)
            row, length = self.batch_size, len(kept.tokens)
            self._row_adapter[row] = self.slot(kept.adapter)
            self._kv.write_row(row, kept.kv)
            self._tokens[row, :length] = kept.tokens
            self._lengths[row], self._pending[row] = length, kept.pending
            self._prefilled[row] = kept.prefilled
            self._sampling.put(kept.sampling)
            self._constraints.append(kept.matcher)
            self._speculating.append(kept.pace)
            self._ids.append(seq_id)

    @property
    def swapped_bytes(self) -> int:
        """Host memory holding the preempted sequences' keys and values."""
        return sum(kept.nbytes for kept in self._swapped.values())

    def swap_bytes(self, seq_id: str) -> int:
        """What `swapped_bytes` grows by if the running sequence `seq_id` is swapped out now: its row's valid
        keys and values and its token ids (the scheduler keeps the preempted ones within --swap-space)."""
        length = int(self._lengths[self._row_of(seq_id)])
        return length * (self._kv.position_bytes + self._tokens.itemsize)

    def _row_of(self, seq_id: str) -> int:
        try:
            return self._ids.index(seq_id)
        except ValueError:
            raise ValueError(f"sequence {seq_id} is not running") from None

    def _remove_row(self, row: int) -> tuple[RowState, LLMatcher | None, Pace]:
        """Take a running row out (the last row moves into its place, the staged one follows it down);
        returns its sampling state, matcher and pace."""
        last = len(self._ids) - 1
        if row != last:
            self._move_row(last, row, int(self._lengths[last]))
            self._pending[row] = self._pending[last]
            self._ids[row] = self._ids[last]
        self._ids.pop()
        sampling = self._sampling.remove(row)
        pace = self._speculating[row]
        moved = self._speculating.pop()
        if row < len(self._speculating):
            self._speculating[row] = moved
        matcher = self._constraints.remove(row)
        if self._staged is not None:  # keep the staged row right after the running ones
            self._move_row(last + 1, last, self._staged.done)
        return sampling, matcher, pace

    # -- internals ---------------------------------------------------------------------------------------
    def _check_joining(self, new: Sequence[NewSequence]) -> None:
        """ValueError (RuntimeError during a chunked prefill) unless `new` can join as it is."""
        if self._staged is not None:
            raise RuntimeError(f"sequence {self._staged.seq.seq_id} is still being prefilled in chunks")
        if self._background is not None:
            raise RuntimeError(f"sequences {self.background_ids} are still being prefilled")
        n, k = self.batch_size, len(new)
        if n + k > self.max_batch_size:
            raise ValueError(f"{n} running + {k} new sequences exceed max_batch_size {self.max_batch_size}")
        known = set(self._ids)
        for seq in new:
            if not 1 <= len(seq.prompt_ids) < self.capacity:
                raise ValueError(
                    f"sequence {seq.seq_id}: prompt of {len(seq.prompt_ids)} tokens, "
                    f"must be 1..{self.capacity - 1}"
                )
            if seq.seq_id in known:
                raise ValueError(f"sequence {seq.seq_id} is already running")
            if seq.adapter and seq.adapter not in self._adapters.registered:
                raise ValueError(f"no adapter named {seq.adapter!r} is loaded")
            if seq.adapter and seq.prompt_logprobs:
                raise ValueError(
                    "prompt logprobs are scored by the base model's graph, which has no adapters: not with "
                    f"adapter {seq.adapter!r}"
                )
            known.add(seq.seq_id)

    def _prefill_group(self, first_row: int, new: Sequence[NewSequence]) -> np.ndarray:
        """Prefill whole prompts as one right-padded group in rows [first_row, first_row + len(new))."""
        return self._run(slice(first_row, first_row + len(new)), self._group_inputs(first_row, new))

    def _group_inputs(self, first_row: int, new: Sequence[NewSequence]) -> _RunInputs:
        """The run inputs of a right-padded prefill group; records its prompts as the rows' tokens."""
        k = len(new)
        lens = np.array([len(s.prompt_ids) for s in new], np.int64)
        width = int(lens.max())
        ids = np.full((k, width), self.spec.pad_token_id, np.int64)
        for row, seq in enumerate(new):
            ids[row, : lens[row]] = seq.prompt_ids
        self._tokens[first_row : first_row + k, :width] = ids
        self._row_adapter[first_row : first_row + k] = [self.slot(seq.adapter) for seq in new]
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), (k, width))
        return _RunInputs(ids, positions, lens - 1, width, lens - 1)

    def _hit(self, prompt_ids: Sequence[int], adapter: int) -> PrefixHit | None:
        """The row (kept, or running) to copy a prompt's prefix from, and the tokens it gives; None: none.

        Admission asks this for every waiting prompt it considers, so the running rows are screened in one
        vectorized test first: a row can give `min_tokens` only if its first `min_tokens` tokens are the
        prompt's (one numpy test over all rows instead of a Python loop over them)."""
        head = self._prefix.min_tokens
        if not self._prefix.rows or len(prompt_ids) < head + MIN_PIECE:  # its last tokens are never reused
            return None
        n = self.batch_size
        same = (self._tokens[:n, :head] == np.asarray(prompt_ids[:head])).all(axis=1)
        mine = self._row_adapter[:n] == adapter  # another adapter's keys and values are not this prompt's
        rows = np.flatnonzero(same & mine & (self._prefilled[:n] >= head)).tolist()
        running = [(r, self._tokens[r, : self._prefilled[r]]) for r in rows]
        return self._prefix.match(prompt_ids, running, adapter)

    def _reuse(self, hit: PrefixHit | None, row: int, seq: NewSequence) -> int:
        """Copy a hit's row (kept or running) into `row`; returns the prompt tokens it gave (0: no hit)."""
        self._row_adapter[row] = self.slot(seq.adapter)
        if hit is None:
            return 0
        source, reused = hit
        self._kv.copy_row(source, row, reused)
        self._prefix.use(source)
        self._tokens[row, :reused] = seq.prompt_ids[:reused]
        return reused

    def _prefill_piece(self) -> np.ndarray:
        """Append the staged sequence's next piece (about `chunk` prompt tokens) to its row's cache; returns
        its logits."""
        assert self._staged is not None
        staged = self._staged
        end = staged.piece_end()
        logits = self._prefill_rows(self.batch_size, staged.seq.prompt_ids, staged.done, end)
        staged.done = end
        return logits

    def _prefill_rows(
        self, row: int, prompt_ids: Sequence[int], start: int, end: int | None = None
    ) -> np.ndarray:
        """Append prompt tokens [start, end) to one row whose cache holds the first `start`; its logits."""
        end = len(prompt_ids) if end is None else end
        piece = np.asarray(prompt_ids[start:end], np.int64)
        self._tokens[row, start:end] = piece
        positions = np.arange(start, end, dtype=np.int64)[None]
        seqlens = np.array([end - 1], np.int64)
        inputs = _RunInputs(piece[None], positions, seqlens, end, np.array([end - start - 1]))
        return self._run(slice(row, row + 1), inputs)

    def _joining(self, new: Sequence[NewSequence]) -> _Joining:
        """Fresh matchers for sequences about to join, and their first masks started on the masks' thread."""
        rows = self._constraints.group([seq.constraint for seq in new])
        return _Joining(rows, rows.start_fill())

    def _join(
        self,
        new: Sequence[NewSequence],
        logits: np.ndarray,
        lens: np.ndarray,
        joining: _Joining | None = None,
    ) -> list[TokenOut]:
        """The prefilled rows after the running ones join the batch with their first sampled tokens."""
        n = self.batch_size
        group = SamplingBatch()
        for seq in new:
            group.append(
                seq.sampling, seq.prompt_ids, seq.logprobs, seq.banned, seq.banned_for, seq.top_logprobs
            )
        rows, pending = self._joining(new) if joining is None else joining
        tokens, logprobs, notes = self._pick(group, rows, logits, pending)
        self._sampling.extend(group)
        self._constraints.extend(rows)
        self._speculating.extend(Pace(self._speculative_limit(seq)) for seq in new)
        self._ids.extend(s.seq_id for s in new)
        self._lengths[n : n + len(new)] = lens
        self._prefilled[n : n + len(new)] = lens
        outs = self._emit(n, tokens, logprobs, group.alternatives, notes)
        scored: dict[tuple[tuple[int, ...], int], PromptScores] = {}  # n choices of a prompt: scored once
        for i, seq in enumerate(new):
            if seq.prompt_logprobs:
                key = (tuple(seq.prompt_ids), seq.prompt_top_logprobs)
                if key not in scored:
                    scored[key] = self.score_prompt(seq.prompt_ids, seq.prompt_top_logprobs)
                outs[i] = outs[i]._replace(prompt=scored[key])
        return outs

    def _speculative_limit(self, seq: NewSequence) -> int:
        """The most tokens proposed for `seq` per step. A constrained sequence proposes none:
        each position's mask would depend on the tokens accepted before it."""
        if seq.constraint is not None:
            return 0
        limit = self.speculation.num_tokens
        return limit if seq.speculative_tokens is None else min(seq.speculative_tokens, limit)

    def _pick(
        self,
        sampling: SamplingBatch,
        constraints: ConstraintRows,
        logits: np.ndarray,
        pending: PendingMasks | None,
    ) -> tuple[np.ndarray, np.ndarray, _Notes]:
        """Sample rows (under their masks, once `pending` is filled) and advance their matchers: tokens,
        logprobs, and the constrained or failed rows' notes."""
        masks, failed = (None, {}) if pending is None else pending.wait()
        tokens, logprobs = sampling.sample(logits, masks)
        refused = sampling.refused.tolist()
        notes: _Notes = dict(constraints.consume(tokens, [*refused, *failed]))
        for row in refused:
            notes[row] = (None, NO_ALLOWED_TOKEN)
            tokens[row] = self.spec.pad_token_id  # a valid id in its KV input until it is released
        for row, reason in failed.items():
            notes[row] = (None, f"its constraint failed: {reason}")
        return tokens, logprobs, notes

    def _run(self, rows: slice, inputs: _RunInputs) -> np.ndarray:
        binding, _arrays = self._bound(rows, inputs)
        logits = self._logits[: rows.stop - rows.start]
        try:
            self.session.run_with_iobinding(binding)
        except Exception:  # it may have written part of any row it was given: do not keep those
            self._untrusted.update(self._ids[rows])
            raise
        self.last_logits = logits
        return logits

    def _bound(self, rows: slice, run: _RunInputs, side: bool = False) -> tuple[Any, dict[str, np.ndarray]]:
        """A row range's binding with these inputs bound, and the arrays to keep alive until it has run."""
        span = self._lora_span(rows)
        inputs: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(run.input_ids, np.int64),
            "position_ids": np.ascontiguousarray(run.position_ids, np.int64),
            "seqlens_k": run.seqlens_k.astype(np.int32),
            "total_sequence_length": np.array(run.total, np.int32),
            "last_index": np.ascontiguousarray(run.last_index, np.int64),
            **self._lora_routes(rows, run.input_ids.shape[1], span),
        }
        binding = self._binding(rows, side)
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        self._bind_adapters(binding, span)
        return binding, inputs

    @property
    def lora_slots(self) -> int:
        """Adapters resident at once (0: the bundle serves none); the scheduler runs no more distinct ones."""
        return self._adapters.slots

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name, in the order they were registered (not those retiring)."""
        return self._adapters.served

    @property
    def retiring_adapters(self) -> tuple[str, ...]:
        """The adapters unloaded once no request uses them (retire_adapter)."""
        return tuple(self._adapters.retiring)

    @property
    def adapter_counts(self) -> tuple[int, int]:
        """Adapters written into a slot so far, and how many of those evicted another."""
        return self._adapters.loads, self._adapters.evictions

    def register_adapter(self, name: str, adapter: Adapter) -> None:
        """Serve `adapter` as `name`: it takes a free slot now, or one when a request needs it. ValueError
        when the bundle has no LoRA slots or the name is taken."""
        if self._lora is None:
            raise ValueError("the bundle has no LoRA slots: export it with --lora-slots to serve adapters")
        self._adapters.register(name, adapter)
        if self._adapters.free_slot() is not None:
            self._place(name)

    def unregister_adapter(self, name: str) -> None:
        """Stop serving `name`; ValueError for an unknown one or while a sequence runs with it."""
        resuming = {kept.adapter for kept in self._swapped.values()}
        slot = self._adapters.unregister(name, self._busy_adapters() | resuming)
        if slot is not None and self._lora is not None:
            self._lora.write(slot, None)
            self._prefix.forget(slot)

    def retire_adapter(self, name: str) -> None:
        """Serve `name` to the requests that have it already, and to no new one: no request may name it
        from now on, and unregister_adapter forgets it once those end. ValueError for an unknown one."""
        if name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r} is loaded")
        self._adapters.retiring.add(name)

    def slot(self, adapter: str) -> int:
        """The slot of a resident adapter ("": the base model, 0)."""
        return self._adapters.resident[adapter] if adapter else 0

    def _make_resident(self, wanted: set[str]) -> None:
        """Write the adapters about to run that are not in a slot into one (evicting idle ones)."""
        for name in wanted:
            if name not in self._adapters.resident:
                self._place(name, self._busy_adapters() | wanted)
            self._adapters.touch(name)

    def _place(self, name: str, busy: frozenset[str] | set[str] = frozenset()) -> None:
        assert self._lora is not None
        slot = self._adapters.place(name, busy)
        self._prefix.forget(slot)  # rows kept from the adapter this slot held before
        self._lora.write(slot, self._adapters.registered[name])

    def _adapter_in(self, slot: int) -> str:
        """The name of the adapter in `slot` ("" for 0, the base model)."""
        return next((name for name, s in self._adapters.resident.items() if s == slot), "")

    def _busy_adapters(self) -> set[str]:
        """The adapters of the sequences that hold rows: running, prefilled in chunks or beside decode."""
        held = len(self._ids) + (self._staged is not None)
        if self._background is not None:
            held = self._background.first + len(self._background.new)
        slots = set(self._row_adapter[:held].tolist())
        return {name for name, slot in self._adapters.resident.items() if slot in slots}

    def _lora_span(self, rows: slice) -> tuple[int, int]:
        """The first and last slot the rows of a run use ((0, 0): none)."""
        slots = self._row_adapter[rows]
        used = slots[slots > 0]
        return (int(used.min()), int(used.max())) if used.size else (0, 0)

    def _lora_routes(self, rows: slice, tokens: int, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """The LoRA graph's inputs that route the tokens of a run over `rows` of `tokens` positions to the
        slots of `span` (lora.token_slots)."""
        if self._lora is None:
            return {}
        return token_slots(self._row_adapter[rows], tokens, span)

    def _bind_adapters(self, binding: Any, span: tuple[int, int]) -> None:
        """Bind the weights of the slots `span` ((0, 0): inputs of no length); rebound only when it changes.
        ONNX Runtime reads the arrays in place: a slot written later is read."""
        if self._lora is None or self._lora_bound.get(id(binding)) == span:
            return
        values = self._lora_values.get(span)
        if values is None:
            values = self._lora_values[span] = {
                name: ortvalue(a) for name, a in self._lora.span(*span).items()
            }
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        self._lora_bound[id(binding)] = span

    def _keep(self, row: int) -> None:
        """Offer a leaving row to the prefix cache, unless a failed step may have left it half written."""
        seq_id = self._ids[row]
        if seq_id in self._untrusted:
            self._untrusted.discard(seq_id)
            return
        length = int(self._prefilled[row])  # its prompt: the generated positions are not reused
        target = self._prefix.store(self._tokens[row, :length], int(self._row_adapter[row]))
        if target is not None:
            try:
                self._kv.copy_row(row, target, length)
                self._row_adapter[target] = self._row_adapter[row]
            except Exception:  # the row now holds neither its old tokens nor the new ones
                self._prefix.clear()
                raise

    def _move_row(self, src: int, dst: int, length: int) -> None:
        self._kv.copy_row(src, dst, length)
        self._lengths[dst] = self._lengths[src]
        self._prefilled[dst] = self._prefilled[src]
        self._row_adapter[dst] = self._row_adapter[src]
        self._tokens[dst, :length] = self._tokens[src, :length]

    def _binding(self, rows: slice, side: bool) -> Any:
        """The IOBinding of a row range, with its KV rows and logits bound once and reused; `side`: a
        prefill beside a decode step, which writes its own logits."""
        key = (rows.start, rows.stop, side)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self.session.io_binding()
            logits = self._side_logits if side else self._logits
            binding.bind_ortvalue_output("logits", ortvalue(logits[: rows.stop - rows.start]))
            self._kv.bind(binding, rows)
            self._bindings[key] = binding
        return binding

    def _emit(
        self,
        first_row: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        top: dict[int, Alternatives],
        notes: _Notes,
    ) -> list[TokenOut]:
        """`top` and `notes` are keyed by row index within `tokens`."""
        self._pending[first_row : first_row + len(tokens)] = tokens
        ids = self._ids[first_row:]
        # Python scalars in one call each (.tolist()), not a numpy scalar conversion per row.
        rows = zip(ids, tokens.tolist(), logprobs.tolist(), strict=True)
        if not top:
            outs = [TokenOut(seq_id, t, lp) for seq_id, t, lp in rows]
        else:
            outs = [TokenOut(seq_id, t, lp, top.get(i)) for i, (seq_id, t, lp) in enumerate(rows)]
        for i, (state, error) in notes.items():
            outs[i] = outs[i]._replace(constraint=state, error=error)
        return outs


def _draft_engine(bundle: Bundle, settings: EngineSettings) -> Engine:
    """The draft model's engine (one row, kept by speculation.DraftModel between two proposals), warmed
    up; BundleError for a draft that cannot propose for `bundle`'s model."""
    from serve.bundle import load_bundle

    path = settings.speculation.draft_bundle
    assert path is not None
    draft = load_bundle(Path(path))
    vocab, draft_vocab = bundle.manifest.architecture.vocab_size, draft.manifest.architecture.vocab_size
    if vocab != draft_vocab or bundle.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
        raise BundleError(
            f"{path}: the draft model's vocabulary ({draft_vocab} ids) is not the model's ({vocab} ids, "
            f"{bundle.root}): a draft must use the same tokenizer"
        )
    capacity = settings.capacity or bundle.manifest.architecture.context_length
    if draft.manifest.architecture.context_length < capacity:
        raise BundleError(
            f"{path}: the draft model's context ({draft.manifest.architecture.context_length} tokens) is "
            f"shorter than the model's KV rows ({capacity} tokens)"
        )
    engine = Engine.from_bundle(
        draft,
        EngineSettings(
            max_batch_size=1,
            capacity=capacity,
            session=settings.session,
            compiled_cache=settings.compiled_cache,
        ),
    )
    engine.warm_up()
    return engine


def _settle(joining: _Joining | None) -> None:
    """A join that failed: let its first masks' fill end (its thread holds the matchers until then)."""
    if joining is not None and joining.first_masks is not None:
        joining.first_masks.settle()


def _forks(new: Sequence[NewSequence]) -> dict[str, NewSequence]:
    """The sequences of a group that fork another of it (`NewSequence.fork_of`): same prompt, a parent that
    is no fork itself; by id, in the group's order."""
    by_id = {seq.seq_id: seq for seq in new}
    forks = {}
    for seq in new:
        parent = by_id.get(seq.fork_of) if seq.fork_of is not None else None
        if parent is not None and parent.fork_of is None and list(parent.prompt_ids) == list(seq.prompt_ids):
            forks[seq.seq_id] = seq
    return forks


def _reusable(hit: PrefixHit | None) -> int:
    return 0 if hit is None else hit.tokens


def open_engine(bundle: Bundle, settings: EngineSettings) -> Engine:
    """The bundle's engine, warmed up; BundleError for a bundle that cannot be served."""
    engine = Engine.from_bundle(bundle, settings)
    try:
        engine.warm_up()
    except Exception as exc:  # ONNX Runtime names a tensor, not the file; an operator needs both, on one line
        detail = " ".join(str(exc).split())
        raise BundleError(
            f"{bundle.inplace_graph}: the graph does not match the manifest's architecture (or cannot run "
            f"here): its first step failed: {type(exc).__name__}: {detail}"
        ) from exc
    trim_heap()
    log.info(
        "KV cache: %d rows (%d running, %d prefix cache) of %d tokens, %.1f MiB of %s on %s",
        engine.max_batch_size + engine.prefix_cache_rows,
        engine.max_batch_size,
        engine.prefix_cache_rows,
        engine.capacity,
        engine.kv_bytes / 2**20,
        engine.kv_dtype,
        engine.kv_device.type,
    )
    return engine

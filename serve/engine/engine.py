"""The generation engine: one prefill or one decode step at a time over a slot-based, in-place KV cache.

The cache (serve/engine/kv_cache.py: its buffers on the session's device, how a run binds rows and how a row
is copied) has `max_batch_size + prefix_cache_rows` rows of `capacity` tokens. Rows [0, n) hold the running
sequences; a prefill group is written straight into rows [n, n + k), a contiguous range, so joining copies
nothing. The rows past max_batch_size are the prefix cache's (serve/engine/prefix_cache.py).

`Engine` is one object over that cache, its methods grouped by concept in layers, each in its own module
(serve/engine/state.py draws them): adapters.py (LoRA residency and binding), rows.py (the rows' moves: forks,
release, swap out / swap in, prefix-cache copies), step.py (a run over rows; the decode and speculation
steps), prefill.py (prefill, chunked or beside decode steps). This module makes the engine from a bundle,
warms it up, and holds what the scheduler reads.

Not thread-safe: the scheduler calls it from its one engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Tokenizer

from serve.engine.constraints import ConstraintCompiler, ConstraintRows, MaskStats, MaskWorker
from serve.engine.kv_cache import KvCache
from serve.engine.lora.reading import model_names, read_adapter
from serve.engine.lora.residency import Residency
from serve.engine.lora.slots import LoraSlots, check_graph_inputs
from serve.engine.prefill import Prefills
from serve.engine.prefix_cache import PrefixCache
from serve.engine.prepared import engine_graphs
from serve.engine.prompt_scoring import PromptScorer, scoring_session
from serve.engine.runtime import (
    Device,
    InMemoryGraph,
    create_session,
    kv_device,
    session_device_id,
)
from serve.engine.sampling import SamplingBatch, SamplingParams
from serve.engine.speculation import DraftModel, Pace, PromptLookup, Proposer
from serve.engine.types import (
    EngineInfo,
    EngineSettings,
    ModelSpec,
    NewSequence,
)
from serve.engine.verify_graph import verification_graph
from serve.errors import BundleError
from serve.lora_layout import LoraLayout
from serve.process import trim_heap

if TYPE_CHECKING:
    from serve.bundle import Bundle


log = logging.getLogger("textgen.engine")

_NUMPY_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
}


class Engine(Prefills):
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
        lora: LoraLayout | None = None,  # the graph's LoRA branches (serve/engine/lora/); None: none
        # with `lora`: the serving graph without branches, which runs the steps with no adapter row; None:
        # the graph with branches runs them (on empty tensors)
        branch_free: str | InMemoryGraph | None = None,
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
        self._branch_free = None
        if branch_free is not None:
            if lora is None:
                raise ValueError("a branch-free graph is the serving graph of a LoRA bundle without branches")
            self._branch_free = self._branch_free_session(branch_free, settings, set(lora.input_shapes()))
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
        self._staged = None
        self._swapped = {}  # preempted sequences, by id, in the order they left
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
        self._background = None
        self.last_logits = self._logits[:0]
        # (first row, end row, side, on the branch-free session) -> its binding
        self._bindings: dict[tuple[int, int, bool, bool], Any] = {}

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
        branch_free = graphs.branch_free
        engine = cls(
            graph,
            bundle.tokenizer,
            spec,
            settings,
            graphs.scoring,
            proposer,
            verifier,
            m.lora,
            str(branch_free) if isinstance(branch_free, Path) else branch_free,
        )
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

    def _branch_free_session(
        self, graph: str | InMemoryGraph, settings: EngineSettings, lora: set[str]
    ) -> Any:
        """The branch-free graph's session; BundleError unless its inputs are the serving graph's but the
        `lora` ones, and its outputs the same (it binds the same KV buffers and logits)."""
        session = create_session(graph, settings.session)

        def names(s: Any) -> tuple[set[str], set[str]]:
            return {i.name for i in s.get_inputs()} - lora, {o.name for o in s.get_outputs()}

        if names(session) != names(self.session):
            where = graph if isinstance(graph, str) else str(graph.folder)
            raise BundleError(
                f"{where}: the serving graph without LoRA branches does not take the inputs and give the "
                "outputs of the graph with them (re-export the bundle)"
            )
        log.info("LoRA: steps with no adapter row run the serving graph without branches")
        return session

    def warm_up(self) -> None:
        """One prefill and one decode step on each serving session, so the first request does not pay for
        ONNX Runtime's lazy set-up; run before the scheduler starts, so no metric counts it as a request."""
        branch_free = self._branch_free
        if branch_free is not None:  # steps with no adapter row run it: the graph with branches first
            self._branch_free = None
            try:
                self._warm_up()
            finally:
                self._branch_free = branch_free
        self._warm_up()

    def _warm_up(self) -> None:
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

"""How many KV rows of how many tokens the server allocates: from `--max-model-len`, `--kv-cache-memory`,
`--max-batch-size` and `--prefix-cache-rows`, and the bundle's architecture.

A row holds one sequence: `max_model_len` tokens of K and V for every layer's key/value heads
(n_layers x 2 x n_kv_heads x head_dim elements a token, of the bundle's precision or --kv-cache-dtype's).
Without a memory budget the server allocates max_batch_size + prefix_cache_rows rows, whatever they take;
with one, as many as fit, running rows first (up to max_batch_size), then the prefix cache's. A draft model
(--speculative draft) is paid from the budget first: its weights and its own KV row of `max_model_len`
tokens, as its bundle stores them. A budget that holds no row at all refuses to start, saying what one row
takes.

What a pod serving a bundle needs (`pod_memory`; `textgen-serve --print-pod-memory`, docs/deploy.md): its
weights times a factor, plus the KV cache, plus a fixed part for the front end and the engine process's
runtime. Of a mixture of experts every expert's weights are resident (any token may take any expert), but a
position's activations are those of the experts it takes (`Architecture.token_ffn_width`), not of all.
The factors and the fixed part are fitted to the measurements of `textgen-bench served-memory`
(docs/benchmarks.md, "Memory and start-up against llama-server").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serve.api.config import ConfigError
from serve.bundle import Architecture, Manifest, graph_weight_bytes, serving_weight_bytes
from serve.engine.types import KV_CACHE_DTYPES, KvCacheDtype

# A model's full context (32k for Qwen2.5, 128k for Llama 3.1) times 20 rows is tens of GiB: serve a
# shorter one unless asked (--max-model-len).
DEFAULT_MAX_MODEL_LEN = 4096
ITEMSIZE = {"float32": 4, "float16": 2}
MIB = 2**20


def kv_itemsize(manifest: Manifest, kv_cache_dtype: KvCacheDtype = "auto") -> int:
    """Bytes of one KV cache element: --kv-cache-dtype's, or (auto) the bundle's own."""
    return ITEMSIZE[manifest.dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]]


@dataclass(frozen=True)
class WeightFactor:
    """Resident memory per byte of the weights a serving graph reads (`serve.bundle.graph_weight_bytes`):
    after start-up (a pod's request) and at the start-up peak (its limit)."""

    steady: float
    peak: float


# By the bundle's quantization (Manifest.quantization): what C-llama (373M) needed at fp32, int8 and int4,
# with rows of 256 and of 2,048 positions, with room for other CPUs' packed-weight layouts and for fp32's
# steady memory, which differed by ~300 MiB from one start to the next (`textgen-bench served-memory` prints
# what each run needs: steady fp32 0.95, int8 1.00, int4 1.17 on an AVX2 EPYC; docs/benchmarks.md, "Memory
# and start-up against llama-server"). Beside the weights a factor covers ONNX Runtime's buffers for a step's
# activations. A later start's peak is its steady memory (the prepared graph mapped, graphs read by their
# structure: serve/engine/graph_file.py); the first start on a node prepares the graph, holding the bundle's
# weights and their packed layout at once: fp32 1.33, int8 1.78, int4 1.93 there, which the limit covers.
WEIGHT_FACTORS = {
    "none": WeightFactor(steady=1.25, peak=1.45),
    "int8": WeightFactor(steady=1.55, peak=1.95),
    "int4": WeightFactor(steady=2.30, peak=2.30),
}
# What the front end and the engine process's Python, ONNX Runtime and libraries hold with no model to speak
# of: the demo model's 223 MiB (both processes and multiprocessing's resource tracker) and some room, as the
# figure differs a little from CPU to CPU and from one library version to another.
FIXED_BYTES = 288 * MIB


@dataclass(frozen=True)
class DraftCost:
    """What a draft model takes beside the model's KV rows."""

    weight_bytes: int  # what its serving graph reads (serve.bundle.graph_weight_bytes)
    kv_bytes_per_token: int  # of its one KV row

    def bytes(self, max_model_len: int) -> int:
        return self.weight_bytes + self.kv_bytes_per_token * max_model_len


@dataclass(frozen=True)
class KvSizing:
    max_model_len: int  # tokens per row
    max_batch_size: int  # running rows
    prefix_cache_rows: int
    row_bytes: int
    context_length: int  # the model's
    budget_bytes: int | None
    draft_bytes: int = 0  # paid from the budget before any row

    @property
    def total_bytes(self) -> int:
        return (self.max_batch_size + self.prefix_cache_rows) * self.row_bytes

    def describe(self) -> str:
        length = f"max_model_len {self.max_model_len}"
        if self.max_model_len < self.context_length:
            length += f" (of the model's {self.context_length}; --max-model-len sets it)"
        budget = "" if self.budget_bytes is None else f" of the {self.budget_bytes / MIB:.0f} MiB budget"
        if self.draft_bytes:
            budget += f", after {self.draft_bytes / MIB:.1f} MiB for the draft model's weights and KV row"
        return (
            f"KV cache: {length}, {self.row_bytes / MIB:.1f} MiB a row; {self.max_batch_size} running + "
            f"{self.prefix_cache_rows} prefix-cache rows = {self.total_bytes / MIB:.1f} MiB{budget}"
        )


def size_kv_cache(
    manifest: Manifest,
    max_model_len: int | None,
    kv_cache_memory: int | None,
    max_batch_size: int,
    prefix_cache_rows: int,
    draft: DraftCost | None = None,
    kv_cache_dtype: KvCacheDtype = "auto",
) -> KvSizing:
    """The rows to allocate; ConfigError when max_model_len exceeds the model or no row fits the budget."""
    arch = manifest.architecture
    context = arch.context_length
    if max_model_len is not None and max_model_len > context:
        raise ConfigError(
            f"max_model_len {max_model_len} exceeds the model's context length {context}; "
            f"give at most {context}"
        )
    length = max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    itemsize = kv_itemsize(manifest, kv_cache_dtype)
    row = arch.kv_bytes_per_token(itemsize) * length
    running, prefix = max_batch_size, prefix_cache_rows
    drafting = 0 if draft is None else draft.bytes(length)
    if kv_cache_memory is not None:
        rows = max(0, kv_cache_memory - drafting) // row
        if rows < 1:
            after = (
                f" after the draft model's {drafting / MIB:.1f} MiB (weights and KV row)" if drafting else ""
            )
            raise ConfigError(
                f"kv_cache_memory {kv_cache_memory / MIB:.1f} MiB holds no KV row{after}: one row of "
                f"{length} tokens takes {row / MIB:.1f} MiB ({arch.n_layers} layers x K,V x "
                f"{arch.n_kv_heads} heads x {arch.head_dim} x {itemsize} bytes a token); "
                "raise --kv-cache-memory or lower --max-model-len"
            )
        running = min(max_batch_size, rows)
        prefix = min(prefix_cache_rows, rows - running)
    return KvSizing(length, running, prefix, row, context, kv_cache_memory, drafting)


# Prompt logprobs run the standard graph on a whole prompt. What a position takes, in float32 elements: its
# logits three times (ONNX Runtime's output buffer, which its arena keeps for the next run; the array handed
# to numpy; the log-softmax's scratch), the keys and values of every layer the graph returns (twice: its
# buffer and numpy's), and one layer's activations, which the arena reuses from layer to layer (the MLP's
# hidden features, the residual stream's copies, a head's attention scores over the prompt). Fitted with
# room to what tests/api/test_pod_memory.py measures on the "small" preset: a 248-token scored prompt adds
# 32.7 MiB at fp32 (counted with the session: 48), 22-23 MiB at int8 (37).
SCORING_LOGITS_COPIES = 3
# A second session beside its packed weights: its graph, its arena's first chunk, its threads. The int8
# "small" preset's verification session took 7.0 MiB where its weights x 1.55 are 7.1.
SESSION_BYTES = 8 * MIB


def scoring_bytes_per_position(arch: Architecture, max_model_len: int) -> int:
    """The memory a scored prompt takes a position (above the scoring session's weights)."""
    kv_elements = arch.kv_bytes_per_token(1)
    layer = 4 * arch.token_ffn_width + 8 * arch.d_model + 2 * arch.n_heads * max_model_len
    return 4 * (SCORING_LOGITS_COPIES * arch.vocab_size + 4 * kv_elements + layer)


@dataclass(frozen=True)
class ServedFeatures:
    """What a server holds beside the serving graph and the KV rows, by the flags that turn it on."""

    speculative: bool = False  # --speculative: a session of the verification graph, its own packed weights
    prompt_logprobs: bool = False  # a session of the standard graph, created when a prompt is first scored
    registered_adapters: int = 0  # --max-cpu-loras, for a bundle with LoRA slots: adapters held in memory
    swap_bytes: int = 0  # --swap-space under the priority policy: preempted rows' keys and values
    # The prepared graph (the default on the CPU): a LoRA bundle's base-only steps then run a second,
    # branch-free session over the same weights
    prepared_graph: bool = False


@dataclass(frozen=True)
class MemoryPart:
    """Memory a pod needs beside the serving graph's weights, the KV cache and the fixed part."""

    what: str
    bytes: int


@dataclass(frozen=True)
class PodMemory:
    """The memory a pod serving one bundle needs: its request (the steady resident set) and its limit (the
    start-up peak), in whole MiB (Kubernetes' `Mi`), rounded up. A part the flags add is counted in both:
    the steady set holds it once it has been used."""

    weight_bytes: int
    kv_bytes: int
    factor: WeightFactor
    parts: tuple[MemoryPart, ...] = ()

    @property
    def request_mib(self) -> int:
        return self._mib(self.factor.steady)

    @property
    def limit_mib(self) -> int:
        return self._mib(self.factor.peak)

    def _mib(self, factor: float) -> int:
        extra = sum(part.bytes for part in self.parts)
        return -(-(int(self.weight_bytes * factor) + self.kv_bytes + extra + FIXED_BYTES) // MIB)

    def describe(self) -> str:
        weights = f"{self.weight_bytes / MIB:.1f} MiB weights"
        parts = "".join(f" + {part.bytes / MIB:.1f} MiB {part.what}" for part in self.parts)
        rest = f"{self.kv_bytes / MIB:.1f} MiB KV cache{parts} + {FIXED_BYTES // MIB} MiB fixed"
        return (
            f"requests.memory: {self.request_mib}Mi = {weights} x {self.factor.steady} + {rest}\n"
            f"limits.memory: {self.limit_mib}Mi = {weights} x {self.factor.peak} + {rest}"
        )


def pod_memory(
    root: Path, manifest: Manifest, kv: KvSizing, features: ServedFeatures = ServedFeatures()
) -> PodMemory:
    """What a pod serving the bundle at `root` with the KV rows `kv` and `features` needs (a draft model's
    weights and row counted with the KV cache)."""
    factor = WEIGHT_FACTORS[manifest.quantization]
    weights = serving_weight_bytes(root, manifest)
    parts = feature_parts(root, manifest, kv, features, factor)
    return PodMemory(weights, kv.total_bytes + kv.draft_bytes, factor, parts)


def feature_parts(
    root: Path, manifest: Manifest, kv: KvSizing, features: ServedFeatures, factor: WeightFactor
) -> tuple[MemoryPart, ...]:
    """The memory each feature the flags turn on adds. A second session of a graph packs its own copy of the
    weights, so it costs what the serving graph's weights cost (the same factor), and a session's own."""
    parts = []
    if features.speculative:
        verifying = int(serving_weight_bytes(root, manifest) * factor.steady) + SESSION_BYTES
        parts.append(MemoryPart("verification session (--speculative)", verifying))
    if features.prompt_logprobs:
        standard = graph_weight_bytes(root, manifest.graphs.standard)
        prompt = kv.max_model_len * scoring_bytes_per_position(manifest.architecture, kv.max_model_len)
        session = int(standard * factor.steady) + SESSION_BYTES
        parts.append(MemoryPart("prompt-logprobs session and prompt", session + prompt))
    if manifest.lora is not None:
        parts.append(MemoryPart(f"{manifest.lora.slots} LoRA slots", manifest.lora.slots_bytes))
        if features.prepared_graph and manifest.graphs.inplace_base is not None:
            branch_free = int(serving_weight_bytes(root, manifest) * factor.steady) + SESSION_BYTES
            parts.append(MemoryPart("branch-free session (base-only steps)", branch_free))
        if features.registered_adapters:
            held = features.registered_adapters * manifest.lora.max_adapter_bytes
            parts.append(MemoryPart(f"{features.registered_adapters} registered adapters", held))
    if features.swap_bytes:
        parts.append(MemoryPart("swapped rows (--swap-space)", features.swap_bytes))
    return tuple(parts)

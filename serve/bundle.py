"""The model bundle: a directory the server loads with nothing else, described by a validated manifest.

Layout (written by `export.bundle_writer`):
    manifest.json          this module's `Manifest`
    model.onnx             the standard graph (portable ops; the TensorRT graph), without its weights
    model_inplace.onnx     the in-place GroupQueryAttention serving graph (ONNX Runtime CPU/CUDA), the same
    model_inplace_base.onnx  a LoRA bundle's serving graph without its branches, for steps with no adapter
                           row (older LoRA bundles have none), the same
    weights.data           both graphs' weights, each distinct tensor once (older bundles have no such
                           file: each graph embeds its own weights)
    tokenizer.json         the `tokenizers` tokenizer (its post-processor adds what encoding a text adds)

Format versions: 2 (written now) adds grouped-query attention (`n_kv_heads`), a head_dim not tied to
d_model / n_heads, the blocks of imported models (norm, activation, sliding window), several EOS ids, the BOS
id and a chat template; later (still format 2, optional fields) 4-bit weights, the quantization block size
and whether the bundle is batch invariant. A version 1 manifest (the decoder of this project only) is read
by its own model, `ManifestV1`, exactly as before, and converted to a `Manifest` whose `format_version`
stays 1.

`load_bundle` refuses anything it cannot serve with a `BundleError` naming the file and the problem, so a
bad bundle fails at start-up with one line instead of at the first request. A graph's files are checked
against the manifest's sha256 when the graph is first asked for (`Bundle.inplace_graph`, `standard_graph`),
in the process that opens it: the server opens its serving graph at start, and hashing gigabytes of graphs
it does not open (the standard graph serves prompt logprobs only) would only delay it. Runtime side only: no
torch, no onnx package.

Just over 400 lines: the manifest's fields and their checks are one format, the one the exporter writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_validator,
)
from tokenizers import Tokenizer

from serve.errors import BundleError
from serve.lora_layout import LoraLayout
from serve.onnx_fields import external_data_bytes

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_FILE = "manifest.json"
_CHUNK = 1 << 20


class _Strict(BaseModel):
    # A misspelt key is a bug in whoever wrote the manifest: refuse it rather than silently use a default.
    model_config = ConfigDict(extra="forbid", frozen=True)


class ArchitectureV1(_Strict):
    """Format 1's architecture: multi-head attention over d_model = n_heads x head_dim."""

    vocab_size: PositiveInt
    context_length: PositiveInt
    d_model: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    head_dim: PositiveInt
    d_ff: PositiveInt
    positions: Literal["learned", "sinusoidal", "rotary"]
    activation: Literal["gelu", "relu"]

    @model_validator(mode="after")
    def _heads_fit(self) -> ArchitectureV1:
        if self.n_heads * self.head_dim != self.d_model:
            raise ValueError(
                f"n_heads ({self.n_heads}) x head_dim ({self.head_dim}) must equal d_model ({self.d_model})"
            )
        return self


class Architecture(_Strict):
    """What sizes the KV cache (n_layers x n_kv_heads x head_dim per token) and what the server reports."""

    vocab_size: PositiveInt
    context_length: PositiveInt
    d_model: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt  # query heads
    n_kv_heads: PositiveInt  # key/value heads (the KV cache's); fewer than n_heads: grouped-query attention
    head_dim: PositiveInt  # n_heads x head_dim need not be d_model (Qwen3)
    d_ff: PositiveInt
    positions: Literal["learned", "sinusoidal", "rotary"]
    activation: Literal["gelu", "relu", "gelu_tanh", "swiglu", "geglu"]
    norm: Literal["layer", "rms"] = "layer"
    sliding_window: NonNegativeInt = 0  # a query sees the last W keys; 0: all of them
    # A mixture of experts (export/moe.py): `sparse_layers` of the layers route each token to `experts_top_k`
    # of `n_experts` SwiGLU experts of width `expert_d_ff`; the others keep the dense d_ff MLP. 0: dense.
    n_experts: NonNegativeInt = 0
    experts_top_k: NonNegativeInt = 0
    expert_d_ff: NonNegativeInt = 0
    sparse_layers: NonNegativeInt = 0

    @model_validator(mode="before")
    @classmethod
    def _kv_heads_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("n_kv_heads") is None and "n_heads" in data:
            return {**data, "n_kv_heads": data["n_heads"]}
        return data

    @model_validator(mode="after")
    def _heads_group(self) -> Architecture:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads ({self.n_kv_heads}) must divide n_heads ({self.n_heads})")
        return self

    @model_validator(mode="after")
    def _experts_fit(self) -> Architecture:
        if self.n_experts and not 0 < self.experts_top_k <= self.n_experts:
            raise ValueError(
                f"experts_top_k ({self.experts_top_k}) must be in 1..n_experts ({self.n_experts})"
            )
        if self.sparse_layers > self.n_layers:
            raise ValueError(f"sparse_layers ({self.sparse_layers}) exceeds n_layers ({self.n_layers})")
        return self

    @property
    def token_ffn_width(self) -> int:
        """The widest feed-forward activation one token computes in a layer: its top-k experts' (and the
        router's logits) in a sparse layer, d_ff in a dense one. A step's activations follow the experts a
        token takes, not the total parameters."""
        sparse = self.experts_top_k * self.expert_d_ff + self.n_experts if self.sparse_layers else 0
        dense = self.d_ff if self.sparse_layers < self.n_layers else 0
        return max(sparse, dense)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV cache bytes one token takes: K and V of every layer's key/value heads."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


def _plain_file_name(name: str) -> str:
    # Bundle files live directly in the bundle directory: no paths that could escape it.
    if not name or PurePosixPath(name).name != name or name in (".", ".."):
        raise ValueError(f"{name!r} must be a plain file name inside the bundle directory")
    return name


class GraphSpec(_Strict):
    file: str
    external_data: str | None = None  # the weights' file; None: embedded in `file` (older bundles)
    inputs: list[str] = Field(min_length=1)
    outputs: list[str] = Field(min_length=1)
    opset: PositiveInt

    @model_validator(mode="after")
    def _plain_names(self) -> GraphSpec:
        _plain_file_name(self.file)
        if self.external_data is not None:
            _plain_file_name(self.external_data)
        return self

    def files(self) -> list[str]:
        return [self.file] + ([self.external_data] if self.external_data else [])


class Graphs(_Strict):
    standard: GraphSpec  # input_ids, attention_mask, position_ids, past_key_values.* (concatenating)
    inplace: GraphSpec | None = None  # GroupQueryAttention with bound KV buffers; None: standard graph only
    # A LoRA bundle's serving graph without the branches (what a bundle without slots serves), over the same
    # weights: the steps with no adapter row run it. None: no LoRA slots, or a bundle exported before it.
    inplace_base: GraphSpec | None = None


class ShapeRange(_Strict):
    min: NonNegativeInt
    opt: NonNegativeInt
    max: PositiveInt

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}, {self.opt}, {self.max}")
        return self


class TensorRTProfile(_Strict):
    """Optimization-profile ranges of the standard graph's dynamic axes."""

    batch: ShapeRange
    seq: ShapeRange
    past: ShapeRange


class TensorRTSettings(_Strict):
    profile: TensorRTProfile
    fp16: bool = False
    int8: bool = False
    engine_cache_dir: str = "trt_engines"  # relative: resolved against a directory the server may write

    def provider_options(self, arch: Architecture, cache_root: Path) -> dict[str, str]:
        """Options for ONNX Runtime's TensorrtExecutionProvider running the standard graph."""
        return {
            "trt_fp16_enable": str(self.fp16),
            "trt_int8_enable": str(self.int8),
            "trt_engine_cache_enable": "True",
            "trt_engine_cache_path": str(cache_root / self.engine_cache_dir),
            "trt_profile_min_shapes": self._shapes(arch, "min"),
            "trt_profile_opt_shapes": self._shapes(arch, "opt"),
            "trt_profile_max_shapes": self._shapes(arch, "max"),
        }

    def _shapes(self, arch: Architecture, which: Literal["min", "opt", "max"]) -> str:
        p = self.profile
        b, s, past = (getattr(r, which) for r in (p.batch, p.seq, p.past))
        shapes = {
            "input_ids": (b, s),
            "attention_mask": (b, past + s),
            "position_ids": (b, s),
            **{
                f"past_key_values.{i}.{kind}": (b, arch.n_kv_heads, past, arch.head_dim)
                for i in range(arch.n_layers)
                for kind in ("key", "value")
            },
        }
        return ",".join(f"{name}:{'x'.join(map(str, dims))}" for name, dims in shapes.items())


def _check_files(tokenizer: str, files: list[str], checksums: dict[str, str]) -> None:
    _plain_file_name(tokenizer)
    unlisted = sorted(set(files) - set(checksums))
    if unlisted:
        raise ValueError(f"files without a checksum: {unlisted}")
    for name, digest in checksums.items():
        _plain_file_name(name)
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"checksum of {name!r} is not a lowercase sha256 hex digest")


def _graph_files(graphs: Graphs) -> list[str]:
    specs = [graphs.standard, *(g for g in (graphs.inplace, graphs.inplace_base) if g is not None)]
    return [f for g in specs for f in g.files()]


# The names of the nodes and constants export's row pad adds (export/row_pad.py): tensors computed on padded
# rows are named `{real name}_{ROW_PAD_PREFIX}`; the engine takes them out where its CPU does not need them
# (serve/engine/row_pad.py).
ROW_PAD_PREFIX = "single_row_pad"


class Manifest(_Strict):
    # 2 for every manifest written now; 1 for one read from a format 1 file (ManifestV1.upgraded).
    format_version: Literal[1, 2]
    model_name: str = Field(min_length=1)
    architecture: Architecture
    graphs: Graphs
    dtype: Literal["float32", "float16"]
    quantization: Literal["none", "int8", "int4"]
    # Weights per scale of ONNX Runtime's MatMulNBits; None: float, or INT8 by dynamic quantization.
    quantization_block_size: PositiveInt | None = None
    # Whether a request's tokens are the same whatever it is batched with (export.verify checks it). A
    # manifest written before the field: float bundles were verified so, dynamic INT8 ones were not.
    batch_invariant: bool
    # MatMulNBits graphs that run every row count even (export.quantize.pad_single_rows), for the blocks
    # at which whether a lone row takes another kernel depends on the CPU serving them. A MatMulNBits
    # bundle written before the field was padded at no block, verified on its export machine only, and is
    # not claimed batch invariant.
    odd_rows_padded: bool = False
    # Every one ends a generation (Llama 3 lists several); the first is the one reported as eos_token_id.
    eos_token_ids: list[NonNegativeInt] = Field(min_length=1)
    # What a chat template calls bos_token; a text's BOS is added by the tokenizer itself (tokenizer.json's
    # post-processor), so serving needs no more of it. None: the model has none.
    bos_token_id: NonNegativeInt | None = None
    pad_token_id: NonNegativeInt
    tokenizer: str = "tokenizer.json"
    execution_providers: list[str] = Field(min_length=1)  # recommended, best first
    tensorrt: TensorRTSettings
    verification: dict[str, Any] = Field(default_factory=dict)  # export.verify's report, as written
    # Jinja source that renders chat messages as the prompt (transformers' chat_template); None: the bundle
    # serves no chat (bundles written before this field keep loading without it).
    chat_template: str | None = Field(None, min_length=1)
    # The serving graph's LoRA branches (export --lora-slots); None: it has none.
    lora: LoraLayout | None = None
    checksums: dict[str, str]  # file name -> sha256 hex, for every file but the manifest

    @model_validator(mode="before")
    @classmethod
    def _batch_invariant_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "batch_invariant" not in data:
            data = {**data, "batch_invariant": data.get("quantization") == "none"}
        if data.get("quantization_block_size") is not None and "odd_rows_padded" not in data:
            data = {**data, "batch_invariant": False}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        vocab = self.architecture.vocab_size
        named = {"eos_token_ids": self.eos_token_ids, "pad_token_id": [self.pad_token_id]}
        if self.bos_token_id is not None:
            named["bos_token_id"] = [self.bos_token_id]
        for name, ids in named.items():
            if max(ids) >= vocab:
                raise ValueError(f"{name} ({max(ids)}) must be below vocab_size ({vocab})")
        if len(set(self.eos_token_ids)) != len(self.eos_token_ids):
            raise ValueError(f"eos_token_ids {self.eos_token_ids} lists an id twice")
        if self.graphs.inplace_base is not None and (self.lora is None or self.graphs.inplace is None):
            raise ValueError(
                "graphs.inplace_base is a LoRA bundle's serving graph without its branches: "
                "it needs lora and graphs.inplace"
            )
        _check_files(self.tokenizer, self.files(), self.checksums)
        return self

    @property
    def eos_token_id(self) -> int:
        """The first EOS id (format 1's only one)."""
        return self.eos_token_ids[0]

    def files(self) -> list[str]:
        """Every file the bundle needs besides the manifest."""
        return [*_graph_files(self.graphs), self.tokenizer]


class ManifestV1(_Strict):
    """A format 1 manifest, validated as format 1 was; `upgraded()` is the same bundle as a `Manifest`."""

    format_version: Literal[1]
    model_name: str = Field(min_length=1)
    architecture: ArchitectureV1
    graphs: Graphs
    dtype: Literal["float32", "float16"]
    quantization: Literal["none", "int8"]
    eos_token_id: NonNegativeInt
    pad_token_id: NonNegativeInt
    tokenizer: str = "tokenizer.json"
    execution_providers: list[str] = Field(min_length=1)
    tensorrt: TensorRTSettings
    verification: dict[str, Any] = Field(default_factory=dict)  # export.verify's report, as written
    # Jinja source that renders chat messages as the prompt (transformers' chat_template); None: the bundle
    # serves no chat (bundles written before this field keep loading without it).
    chat_template: str | None = Field(None, min_length=1)
    checksums: dict[str, str]  # file name -> sha256 hex, for every file but the manifest

    @model_validator(mode="after")
    def _consistent(self) -> ManifestV1:
        vocab = self.architecture.vocab_size
        for name in ("eos_token_id", "pad_token_id"):
            if getattr(self, name) >= vocab:
                raise ValueError(f"{name} ({getattr(self, name)}) must be below vocab_size ({vocab})")
        _check_files(self.tokenizer, [*_graph_files(self.graphs), self.tokenizer], self.checksums)
        return self

    def upgraded(self) -> Manifest:
        fields = self.model_dump(exclude={"eos_token_id", "architecture"})
        architecture = {**self.architecture.model_dump(), "n_kv_heads": self.architecture.n_heads}
        return Manifest.model_validate(
            {**fields, "architecture": architecture, "eos_token_ids": [self.eos_token_id]}
        )


@dataclass(frozen=True)
class Bundle:
    """A loaded bundle: its manifest and tokenizer, checked. Each graph's files are checked the first time the
    graph is asked for (BundleError: changed or truncated since export), once per `Bundle`."""

    root: Path
    manifest: Manifest
    tokenizer: Tokenizer
    _checked: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def standard_graph(self) -> Path:
        return self.checked_graph(self.manifest.graphs.standard)

    @property
    def inplace_graph(self) -> Path | None:
        spec = self.manifest.graphs.inplace
        return self.checked_graph(spec) if spec else None

    def checked_graph(self, spec: GraphSpec) -> Path:
        """The graph's file, once its files (the .onnx file and any external data) match the manifest."""
        self.check_files(spec.files())
        return self.path(spec.file)

    def check_files(self, names: list[str] | None = None) -> None:
        """BundleError unless the files `names` (default: every file the manifest lists) have the sha256 the
        manifest lists; each file is hashed once per `Bundle`."""
        for name in self.manifest.checksums if names is None else names:
            if name not in self._checked:
                _verify_file(self.root, name, self.manifest.checksums[name])
                self._checked.add(name)

    def tensorrt_options(self, cache_root: Path | None = None) -> dict[str, str]:
        """TensorRT provider options; the engine cache goes under `cache_root` (default: the bundle dir)."""
        return self.manifest.tensorrt.provider_options(self.manifest.architecture, cache_root or self.root)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(root: Path) -> Manifest:
    """Parse and validate `root/manifest.json` (no file checks)."""
    if not root.is_dir():
        raise BundleError(f"{root}: bundle directory does not exist (export one with `textgen-export`)")
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise BundleError(f"{path}: manifest missing; is {root} a bundle written by `textgen-export`?")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path}: not readable JSON: {exc}") from exc
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if version not in READABLE_VERSIONS or isinstance(version, bool):
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise BundleError(
            f"{path}: unsupported bundle format version {version!r} (this server reads {readable}); "
            "re-export the model with this version's `textgen-export`"
        )
    try:
        if version == 1:
            return ManifestV1.model_validate(raw).upgraded()
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise BundleError(f"{path}: invalid manifest: {exc}") from exc


def _listed_file(root: Path, name: str) -> Path:
    path = root / name
    if not path.is_file():
        raise BundleError(f"{path}: file listed in the manifest is missing; re-export the bundle")
    return path


def _verify_file(root: Path, name: str, expected: str) -> None:
    """BundleError unless `root/name` has the sha256 the manifest lists for it."""
    path = _listed_file(root, name)
    actual = sha256_file(path)
    if actual != expected:
        raise BundleError(
            f"{path}: checksum mismatch (manifest sha256 {expected[:12]}…, file {actual[:12]}…): "
            "the file was changed or truncated after export; re-export the bundle"
        )


def graph_weight_bytes(root: Path, spec: GraphSpec) -> int:
    """Bytes of the weights one graph reads, as stored: its file (its structure, and its weights where it
    embeds them) and, of an external data file, the tensors it references there; the data file both graphs
    share also holds tensors only the other one reads (a quantized mixture of experts: its serving graph's
    experts in QMoE layout, its standard graph's as MatMulNBits). Reads the graph's headers, not its
    weights, and no checksum."""
    path = root / spec.file
    total = path.stat().st_size
    if spec.external_data is None:
        return total
    try:
        referenced = external_data_bytes(path)
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not a readable ONNX graph: {exc}") from exc
    # A reference without a length runs to its file's end: the whole file, at most.
    return total + sum(
        (root / name).stat().st_size if length is None else length for name, length in referenced.items()
    )


def serving_weight_bytes(root: Path, manifest: Manifest) -> int:
    """Bytes of the weights a bundle's serving graph reads, as stored (`graph_weight_bytes`): what loading
    it takes, at least."""
    return graph_weight_bytes(root, manifest.graphs.inplace or manifest.graphs.standard)


def load_bundle(path: Path | str) -> Bundle:
    """Load and validate a bundle directory: the manifest, every file present, the tokenizer (checked against
    its checksum); each graph is checked when first asked for (`Bundle.checked_graph`)."""
    root = Path(path)
    manifest = read_manifest(root)
    for name in manifest.checksums:
        _listed_file(root, name)
    _verify_file(root, manifest.tokenizer, manifest.checksums[manifest.tokenizer])
    tok_path = root / manifest.tokenizer
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise BundleError(f"{tok_path}: not a valid tokenizers file: {exc}") from exc
    if tokenizer.get_vocab_size() > manifest.architecture.vocab_size:
        raise BundleError(
            f"{tok_path}: tokenizer has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
            f"{manifest.architecture.vocab_size}"
        )
    return Bundle(root=root, manifest=manifest, tokenizer=tokenizer)

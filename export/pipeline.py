"""Checkpoint (or in-memory model) -> verified bundle: the steps behind `textgen-export onnx/hf/demo/random`.

trace the standard graph -> write the in-place serving graph -> [INT8 | INT4 | FP16] -> stage the bundle ->
verify it (export.verify) -> write the report into the manifest -> rename into place. A bundle that fails
verification is never put in place. Each graph is written into the staged bundle as soon as it is built and
then dropped, so a model's weights are in memory at most three times over (the decoder, the graph being
built, and its serialization), not once per graph more.

`export_hf` does the same for a Hugging Face folder (export/hf_import.py), verified against transformers.
"""

from __future__ import annotations

import ctypes
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnx
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from export.bundle_writer import BundleStage, check_replaceable
from export.checkpoint import load_checkpoint
from export.demo import DEMO_CHAT_TEMPLATE, demo_bundle_path, ensure_demo_checkpoint, exclusive_lock
from export.fp16 import convert_fp16
from export.hf_import import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    HFImportError,
    adapter_names,
    checkpoint_modules,
    import_checkpoint,
    locate_model,
)
from export.lora import AdapterNames, LoraOptions, ModuleMap, lora_layout, own_modules
from export.model import Decoder, DecoderConfig
from export.onnx_inplace import OPSET as INPLACE_OPSET
from export.onnx_inplace import build_inplace_graph
from export.onnx_standard import DEFAULT_OPSET, export_standard_graph
from export.quantize import (
    DEFAULT_BLOCK_SIZE,
    batch_invariant_scheme,
    check_block_size,
    pads_rows,
    quantize_int8,
    quantize_nbits,
)
from export.tokenizer import EOS_ID, PAD_ID, tokenizer_to_json, train_tokenizer
from export.train import load_corpus
from export.verify import Reference, VerificationFailed, verify_bundle
from serve.bundle import (
    FORMAT_VERSION,
    Bundle,
    GraphSpec,
    ShapeRange,
    TensorRTProfile,
    TensorRTSettings,
    load_bundle,
    sha256_file,
)
from serve.errors import BundleError
from serve.lora_layout import LoraLayout

STANDARD_FILE = "model.onnx"
INPLACE_FILE = "model_inplace.onnx"
# A LoRA bundle's serving graph without the branches: the steps with no adapter row run it (serve/engine/).
INPLACE_BASE_FILE = "model_inplace_base.onnx"
TRT_MAX_BATCH = 16  # the engine's default slot count
TRT_OPT_BATCH = 8
PRESETS = {
    # The engine benchmark's shape (GPT-2 small-ish, ~30M parameters).
    "bench-a": DecoderConfig(
        vocab_size=8192, context_length=1024, d_model=512, n_layers=8, n_heads=8, d_ff=2048
    ),
    # For tests that measure memory: 16 MiB of fp32 weights, so a second copy stands out of the noise.
    "small": DecoderConfig(
        vocab_size=2048, context_length=256, d_model=256, n_layers=4, n_heads=4, d_ff=1024
    ),
    # For fast tests of the exporter and of everything that serves a bundle.
    "tiny": DecoderConfig(vocab_size=320, context_length=128, d_model=32, n_layers=2, n_heads=2, d_ff=64),
}
PRESET_TOKENIZER_TEXT_BYTES = 300_000  # of stdlib source: a few seconds of BPE training


PrecisionKind = Literal["fp32", "fp16", "int8", "int8-dynamic", "int4"]
_BITS = {"int8": 8, "int8-dynamic": 8, "int4": 4}


@dataclass(frozen=True)
class Precision:
    """What the weights become: float32, float16 (CUDA/TensorRT), or quantized for the CPU
    (export/quantize.py: MatMulNBits at 8 or 4 bits, or dynamic INT8)."""

    kind: PrecisionKind = "fp32"
    block_size: int | None = None  # MatMulNBits' weights per scale (int8, int4); None: the kind's default

    def __post_init__(self) -> None:
        if self.block_size is not None:
            if self.kind not in ("int8", "int4"):
                raise ValueError("--block-size applies to --int8 and --int4 (MatMulNBits) only")
            check_block_size(self.block_size)

    @property
    def bits(self) -> int | None:
        return _BITS.get(self.kind)

    @property
    def block(self) -> int | None:
        """The MatMulNBits block size; None for float and dynamic INT8."""
        if self.kind not in ("int8", "int4"):
            return None
        return self.block_size or DEFAULT_BLOCK_SIZE[_BITS[self.kind]]

    @property
    def quantization(self) -> Literal["none", "int8", "int4"]:
        return "int4" if self.kind == "int4" else "int8" if self.bits == 8 else "none"

    @property
    def fp16(self) -> bool:
        return self.kind == "fp16"

    @property
    def batch_invariant(self) -> bool:
        return batch_invariant_scheme(self.bits, self.block)

    @property
    def pads_odd_rows(self) -> bool:
        """Whether quantize_nbits pads the MatMulNBits' odd row counts (export.row_pad.pad_single_rows)."""
        return self.bits is not None and self.block is not None and pads_rows(self.bits, self.block)


@dataclass(frozen=True)
class ExportOptions:
    model_name: str
    opset: int = DEFAULT_OPSET
    precision: Precision = Precision()
    progress: bool = True
    source: dict[str, str] | None = None  # where the weights came from (checkpoint, preset), for the report
    chat_template: str | None = None  # the manifest's chat_template (Jinja); None: the bundle serves no chat
    # The model's special tokens (defaults: this project's tokenizer, export/tokenizer.py).
    eos_token_ids: tuple[int, ...] = (EOS_ID,)
    pad_token_id: int = PAD_ID
    bos_token_id: int | None = None
    eval_text: str | None = None  # held-out text for the quantized bundle's perplexity (default: stdlib's)
    lora: LoraOptions | None = None  # LoRA slots in the serving graph (export/lora.py); None: none
    # The checkpoint's modules each projection is made of, as adapters name them; None: ours (own_modules).
    lora_modules: ModuleMap | None = None
    lora_names: AdapterNames | None = None  # what else adapters of the checkpoint may name

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError("a bundle needs at least one EOS token id")
        if self.lora is not None and self.precision.kind not in ("fp32", "int8", "int4"):
            raise ValueError(
                f"LoRA slots are exported at float32, --int8 and --int4, not {self.precision.kind}: its "
                "graphs would not keep the adapters' branches apart from the base weights"
            )

    def lora_layout(self, cfg: DecoderConfig) -> LoraLayout | None:
        if self.lora is None:
            return None
        return lora_layout(cfg, self.lora_modules or own_modules(cfg), self.lora, self.lora_names)


def tensorrt_settings(cfg: DecoderConfig, fp16: bool) -> TensorRTSettings:
    """Profile: prefill (past 0, seq up to the context) through decode (seq 1, past up to context - 1)."""
    ctx = cfg.context_length
    return TensorRTSettings(
        profile=TensorRTProfile(
            batch=ShapeRange(min=1, opt=TRT_OPT_BATCH, max=TRT_MAX_BATCH),
            seq=ShapeRange(min=1, opt=1, max=ctx),
            past=ShapeRange(min=0, opt=ctx // 2, max=ctx - 1),
        ),
        fp16=fp16,
        # Quantized bundles use ONNX Runtime's CPU kernels; TensorRT INT8 would need calibration.
        int8=False,
    )


def _providers(options: ExportOptions) -> list[str]:
    if options.precision.bits:  # quantized for the CPU's integer kernels
        return ["CPUExecutionProvider"]
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    return gpu if options.precision.fp16 else [*gpu, "CPUExecutionProvider"]


def architecture_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The manifest's architecture (serve/bundle.py's Architecture) of a decoder."""
    return {
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length,
        "d_model": cfg.d_model,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "d_ff": cfg.d_ff,
        "positions": cfg.positions,
        "activation": cfg.activation,
        "norm": cfg.norm,
        "sliding_window": cfg.sliding_window,
        **_experts_fields(cfg),
    }


def _experts_fields(cfg: DecoderConfig) -> dict[str, int]:
    """A mixture of experts' part of the manifest's architecture (none for a dense model)."""
    experts = cfg.experts
    if experts is None:
        return {}
    return {
        "n_experts": experts.n_experts,
        "experts_top_k": experts.top_k,
        "expert_d_ff": experts.d_ff,
        "sparse_layers": sum(cfg.sparse(i) for i in range(cfg.n_layers)),
    }


def _manifest_fields(cfg: DecoderConfig, options: ExportOptions, graphs: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "model_name": options.model_name,
        "architecture": architecture_fields(cfg),
        "graphs": graphs,
        "dtype": "float16" if options.precision.fp16 else "float32",
        "quantization": options.precision.quantization,
        "quantization_block_size": options.precision.block,
        "odd_rows_padded": options.precision.pads_odd_rows,
        "eos_token_ids": list(options.eos_token_ids),
        "bos_token_id": options.bos_token_id,
        "pad_token_id": options.pad_token_id,
        "execution_providers": _providers(options),
        "tensorrt": tensorrt_settings(cfg, options.precision.fp16),
        **({"chat_template": options.chat_template} if options.chat_template is not None else {}),
        **({"lora": layout.model_dump()} if (layout := options.lora_layout(cfg)) is not None else {}),
    }


def _return_freed_memory() -> None:
    """Collect the dropped objects and hand the heap's free pages back to the OS. glibc keeps freed blocks
    in its heap for reuse, and a graph's weights are mostly blocks under its mmap threshold (which grows to
    32 MiB): measured on a 373M-parameter import, 1.4 GiB stayed resident after its graphs were dropped,
    under the transformers model loaded next. Elsewhere (no glibc) only the collection runs."""
    gc.collect()  # the tracer's and the quantizer's objects hold references to weights in cycles
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class _Progress:
    def __init__(self, enabled: bool, total: int) -> None:
        self._bar = tqdm(total=total, disable=not enabled, unit="step", leave=False)

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        self._bar.set_description(what)
        yield
        self._bar.update()

    def close(self) -> None:
        self._bar.close()


@dataclass(frozen=True)
class ExportedGraphs:
    standard: onnx.ModelProto
    inplace: onnx.ModelProto
    stats: dict[str, Any]  # trace time, quantized MatMul counts: into the report
    inplace_base: onnx.ModelProto | None = None  # a LoRA bundle's serving graph without its branches


def _convert(
    role: str, graph: onnx.ModelProto, options: ExportOptions, progress: _Progress, stats: dict[str, Any]
) -> onnx.ModelProto:
    precision = options.precision
    if precision.kind == "int8-dynamic":
        with progress.step(f"INT8 dynamic quantization ({role} graph)"):
            graph, stats[f"int8_{role}"] = quantize_int8(graph)
    elif precision.bits and precision.block:
        with progress.step(f"{precision.kind.upper()} MatMulNBits, block {precision.block} ({role} graph)"):
            # The float graph is dropped once quantized: quantized in place, its weights are not copied.
            graph, stats[f"{precision.kind}_{role}"] = quantize_nbits(
                graph, precision.bits, precision.block, in_place=True
            )
    if precision.fp16:
        with progress.step(f"FP16 conversion ({role} graph)"):
            graph = convert_fp16(graph)
    return graph


def _built(role: str, model: Decoder, options: ExportOptions, stats: dict[str, Any]) -> onnx.ModelProto:
    if role == "standard":
        started = time.perf_counter()
        graph = export_standard_graph(model, options.opset)
        stats["trace_seconds"] = round(time.perf_counter() - started, 1)
        return graph
    if role == "inplace_base":  # the same graph as without slots: its weights are the LoRA graph's, shared
        return build_inplace_graph(model)
    started = time.perf_counter()
    graph = build_inplace_graph(model, options.lora_layout(model.cfg))
    stats["inplace_build_seconds"] = round(time.perf_counter() - started, 1)
    return graph


_STEPS = {
    "standard": "tracing the standard graph (torch.onnx dynamo)",
    "inplace": "writing the serving graph",
    "inplace_base": "writing the serving graph without LoRA branches",
}


def _roles(options: ExportOptions) -> tuple[str, ...]:
    """The graphs a bundle of `options` holds, as Graphs names them."""
    return ("standard", "inplace", "inplace_base") if options.lora is not None else ("standard", "inplace")


def _add_graph(stage: BundleStage, role: str, graph: onnx.ModelProto, options: ExportOptions) -> GraphSpec:
    if role == "standard":
        return stage.add_graph(STANDARD_FILE, graph, options.opset)
    return stage.add_graph(
        INPLACE_BASE_FILE if role == "inplace_base" else INPLACE_FILE, graph, INPLACE_OPSET
    )


def _verify_and_commit(
    stage: BundleStage,
    cfg: DecoderConfig,
    model: Decoder | None,
    tokenizer: Tokenizer,
    specs: dict[str, GraphSpec],
    stats: dict[str, Any],
    options: ExportOptions,
    progress: _Progress,
    reference: Reference | None,
) -> None:
    with progress.step(f"verifying against {reference.name if reference else 'PyTorch'}"):
        stage.add_tokenizer(tokenizer_to_json(tokenizer))
        fields = _manifest_fields(cfg, options, dict(specs))
        report = verify_bundle(stage.write_manifest(fields), model, reference, options.eval_text)
        report["export"] = {**stats, "source": options.source}
        if stage.shared_bytes:  # weights both graphs read from the one external data file
            report["export"]["weights_shared_bytes"] = stage.shared_bytes
        if not report["passed"]:
            raise VerificationFailed(report)
        # Claimed only where the format guarantees it and the bundle showed it: a dynamic INT8 bundle's
        # tokens may agree on the prompt set by luck.
        invariant = options.precision.batch_invariant and report["batch_invariant"]
        stage.write_manifest({**fields, "verification": report, "batch_invariant": invariant})
    with progress.step("moving the bundle into place"):
        stage.commit()


def write_verified_bundle(
    model: Decoder,
    tokenizer: Tokenizer,
    graphs: ExportedGraphs,
    out: Path,
    options: ExportOptions,
    progress: _Progress | None = None,
) -> Bundle:
    """Stage `graphs` as a bundle, verify it against `model`, and only then move it to `out`."""
    progress = progress or _Progress(enabled=False, total=2)
    with BundleStage(out) as stage:
        if (graphs.inplace_base is None) != (options.lora is None):
            raise ValueError(
                "a LoRA bundle's graphs include the serving graph without branches; no other's do"
            )
        specs = {role: _add_graph(stage, role, getattr(graphs, role), options) for role in _roles(options)}
        _verify_and_commit(stage, model.cfg, model, tokenizer, specs, graphs.stats, options, progress, None)
    return load_bundle(out)


def export_bundle(
    model: Decoder,
    tokenizer: Tokenizer,
    out: Path,
    options: ExportOptions,
    reference: Reference | None = None,
) -> Bundle:
    """Export, verify and write the bundle at `out`, replacing any there. Raises VerificationFailed.

    Verified against `reference` (transformers, for an imported model) or else `model` itself. Each graph is
    written into the staged bundle and dropped before the next is built. With a `reference`, `model` is of no
    use to verification (unless a quantized bundle's accuracy is measured against it): its weights are then
    released once the graphs are built (the module is left on the meta device), so they are not held beside
    the reference's and the graphs' while they are compared."""
    check_replaceable(out)  # fail before minutes of work, not after
    model = model.eval()
    roles = _roles(options)
    conversions = len(roles) * (options.precision.kind != "fp32")
    progress = _Progress(options.progress, total=len(roles) + 2 + conversions)
    try:
        with BundleStage(out) as stage:
            stats: dict[str, Any] = {}
            specs = {}
            for role in roles:
                with progress.step(_STEPS[role]):
                    graph = _built(role, model, options, stats)
                graph = _convert(role, graph, options, progress, stats)
                specs[role] = _add_graph(stage, role, graph, options)
                del graph
                _return_freed_memory()
            cfg = model.cfg
            fp32_model: Decoder | None = model
            if reference is not None and options.precision.bits is None:
                fp32_model = None
                model.to("meta")
                _return_freed_memory()
            _verify_and_commit(stage, cfg, fp32_model, tokenizer, specs, stats, options, progress, reference)
        return load_bundle(out)
    finally:
        progress.close()


def checkpoint_source(checkpoint: Path) -> dict[str, str]:
    return {"checkpoint": str(checkpoint), "sha256": sha256_file(checkpoint)}


def export_checkpoint(checkpoint: Path, out: Path, options: ExportOptions) -> Bundle:
    check_replaceable(out)
    ckpt = load_checkpoint(checkpoint)
    return export_bundle(ckpt.model, ckpt.tokenizer, out, options)


def export_hf(
    model: str | Path,
    out: Path,
    *,
    name: str | None = None,
    precision: Precision = Precision(),
    opset: int = DEFAULT_OPSET,
    progress: bool = True,
    eval_text: str | None = None,
    lora: LoraOptions | None = None,
) -> Bundle:
    """A Hugging Face model (a local folder, or a hub id in the local cache) -> verified bundle at `out`.

    The weights go through our decoder (export/hf_import.py) into the graphs; the bundle is verified against
    transformers itself (export/hf_verify.py); the tokenizer, EOS ids, BOS and chat template come with it.
    Raises HFImportError for a folder that cannot be exported, VerificationFailed for graphs that do not
    match transformers."""
    from export.hf_verify import transformers_reference

    check_replaceable(out)
    folder = locate_model(model)
    ckpt = import_checkpoint(folder)
    tok = ckpt.tokenizer
    if tok is None:
        raise HFImportError(
            folder / TOKENIZER_FILE,
            "not found (nor tokenizer.model): a bundle needs the model's tokenizer; download it with the "
            "weights",
        )
    if not tok.eos_token_ids:
        raise HFImportError(
            folder / CONFIG_FILE,
            "no eos_token_id (nor in generation_config.json or tokenizer_config.json): nothing would end a "
            "generation; add the model's eos_token_id",
        )
    source = {
        "hf_model": str(folder),
        "architecture": ckpt.architecture,
        "dtype": ckpt.source_dtype or "unknown",
    }
    tokenizer = padded_to_vocab(tok.tokenizer, ckpt.config.vocab_size)
    options = ExportOptions(
        model_name=name or (str(model) if not Path(model).expanduser().is_dir() else folder.name),
        opset=opset,
        precision=precision,
        progress=progress,
        source=source,
        chat_template=tok.chat_template or None,
        eos_token_ids=tok.eos_token_ids,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0],
        bos_token_id=tok.bos_token_id,
        eval_text=eval_text,
        lora=lora,
        lora_modules=checkpoint_modules(ckpt.config, ckpt.architecture),
        lora_names=adapter_names(ckpt.architecture),
    )
    return export_bundle(ckpt.model, tokenizer, out, options, transformers_reference(folder))


UNUSED_TOKEN = "<|textgen_unused_{}|>"


def padded_to_vocab(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    """A copy of `tokenizer` with a special token for every id in [its size, vocab_size): models pad their
    vocabulary for speed (Qwen2.5: 151,936 ids, 151,665 tokens), an untrained or unlucky model can emit those
    ids, and the server decodes only ids its tokenizer has. They decode to nothing, as transformers decodes
    an id it lacks; a text is tokenized as before unless it contains one of these names literally."""
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing <= 0:
        return tokenizer
    padded = Tokenizer.from_str(tokenizer.to_str())
    first = tokenizer.get_vocab_size()
    padded.add_special_tokens([UNUSED_TOKEN.format(i) for i in range(first, vocab_size)])
    return padded


def _up_to_date(out: Path, source: dict[str, str], chat_template: str | None) -> Bundle | None:
    try:
        bundle = load_bundle(out)
    except BundleError:
        return None
    report = bundle.manifest.verification
    current = report.get("passed") and report.get("export", {}).get("source") == source
    return bundle if current and bundle.manifest.chat_template == chat_template else None


def ensure_demo_bundle(out: Path | None = None, progress: bool = True) -> tuple[Bundle, bool]:
    """The demo bundle (training the checkpoint first if missing); exported only if missing or stale.

    Returns the bundle and whether it was exported now. Stale: exported from another checkpoint file, or
    without the demo's chat template (a bundle written before it had one).
    """
    out = out or demo_bundle_path()
    checkpoint = ensure_demo_checkpoint(progress=progress)
    source = checkpoint_source(checkpoint)
    # Parallel test sessions and a user may ask at once: one exports, the others wait and reuse it.
    with exclusive_lock(out.parent / f".{out.name}.lock"):
        bundle = _up_to_date(out, source, DEMO_CHAT_TEMPLATE)
        if bundle is not None:
            return bundle, False
        options = ExportOptions(
            model_name="textgen-demo", source=source, progress=progress, chat_template=DEMO_CHAT_TEMPLATE
        )
        return export_checkpoint(checkpoint, out, options), True


def random_bundle(
    preset: str,
    out: Path,
    seed: int = 0,
    precision: Precision = Precision(),
    progress: bool = True,
    eval_text: str | None = None,
    lora: LoraOptions | None = None,
) -> Bundle:
    """A bundle of a preset shape with random weights and a tokenizer trained on a little stdlib text."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]
    torch.manual_seed(seed)
    model = Decoder(cfg)
    texts = load_corpus(PRESET_TOKENIZER_TEXT_BYTES, heldout_percent=5).train
    tokenizer = train_tokenizer(texts, cfg.vocab_size)
    # Random weights emit any id of the model's vocabulary, and BPE on a little text can stop below it:
    # reserve the missing ids so every id the model can emit decodes (as nothing, being special).
    missing = cfg.vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|unused_{i}|>" for i in range(max(0, missing))])
    options = ExportOptions(
        model_name=f"{preset}-random",
        precision=precision,
        progress=progress,
        source={"preset": preset, "seed": str(seed)},
        chat_template=DEMO_CHAT_TEMPLATE,  # so the chat API can be tested and measured on random weights
        eval_text=eval_text,
        lora=lora,
    )
    return export_bundle(model, tokenizer, out, options)

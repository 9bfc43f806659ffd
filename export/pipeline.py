"""Checkpoint (or in-memory model) -> verified bundle: the steps behind `textgen-export onnx/demo/random`.

trace the standard graph -> write the in-place serving graph -> [INT8 | FP16] -> stage the bundle ->
verify it (export.verify) -> write the report into the manifest -> rename into place. A bundle that fails
verification is never put in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from export.bundle_writer import BundleStage, check_replaceable
from export.checkpoint import load_checkpoint
from export.demo import DEMO_CHAT_TEMPLATE, _exclusive, demo_bundle_path, ensure_demo_checkpoint
from export.fp16 import convert_fp16
from export.model import Decoder, DecoderConfig
from export.onnx_inplace import OPSET as INPLACE_OPSET
from export.onnx_inplace import build_inplace_graph
from export.onnx_standard import DEFAULT_OPSET, export_standard_graph
from export.quantize import quantize_int8
from export.tokenizer import EOS_ID, PAD_ID, tokenizer_to_json, train_tokenizer
from export.train import load_corpus
from export.verify import VerificationFailed, verify_bundle
from serve.bundle import Bundle, ShapeRange, TensorRTProfile, TensorRTSettings, load_bundle, sha256_file
from serve.errors import BundleError

STANDARD_FILE = "model.onnx"
INPLACE_FILE = "model_inplace.onnx"
TRT_MAX_BATCH = 16  # the engine's default slot count
TRT_OPT_BATCH = 8
PRESETS = {
    # The engine benchmark's shape (GPT-2 small-ish, ~30M parameters).
    "bench-a": DecoderConfig(
        vocab_size=8192, context_length=1024, d_model=512, n_layers=8, n_heads=8, d_ff=2048
    ),
    # For fast tests of the exporter and of everything that serves a bundle.
    "tiny": DecoderConfig(vocab_size=320, context_length=128, d_model=32, n_layers=2, n_heads=2, d_ff=64),
}
PRESET_TOKENIZER_TEXT_BYTES = 300_000  # of stdlib source: a few seconds of BPE training


@dataclass(frozen=True)
class ExportOptions:
    model_name: str
    opset: int = DEFAULT_OPSET
    int8: bool = False
    fp16: bool = False
    progress: bool = True
    source: dict[str, str] | None = None  # where the weights came from (checkpoint, preset), for the report
    chat_template: str | None = None  # the manifest's chat_template (Jinja); None: the bundle serves no chat

    def __post_init__(self) -> None:
        if self.int8 and self.fp16:
            raise ValueError(
                "--int8 and --fp16 are separate bundles (INT8 targets the CPU, FP16 the GPU); choose one"
            )


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
        # INT8 bundles use ONNX Runtime's dynamic quantization (CPU); TensorRT INT8 would need calibration.
        int8=False,
    )


def _providers(options: ExportOptions) -> list[str]:
    if options.int8:  # dynamic quantization's integer MatMuls are a CPU kernel
        return ["CPUExecutionProvider"]
    gpu = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
    return gpu if options.fp16 else [*gpu, "CPUExecutionProvider"]


def _manifest_fields(cfg: DecoderConfig, options: ExportOptions, graphs: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": 1,
        "model_name": options.model_name,
        "architecture": {
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.context_length,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "n_heads": cfg.n_heads,
            "head_dim": cfg.head_dim,
            "d_ff": cfg.d_ff,
            "positions": cfg.positions,
            "activation": cfg.activation,
        },
        "graphs": graphs,
        "dtype": "float16" if options.fp16 else "float32",
        "quantization": "int8" if options.int8 else "none",
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "execution_providers": _providers(options),
        "tensorrt": tensorrt_settings(cfg, options.fp16),
        **({"chat_template": options.chat_template} if options.chat_template is not None else {}),
    }


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
    stats: dict[str, Any]  # trace time, INT8 MatMul counts: into the report


def _build_graphs(model: Decoder, options: ExportOptions, progress: _Progress) -> ExportedGraphs:
    stats: dict[str, Any] = {}
    with progress.step("tracing the standard graph (torch.onnx dynamo)"):
        started = time.perf_counter()
        standard = export_standard_graph(model, options.opset)
        stats["trace_seconds"] = round(time.perf_counter() - started, 1)
    with progress.step("writing the in-place serving graph"):
        inplace = build_inplace_graph(model)
    if options.int8:
        with progress.step("INT8 dynamic quantization"):
            standard, stats["int8_standard"] = quantize_int8(standard)
            inplace, stats["int8_inplace"] = quantize_int8(inplace)
    if options.fp16:
        with progress.step("FP16 conversion"):
            standard, inplace = convert_fp16(standard), convert_fp16(inplace)
    return ExportedGraphs(standard, inplace, stats)


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
    with BundleStage(out) as stage, progress.step("verifying against PyTorch"):
        specs = {
            "standard": stage.add_graph(STANDARD_FILE, graphs.standard, options.opset),
            "inplace": stage.add_graph(INPLACE_FILE, graphs.inplace, INPLACE_OPSET),
        }
        stage.add_tokenizer(tokenizer_to_json(tokenizer))
        fields = _manifest_fields(model.cfg, options, specs)
        report = verify_bundle(stage.write_manifest(fields), model)
        report["export"] = {**graphs.stats, "source": options.source}
        if not report["passed"]:
            raise VerificationFailed(report)
        stage.write_manifest({**fields, "verification": report})
        with progress.step("moving the bundle into place"):
            stage.commit()
    return load_bundle(out)


def export_bundle(model: Decoder, tokenizer: Tokenizer, out: Path, options: ExportOptions) -> Bundle:
    """Export, verify and write the bundle at `out`, replacing any there. Raises VerificationFailed."""
    check_replaceable(out)  # fail before minutes of work, not after
    model = model.eval()
    progress = _Progress(options.progress, total=4 + (options.int8 or options.fp16))
    try:
        graphs = _build_graphs(model, options, progress)
        return write_verified_bundle(model, tokenizer, graphs, out, options, progress)
    finally:
        progress.close()


def checkpoint_source(checkpoint: Path) -> dict[str, str]:
    return {"checkpoint": str(checkpoint), "sha256": sha256_file(checkpoint)}


def export_checkpoint(checkpoint: Path, out: Path, options: ExportOptions) -> Bundle:
    check_replaceable(out)
    ckpt = load_checkpoint(checkpoint)
    return export_bundle(ckpt.model, ckpt.tokenizer, out, options)


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
    with _exclusive(out.parent / f".{out.name}.lock"):
        bundle = _up_to_date(out, source, DEMO_CHAT_TEMPLATE)
        if bundle is not None:
            return bundle, False
        options = ExportOptions(
            model_name="textgen-demo", source=source, progress=progress, chat_template=DEMO_CHAT_TEMPLATE
        )
        return export_checkpoint(checkpoint, out, options), True


def random_bundle(preset: str, out: Path, seed: int = 0, int8: bool = False, progress: bool = True) -> Bundle:
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
        int8=int8,
        progress=progress,
        source={"preset": preset, "seed": str(seed)},
        chat_template=DEMO_CHAT_TEMPLATE,  # so the chat API can be tested and measured on random weights
    )
    return export_bundle(model, tokenizer, out, options)

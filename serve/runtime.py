"""The one place onnxruntime is imported: availability, execution-provider choice, session creation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve.errors import BundleError

try:
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover - exercised only in an install without either extra
    raise ImportError(
        "textgen needs ONNX Runtime: install the 'cpu' extra (pip install 'textgen-serving[cpu]') "
        "or the 'gpu' extra (pip install 'textgen-serving[gpu]'), not both"
    ) from exc

log = logging.getLogger(__name__)

# Best first: TensorRT builds whole-graph engines, CUDA runs what TensorRT leaves (e.g. GroupQueryAttention).
PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
SHORT_NAMES = {
    "tensorrt": PROVIDER_PREFERENCE[0],
    "cuda": PROVIDER_PREFERENCE[1],
    "cpu": PROVIDER_PREFERENCE[2],
}


@dataclass(frozen=True)
class SessionConfig:
    providers: tuple[str, ...] = ()  # empty: best available; else short (cpu/cuda/tensorrt) or full names
    threads: int = 0  # intra-op threads; 0 lets ONNX Runtime use every core
    spinning: bool = True  # busy-wait between ops: faster steps, but burns the cores the event loop needs
    tensorrt_options: dict[str, Any] = field(default_factory=dict)


def resolve_providers(requested: tuple[str, ...]) -> list[str]:
    """The providers to use, best first. A requested provider that is missing is an error, not a fallback."""
    available = set(ort.get_available_providers())
    if not requested:
        return [p for p in PROVIDER_PREFERENCE if p in available]
    chosen = [SHORT_NAMES.get(p.lower(), p) for p in requested]
    missing = [p for p in chosen if p not in available]
    if missing:
        raise ValueError(
            f"execution provider(s) {missing} are not available in this ONNX Runtime build "
            f"(available: {sorted(available)}); install the 'gpu' extra for CUDA/TensorRT"
        )
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")  # nodes a GPU provider cannot take still need a home
    return chosen


def create_session(model_path: Path | str, config: SessionConfig) -> ort.InferenceSession:
    providers = resolve_providers(config.providers)
    options = ort.SessionOptions()
    options.intra_op_num_threads = config.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
    provider_args: list[str | tuple[str, dict[str, Any]]] = [
        (p, config.tensorrt_options) if p == "TensorrtExecutionProvider" else p for p in providers
    ]
    try:
        session = ort.InferenceSession(str(model_path), options, providers=provider_args)
    except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
        raise BundleError(f"{model_path}: ONNX Runtime cannot load this graph: {exc}") from exc
    log.info("onnxruntime %s session on %s", ort.__version__, session.get_providers())
    return session


def ortvalue(array: Any) -> ort.OrtValue:
    """Wrap a numpy array without copying (CPU), so a bound KV buffer is written in place."""
    return ort.OrtValue.ortvalue_from_numpy(array)

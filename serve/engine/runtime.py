"""The one place onnxruntime is imported (on first use): availability, execution-provider choice, sessions."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from serve.engine.graph_file import read_structure
from serve.engine.types import SessionConfig
from serve.errors import BundleError

if TYPE_CHECKING:
    import onnx
    import onnxruntime as ort

log = logging.getLogger(__name__)


def onnxruntime() -> Any:
    """The onnxruntime module, imported on first use: a server's gRPC process, whose engine runs in a process
    of its own, never loads it (~25 MiB less)."""
    try:
        import onnxruntime as module
    except ImportError as exc:  # pragma: no cover - exercised only in an install without either extra
        raise ImportError(
            "textgen needs ONNX Runtime: install the 'cpu' extra (pip install 'textgen-serving[cpu]') "
            "or the 'gpu' extra (pip install 'textgen-serving[gpu]'), not both"
        ) from exc
    return module


# Best first: TensorRT builds whole-graph engines, CUDA runs what TensorRT leaves (e.g. GroupQueryAttention).
PROVIDER_PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
TENSORRT = PROVIDER_PREFERENCE[0]
SHORT_NAMES = {
    "tensorrt": PROVIDER_PREFERENCE[0],
    "cuda": PROVIDER_PREFERENCE[1],
    "cpu": PROVIDER_PREFERENCE[2],
}


def resolve_providers(requested: tuple[str, ...]) -> list[str]:
    """The providers to use, best first. A requested provider that is missing is an error, not a fallback."""
    available = set(onnxruntime().get_available_providers())
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


def cpu_only(config: SessionConfig) -> bool:
    """Whether a session of `config` runs every node on the CPU."""
    return resolve_providers(config.providers) == ["CPUExecutionProvider"]


@dataclass(frozen=True)
class InMemoryGraph:
    """A graph rewritten at load: the serialized model, and the folder its external data files are in."""

    model: bytes
    folder: Path


def structure_only(path: Path) -> InMemoryGraph:
    """The graph at `path` as ONNX Runtime reads it with the least memory: its structure, each weight mapped
    from where it lies in the bundle's files (serve/engine/graph_file.py). C-llama's fp32 serving graph
    (1.49 GB): its session holds 1,408 MiB, built in 2.2 s, where from the path it held 1,867 in 15.7 s."""
    return InMemoryGraph(read_structure(path).SerializeToString(), path.parent)


def editable_graph(graph: Path | InMemoryGraph) -> tuple[onnx.ModelProto, Path]:
    """A graph to rewrite at load (a path: its structure, the weights left in the bundle's files; or a graph
    already rewritten) and the folder its weights are read from."""
    import onnx

    if isinstance(graph, InMemoryGraph):
        return onnx.load_from_string(graph.model), graph.folder
    return read_structure(graph), graph.parent


def create_session(
    model: Path | str | InMemoryGraph,
    config: SessionConfig,
    optimized_path: Path | None = None,
    entries: Mapping[str, str] | None = None,
) -> ort.InferenceSession:
    """A session of `model` for `config`. A graph given by its path is read for its structure alone on the CPU
    (`structure_only`); a GPU provider gets the path (TensorRT reads the graph from it). With
    `optimized_path`, ONNX Runtime writes the optimized graph there, as the config `entries` say
    (serve/engine/prepared.py)."""
    rt = onnxruntime()
    providers = resolve_providers(config.providers)
    options = rt.SessionOptions()
    options.intra_op_num_threads = config.threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
    if config.spinning and not config.spin_between_runs:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if config.profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = config.profile_prefix
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    for key, value in (entries or {}).items():
        options.add_session_config_entry(key, value)
    provider_args: list[str | tuple[str, dict[str, Any]]] = [
        (p, config.tensorrt_options) if p == "TensorrtExecutionProvider" else p for p in providers
    ]
    if not isinstance(model, InMemoryGraph) and providers == ["CPUExecutionProvider"]:
        model = structure_only(Path(model))
    source: str | bytes = str(model)
    if isinstance(model, InMemoryGraph):
        source, model = model.model, model.folder
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model))
    try:
        session = rt.InferenceSession(source, options, providers=provider_args)
    except Exception as exc:  # onnxruntime raises its own exception types for bad graphs
        raise BundleError(f"{model}: ONNX Runtime cannot load this graph: {exc}") from exc
    log.info("onnxruntime %s session on %s", rt.__version__, session.get_providers())
    return session


def ortvalue(array: Any) -> ort.OrtValue:
    """Wrap a host numpy array without copying, so an output bound to it is written in place."""
    return onnxruntime().OrtValue.ortvalue_from_numpy(array)


# -- device memory -------------------------------------------------------------------------------------------
# Providers whose kernels read and write CUDA device memory (TensorRT engines run on CUDA memory too).
_CUDA_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


@dataclass(frozen=True)
class Device:
    """An ONNX Runtime memory location, as OrtValue and IOBinding name it ("cpu" or "cuda", and an id)."""

    type: str = "cpu"
    id: int = 0


def kv_device(providers: Sequence[str], device_id: int = 0) -> Device:
    """Where a session's KV cache lives: on the GPU when the session's first (preferred) provider is a CUDA
    one, so the cache stays on the device between steps; otherwise in host memory."""
    if providers and providers[0] in _CUDA_PROVIDERS:
        return Device("cuda", device_id)
    return Device("cpu", 0)


def session_device_id(session: ort.InferenceSession) -> int:
    """The device id the session's first provider runs on (its `device_id` option; 0 when it has none)."""
    first = session.get_providers()[0]
    return int(session.get_provider_options().get(first, {}).get("device_id", 0))


def allocate(shape: Sequence[int], dtype: Any, device: Device) -> ort.OrtValue:
    """A zero-filled tensor allocated by ONNX Runtime on `device`. The zeros are not needed for correctness
    (attention reads only each row's valid prefix) but keep never-written memory free of NaN bit patterns."""
    value = onnxruntime().OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, device.type, device.id)
    value.update_inplace(np.zeros(shape, dtype))  # one host->device copy at start-up on a GPU
    return value


# -- the row-copy graph --------------------------------------------------------------------------------------
_COPY_OPSET = 13  # old enough for every onnxruntime >= 1.20


def copy_graph(dtypes: Sequence[Any], shape: Sequence[int]) -> bytes:
    """A serialized ONNX model with one Identity per tensor: inputs `src.{i}` -> outputs `dst.{i}`, each of
    `shape` and `dtypes[i]`. Run with both sides bound to device memory, it copies on the device."""
    from onnx import helper  # imported on first use, as onnxruntime is

    nodes, inputs, outputs = [], [], []
    for i, dtype in enumerate(dtypes):
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        inputs.append(helper.make_tensor_value_info(f"src.{i}", elem, list(shape)))
        outputs.append(helper.make_tensor_value_info(f"dst.{i}", elem, list(shape)))
        nodes.append(helper.make_node("Identity", [f"src.{i}"], [f"dst.{i}"], name=f"copy.{i}"))
    graph = helper.make_graph(nodes, "textgen_copy", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", _COPY_OPSET)], producer_name="textgen"
    )
    model.ir_version = 7  # what onnxruntime >= 1.20 reads
    return model.SerializeToString()


def create_copy_session(model: bytes, device: Device) -> ort.InferenceSession:
    """A session for `copy_graph` on the provider that owns `device`'s memory: CUDA for "cuda" (also under
    a TensorRT serving session: an engine build for a memcpy gains nothing, and TensorRT runs on the same
    CUDA memory), else CPU. One thread, no spinning, and no graph optimization, so the Identity nodes stay
    and write into the bound outputs."""
    rt = onnxruntime()
    options = rt.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = rt.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers: list[str | tuple[str, dict[str, Any]]] = ["CPUExecutionProvider"]
    if device.type == "cuda":
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.id}))
    return rt.InferenceSession(model, options, providers=providers)

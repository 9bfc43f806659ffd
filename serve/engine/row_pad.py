"""A bundle's single-row pads, taken out where the CPU serving it does not need them.

`textgen-export` pads every MatMulNBits to an even row count (export/row_pad.py) at the block sizes where,
on some CPU, ONNX Runtime computes a lone row (a batch-1 decode step, the odd last row of a batch) with a
kernel that rounds differently from the many-row one: without the pad, a request's tokens would depend on
its batch company there. The pad is paid at batch 1, where the lone row is computed as two. Which CPUs need
it is a property of ONNX Runtime's kernels on that CPU (measured: AVX2 does past 16-weight blocks at 4 bits,
AVX-512 VNNI does not at 32), so the engine asks this CPU at load: for every MatMulNBits shape of the graph,
on random weights of that shape, with the session's threads, does each row come out bit for bit the same
alone and among 2 to 9 rows? Only if every shape does, the engine serves the graph without its pads (the
same real rows, through the same ops), and the bundle stays batch invariant on this machine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serve.bundle import ROW_PAD_PREFIX
from serve.engine.graph_file import read_structure
from serve.engine.runtime import InMemoryGraph, cpu_only, onnxruntime
from serve.engine.types import SessionConfig

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

PADDED_SUFFIX = f"_{ROW_PAD_PREFIX}"  # a tensor computed on padded rows: its real name + this
PROBE_ROWS = 9
PROBE_BATCHES = (2, 3, 4, 5, PROBE_ROWS)  # row counts compared against each row alone: odd and even
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class NBitsShape:
    """One MatMulNBits node's kernel choice: its attributes and its weight and scale shapes."""

    attributes: tuple[tuple[str, int], ...]  # K, N, bits, block_size, accuracy_level (as the node has them)
    weight_shape: tuple[int, ...]  # the packed uint8 weights
    scale_shape: tuple[int, ...]

    @property
    def k(self) -> int:
        return dict(self.attributes)["K"]


def nbits_shapes(model: onnx.ModelProto) -> set[NBitsShape] | None:
    """The distinct MatMulNBits shapes of a graph; None when one takes inputs past its scales (zero points,
    a bias, group indices), which the probe does not model."""
    from onnx import helper

    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    shapes = set()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        if any(node.input[3:]) or node.input[1] not in dims or node.input[2] not in dims:
            return None
        attributes = tuple(sorted((a.name, int(helper.get_attribute_value(a))) for a in node.attribute))
        shapes.add(NBitsShape(attributes, dims[node.input[1]], dims[node.input[2]]))
    return shapes


def lone_row_exact(shape: NBitsShape, config: SessionConfig, seed: int = 0) -> bool:
    """Whether this CPU's MatMulNBits computes every row alike alone and among others, for `shape`."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(seed)
    weights = rng.integers(0, 256, size=shape.weight_shape, dtype=np.uint8)
    scales = rng.uniform(0.005, 0.02, size=shape.scale_shape).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain=MS_DOMAIN)
    node.attribute.extend(helper.make_attribute(name, value) for name, value in shape.attributes)
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", shape.k])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", None])]
    constants = [
        helper.make_tensor("b", TensorProto.UINT8, weights.shape, weights.tobytes(), raw=True),
        helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True),
    ]
    graph = helper.make_graph([node], "lone_row_probe", inputs, outputs, constants)
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid(MS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="textgen")
    model.ir_version = 7  # what onnxruntime >= 1.20 reads
    rt = onnxruntime()
    options = rt.SessionOptions()
    options.intra_op_num_threads = config.threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = rt.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rows = rng.standard_normal((PROBE_ROWS, shape.k)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"a": rows[i : i + 1]})[0] for i in range(PROBE_ROWS)])
    return all(np.array_equal(session.run(None, {"a": rows[:m]})[0], alone[:m]) for m in PROBE_BATCHES)


def strip_row_pads(model: onnx.ModelProto) -> int:
    """Take export's row pads out of `model` in place: its Pads, Slices and their shared pad arithmetic
    go, every tensor computed on padded rows gets its real name back. Returns the Pads removed."""
    graph = model.graph

    def real(name: str) -> str:
        return name.removesuffix(PADDED_SUFFIX)

    kept, pads = [], 0
    for node in graph.node:
        if node.name.startswith(ROW_PAD_PREFIX) or node.name.endswith(f"{PADDED_SUFFIX}_cut"):
            continue
        if node.name.endswith(f"{PADDED_SUFFIX}_pad"):
            pads += 1
            continue
        node.input[:] = [real(name) for name in node.input]
        node.output[:] = [real(name) for name in node.output]
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    constants = [t for t in graph.initializer if not t.name.startswith(f"{ROW_PAD_PREFIX}_")]
    del graph.initializer[:]
    graph.initializer.extend(constants)
    return pads


def unpadded_graph(path: Path, config: SessionConfig) -> tuple[InMemoryGraph, int] | None:
    """The graph at `path` without its row pads, and how many Pads went, when it has them, it runs on the
    CPU alone, and this CPU computes each of its MatMulNBits shapes alike for a row alone and among others;
    else None (serve it as exported)."""
    if not cpu_only(config):
        return None
    model = read_structure(path)  # the weights stay in the bundle's files: ONNX Runtime maps them from there
    if not any(node.name.startswith(ROW_PAD_PREFIX) for node in model.graph.node):
        return None
    shapes = nbits_shapes(model)
    if not shapes or not all(lone_row_exact(shape, config) for shape in shapes):
        log.info("row pads kept: this CPU computes a lone row of the graph's MatMulNBits unlike a batch's")
        return None
    pads = strip_row_pads(model)
    log.info(
        "row pads removed (%d): this CPU computes a lone row of each of the graph's %d MatMulNBits shapes as "
        "in a batch, so the graph stays batch invariant without them",
        pads,
        len(shapes),
    )
    return InMemoryGraph(model.SerializeToString(), path.parent), pads

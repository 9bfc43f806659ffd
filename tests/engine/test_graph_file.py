"""A graph read for its structure alone (serve/engine/graph_file.py): the weights stay in the files, the
session computes what the graph loaded whole computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from serve.engine.graph_file import INLINE_BYTES, read_structure
from serve.engine.runtime import create_session
from serve.engine.types import SessionConfig
from serve.errors import BundleError

ROWS, COLS = 256, 160  # the weight: 160 KiB, over INLINE_BYTES


def _graph() -> onnx.ModelProto:
    """x [n, ROWS] -> Reshape(MatMul(x, w) + b, [-1, COLS]): a large weight, a small bias, a shape constant
    (which ONNX Runtime's shape inference must find inside the graph)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    bias = rng.standard_normal(COLS).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["sum"]),
        helper.make_node("Reshape", ["sum", "shape"], ["y"]),
    ]
    constants = [
        numpy_helper.from_array(weight, "w"),
        numpy_helper.from_array(bias, "b"),
        numpy_helper.from_array(np.array([-1, COLS], np.int64), "shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", ROWS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", COLS])],
        constants,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _outputs(session: ort.InferenceSession) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((3, ROWS)).astype(np.float32)
    return np.asarray(session.run(None, {"x": x})[0])


def _external(model: onnx.ModelProto) -> dict[str, dict[str, str]]:
    return {
        t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data
    }


def test_embedded_weights_are_referenced_where_they_lie_in_the_file(tmp_path: Path) -> None:
    model = _graph()
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    structure = read_structure(path)
    refs = _external(structure)
    assert list(refs) == ["w"] and refs["w"]["location"] == "model.onnx"  # the bias and shape stay inside
    offset, length = int(refs["w"]["offset"]), int(refs["w"]["length"])
    weight = next(t for t in model.graph.initializer if t.name == "w").raw_data
    assert length == len(weight) > INLINE_BYTES and path.read_bytes()[offset : offset + length] == weight
    assert structure.ByteSize() < len(weight) // 20  # Python holds the structure, not the weights
    whole = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours = create_session(path, SessionConfig(providers=("cpu",), threads=1))
    np.testing.assert_array_equal(_outputs(ours), _outputs(whole))


def test_a_graph_with_external_data_keeps_its_large_tensors_there(tmp_path: Path) -> None:
    """Small external tensors come inside (shape inference reads them), large ones stay in the data file."""
    model = _graph()
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="weights.data", size_threshold=0)
    refs = _external(read_structure(path))
    assert list(refs) == ["w"] and refs["w"]["location"] == "weights.data"
    whole = ort.InferenceSession(_graph().SerializeToString(), providers=["CPUExecutionProvider"])
    ours = create_session(path, SessionConfig(providers=("cpu",), threads=1))
    np.testing.assert_array_equal(_outputs(ours), _outputs(whole))


def test_a_file_that_is_no_graph_is_a_bundle_error(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(BundleError, match=r"model\.onnx: not a readable ONNX graph"):
        read_structure(path)

"""The small ONNX graphs the export tests quantize share their I/O with the serving graph: token ids and each
row's last position in, the hidden states [batch, seq, hidden] and the last position's logits out."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LOGITS = 48  # the head's width


def head_graph(
    name: str,
    nodes: list[onnx.NodeProto],
    weights: dict[str, np.ndarray],
    ints: dict[str, list[int]],
    hidden: int,
) -> onnx.ModelProto:
    """`nodes` reading input_ids and last_index and writing hidden and logits; `weights` become float32
    initializers and `ints` int64 ones."""
    inits = [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in ints.items()]
    graph = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("last_index", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", hidden]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", LOGITS]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])

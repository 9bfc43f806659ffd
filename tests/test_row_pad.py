"""export.row_pad: every MatMulNBits runs on an even row count, the padded rows travel through the row-wise
ops between projections, and every real row comes out as it would unpadded."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from head_graphs import LOGITS, head_graph
from onnx import TensorProto, helper

from export.quantize import quantize_nbits

K = 64  # hidden width: two 4-bit blocks of 32
SHAPES = [(b, s) for b in range(1, 6) for s in range(1, 5)]  # odd and even row counts, either axis longer


def _norm(x: str, out: str) -> list[onnx.NodeProto]:
    """RMSNorm as the in-place graph builder writes it (a reduction over the last axis, elementwise ops)."""
    return [
        helper.make_node("Pow", [x, "two"], [f"{out}/pow"]),
        helper.make_node("ReduceMean", [f"{out}/pow", "last_axis"], [f"{out}/mean"]),
        helper.make_node("Add", [f"{out}/mean", "eps"], [f"{out}/eps"]),
        helper.make_node("Sqrt", [f"{out}/eps"], [f"{out}/sqrt"]),
        helper.make_node("Div", [x, f"{out}/sqrt"], [f"{out}/div"]),
        helper.make_node("Mul", [f"{out}/div", "norm_weight"], [out]),
    ]


def _decoder_block_graph() -> onnx.ModelProto:
    """A decoder block's dataflow: embedding, norm, projection, an op that mixes positions (attention's
    place), output projection, residual, norm, gate/up split and SiLU, down projection, residual, a context
    added per sequence (rows that do not line up with the residual's), the last position, the head."""
    rng = np.random.default_rng(5)
    weights = {
        "table": rng.normal(size=(64, K)),
        "w_qkv": rng.normal(size=(K, K)) / np.sqrt(K),
        "w_o": rng.normal(size=(K, K)) / np.sqrt(K),
        "w_gate_up": rng.normal(size=(K, 2 * K)) / np.sqrt(K),
        "w_down": rng.normal(size=(K, K)) / np.sqrt(K),
        "head": rng.normal(size=(K, LOGITS)) / np.sqrt(K),
        "norm_weight": 1 + 0.1 * rng.normal(size=K),
        "two": np.array([2.0]),
        "eps": np.array([1e-5]),
    }
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["x"]),
        *_norm("x", "n1"),
        helper.make_node("MatMul", ["n1", "w_qkv"], ["qkv"]),
        helper.make_node("Softmax", ["qkv"], ["mixed"], axis=1),
        helper.make_node("MatMul", ["mixed", "w_o"], ["o"]),
        helper.make_node("Add", ["x", "o"], ["h"]),
        *_norm("h", "n2"),
        helper.make_node("MatMul", ["n2", "w_gate_up"], ["gate_up"]),
        helper.make_node("Split", ["gate_up", "halves"], ["gate", "up"], axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["act"]),
        helper.make_node("MatMul", ["act", "w_down"], ["down"]),
        helper.make_node("Add", ["h", "down"], ["residual"]),
        helper.make_node("ReduceMean", ["x", "seq_axis"], ["context"]),  # [batch, 1, K]
        helper.make_node("Add", ["residual", "context"], ["hidden"]),
        helper.make_node("Unsqueeze", ["last_index", "last_axis"], ["last_2d"]),
        helper.make_node("GatherND", ["hidden", "last_2d"], ["last"], batch_dims=1),
        helper.make_node("MatMul", ["last", "head"], ["logits"]),
    ]
    ints = {"last_axis": [-1], "seq_axis": [1], "halves": [K, K]}
    return head_graph("decoder_block", nodes, weights, ints, K)


def _with_outputs(model: onnx.ModelProto, names: list[str]) -> ort.InferenceSession:
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _inputs(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "input_ids": rng.integers(0, 64, size=(batch, seq)),
        "last_index": rng.integers(0, seq, size=batch),
    }


def test_padded_rows_travel_between_projections() -> None:
    """Pads only where a projection reads rows that came through a position-mixing op or the embedding,
    or the residual meets a padded projection; Slices only where rows are mixed or leave the graph."""
    padded, counts = quantize_nbits(_decoder_block_graph(), 4, 32)
    assert counts["single_row_padded"] == 5
    ops = Counter(n.op_type for n in padded.graph.node)
    # Pads: n1 (from the embedding), mixed (after the softmax), x (the residual beside o), last (the head);
    # Slices: qkv (the softmax reads it), residual (the context does not line up), logits (an output).
    assert (ops["Pad"], ops["Slice"]) == (4, 3)
    matmul_inputs = [n.input[0] for n in padded.graph.node if n.op_type == "MatMulNBits"]
    sess = _with_outputs(padded, matmul_inputs)
    for batch, seq in SHAPES:
        outputs = sess.run(None, _inputs(batch, seq))[2:]
        rows = [int(np.prod(a.shape[:-1])) for a in outputs]
        assert all(r % 2 == 0 for r in rows), (batch, seq, rows)
        odd = batch * seq % 2
        assert rows == [batch * seq + odd * min(batch, seq)] * 4 + [batch + batch % 2], (batch, seq)


def test_every_real_row_is_exact() -> None:
    """Even row counts: what the unpadded graph computes, bit for bit. Any count: a row alone is exactly
    that row in its batch."""
    padded = quantize_nbits(_decoder_block_graph(), 4, 32)[0]
    unpadded = quantize_nbits(_decoder_block_graph(), 4, 32, pad_rows=False)[0]
    providers = ["CPUExecutionProvider"]
    sess = ort.InferenceSession(padded.SerializeToString(), providers=providers)
    plain = ort.InferenceSession(unpadded.SerializeToString(), providers=providers)
    for batch, seq in SHAPES:
        feeds = _inputs(batch, seq, seed=batch * 10 + seq)
        hidden, logits = sess.run(None, feeds)
        if batch * seq % 2 == 0 and batch % 2 == 0:
            for ours, theirs in zip((hidden, logits), plain.run(None, feeds), strict=True):
                np.testing.assert_array_equal(ours, theirs)
        for b in range(batch):
            alone = sess.run(None, {name: value[b : b + 1] for name, value in feeds.items()})
            np.testing.assert_array_equal(alone[0][0], hidden[b])
            np.testing.assert_array_equal(alone[1][0], logits[b])

"""export.row_pad: every MatMulNBits runs on an even row count, the padded rows travel through the row-wise
ops between projections, and every real row comes out as it would unpadded. serve.engine.row_pad: the
engine takes the pads out again where this CPU computes a lone row as in a batch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from head_graphs import LOGITS, head_graph
from onnx import TensorProto, helper

from export.quantize import quantize_nbits
from serve.bundle import ROW_PAD_PREFIX
from serve.engine import row_pad
from serve.engine.row_pad import NBitsShape, lone_row_exact, strip_row_pads, unpadded_graph
from serve.engine.runtime import create_session
from serve.engine.types import SessionConfig

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


# --- serve.engine.row_pad: the pads taken out where the CPU does not need them ------------------------------


def _probe_shape(bits: int, block: int, k: int = 256, n: int = 96) -> NBitsShape:
    attributes = (("K", k), ("N", n), ("accuracy_level", 4), ("bits", bits), ("block_size", block))
    return NBitsShape(attributes, (n, k // block, block * bits // 8), (n * (k // block),))


def test_stripping_the_pads_gives_back_the_unpadded_graph() -> None:
    padded = quantize_nbits(_decoder_block_graph(), 4, 32)[0]
    unpadded = quantize_nbits(_decoder_block_graph(), 4, 32, pad_rows=False)[0]
    assert strip_row_pads(padded) == 4
    assert [n.op_type for n in padded.graph.node] == [n.op_type for n in unpadded.graph.node]
    assert not [t.name for t in padded.graph.initializer if t.name.startswith(ROW_PAD_PREFIX)]
    onnx.checker.check_model(padded)
    providers = ["CPUExecutionProvider"]
    stripped = ort.InferenceSession(padded.SerializeToString(), providers=providers)
    plain = ort.InferenceSession(unpadded.SerializeToString(), providers=providers)
    for batch, seq in SHAPES:
        feeds = _inputs(batch, seq, seed=batch * 10 + seq)
        for ours, theirs in zip(stripped.run(None, feeds), plain.run(None, feeds), strict=True):
            np.testing.assert_array_equal(ours, theirs)


def test_the_probe_finds_a_one_row_kernel_where_one_rounds_differently() -> None:
    """At 4 bits, block 16, and at 8 bits, block 64, a row is computed alike alone and in a batch on every
    CPU measured (export.quantize.INVARIANT_MAX_BLOCK). Larger blocks depend on the CPU (AVX2 EPYC: 4 bits
    differ from block 32 on, 8 bits never; AVX-512 VNNI: neither at block 32): for them the probe must say
    what a comparison made here, on other rows, finds."""
    config = SessionConfig(threads=2)
    assert lone_row_exact(_probe_shape(4, 16), config)
    assert lone_row_exact(_probe_shape(8, 64), config)
    for bits, block in ((4, 32), (4, 128), (8, 128), (8, 256)):
        shape = _probe_shape(bits, block)
        assert lone_row_exact(shape, config) == _alike_alone_and_batched(shape), (bits, block)


def _alike_alone_and_batched(shape: NBitsShape) -> bool:
    """Whether 6 rows of `shape`'s MatMulNBits, on weights and rows of another seed than the probe's, come out
    the same one at a time as all at once."""
    rng = np.random.default_rng(99)
    weights = rng.integers(0, 256, size=shape.weight_shape, dtype=np.uint8)
    scales = rng.uniform(0.005, 0.02, size=shape.scale_shape).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["a", "b", "scales"], ["y"], domain="com.microsoft")
    node.attribute.extend(helper.make_attribute(name, value) for name, value in shape.attributes)
    graph = helper.make_graph(
        [node],
        "alike",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", shape.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", None])],
        [
            helper.make_tensor("b", TensorProto.UINT8, weights.shape, weights.tobytes(), raw=True),
            helper.make_tensor("scales", TensorProto.FLOAT, scales.shape, scales.tobytes(), raw=True),
        ],
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 7
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rows = rng.standard_normal((6, shape.k)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"a": rows[i : i + 1]})[0] for i in range(6)])
    return bool(np.array_equal(session.run(None, {"a": rows})[0], alone))


def test_the_engine_serves_the_graph_unpadded_only_where_every_shape_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decided per graph from the probe's answers; the rewritten graph loads with its weights still in the
    bundle's external data file, and computes what the unpadded export does."""
    path = tmp_path / "model_inplace.onnx"
    padded = quantize_nbits(_decoder_block_graph(), 4, 32)[0]
    onnx.save(padded, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    config = SessionConfig(providers=("cpu",), threads=1)
    asked: list[NBitsShape] = []

    def probe(answer: bool) -> Callable[[NBitsShape, SessionConfig], bool]:
        def lone_row_exact(shape: NBitsShape, config: SessionConfig) -> bool:
            asked.append(shape)
            return answer

        return lone_row_exact

    monkeypatch.setattr(row_pad, "lone_row_exact", probe(False))
    assert unpadded_graph(path, config) is None
    assert len(asked) == 1  # a False ends the asking; the graph's MatMulNBits have 5 distinct shapes
    monkeypatch.setattr(row_pad, "lone_row_exact", probe(True))
    graph, pads = unpadded_graph(path, config) or pytest.fail("the pads were kept")
    assert pads == 4 and len(asked) == 1 + len(row_pad.nbits_shapes(padded) or ())
    unpadded = quantize_nbits(_decoder_block_graph(), 4, 32, pad_rows=False)[0]
    plain = ort.InferenceSession(unpadded.SerializeToString(), providers=["CPUExecutionProvider"])
    session = create_session(graph, config)
    feeds = _inputs(3, 1)
    for ours, theirs in zip(session.run(None, feeds), plain.run(None, feeds), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    monkeypatch.setattr(row_pad, "cpu_only", lambda config: False)  # a GPU provider: its own kernels
    assert unpadded_graph(path, config) is None
    onnx.save(unpadded, str(tmp_path / "plain.onnx"))
    monkeypatch.setattr(row_pad, "cpu_only", lambda config: True)
    assert unpadded_graph(tmp_path / "plain.onnx", config) is None  # nothing to take out


def test_only_a_bundle_marked_padded_is_read_for_its_pads(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Looking for pads costs a read of the graph's structure, and probing the CPU a session per MatMulNBits
    shape, at start: the engine does it only for a bundle whose manifest says its odd rows are padded."""
    from dataclasses import replace

    from serve.bundle import load_bundle
    from serve.engine import prepared
    from serve.engine.engine import Engine
    from serve.engine.types import EngineSettings

    asked: list[Path] = []

    def spy(path: Path, config: SessionConfig) -> None:
        asked.append(path)

    monkeypatch.setattr(prepared, "unpadded_graph", spy)
    bundle = load_bundle(tiny_bundle)
    settings = EngineSettings(max_batch_size=2, session=SessionConfig(providers=("cpu",), threads=1))
    assert not bundle.manifest.odd_rows_padded
    Engine.from_bundle(bundle, settings)
    assert asked == []
    padded = replace(bundle, manifest=bundle.manifest.model_copy(update={"odd_rows_padded": True}))
    Engine.from_bundle(padded, settings)  # the spy keeps the pads: the graph loads as exported
    assert asked == [bundle.inplace_graph]

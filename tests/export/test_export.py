"""The exporter: graph contract, verification (and that it catches broken graphs), INT8, FP16, the writer."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from head_graphs import LOGITS, head_graph
from onnx import TensorProto, helper, numpy_helper
from quantized_bundles import quantized_graphs, tiny_model

from export import quantize as quantize_module
from export.bundle_writer import BundleStage
from export.checkpoint import load_checkpoint
from export.fp16 import CONSTANT_LIMIT, check_graph, convert_fp16
from export.generation import Shape, greedy, torch_step
from export.model import Decoder, DecoderConfig
from export.onnx_standard import export_standard_graph
from export.pipeline import PRESETS, ExportOptions, Precision, write_verified_bundle
from export.quantize import (
    INVARIANT_MAX_BLOCK,
    LOSS_WINDOWS,
    count_weight_matmuls,
    fold_weight_transposes,
    gemms_to_matmuls,
    heldout_windows,
    mean_loss,
    quantize_int8,
    quantize_nbits,
    quantized_accuracy,
)
from export.verify import FP32_TOLERANCE, VerificationFailed, batch_invariant, verify_bundle
from serve.bundle import MANIFEST_FILE, GraphSpec, load_bundle, sha256_file
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence

# The first test to use the demo fixtures may train (~3 min) and export the demo model.
DEMO_TIMEOUT = pytest.mark.timeout(1200)


def session(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    data = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


def dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def test_standard_graph_contract(tiny_bundle: Path) -> None:
    model = onnx.load(str(tiny_bundle / "model.onnx"))
    onnx.checker.check_model(model)
    inputs = {v.name: dims(v) for v in model.graph.input}
    outputs = {v.name: dims(v) for v in model.graph.output}
    assert list(inputs)[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs["input_ids"] == ["batch", "seq"] == inputs["position_ids"]
    assert inputs["attention_mask"] == ["batch", "total"]
    assert inputs["past_key_values.1.value"] == ["batch", 2, "past", 16]
    assert outputs["logits"] == ["batch", "seq", 320]
    assert outputs["present.0.key"] == ["batch", 2, "past + seq", 16]
    assert {o.domain for o in model.opset_import} >= {""}
    assert any(n.op_type == "Attention" for n in model.graph.node)  # opset 23: SDPA -> Attention


def test_zero_length_past_then_decode_matches_torch(tiny_bundle: Path) -> None:
    model = tiny_model()
    sess = session(tiny_bundle / "model.onnx")
    ids = np.array([[5, 9, 77, 3]], np.int64)
    empty = np.zeros((1, 2, 0, 16), np.float32)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(4)[None]}
    feed |= {f"past_key_values.{i}.{k}": empty for i in range(2) for k in ("key", "value")}
    logits, *present = sess.run(None, feed)
    assert logits.shape == (1, 4, 320) and present[0].shape == (1, 2, 4, 16)
    step = {"input_ids": np.array([[11]]), "attention_mask": np.ones((1, 5), np.int64)}
    step |= {"position_ids": np.array([[4]])} | dict(zip(list(feed)[3:], present, strict=True))
    decode_logits, *grown = sess.run(None, step)
    assert grown[0].shape == (1, 2, 5, 16)
    with torch.no_grad():
        expected, _ = model(torch.tensor([[5, 9, 77, 3, 11]]), torch.ones(1, 5), torch.arange(5)[None])
    np.testing.assert_allclose(decode_logits[0, -1], expected[0, -1].numpy(), atol=FP32_TOLERANCE)


def test_export_report_of_tiny_bundle(tiny_bundle: Path) -> None:
    report = load_bundle(tiny_bundle).manifest.verification
    assert report["passed"] and report["failed"] == [] and report["reference"] == "pytorch"
    for graph in ("standard", "inplace"):
        assert report[graph]["max_abs_logits_diff"] <= FP32_TOLERANCE
        assert report[graph]["greedy_identical"] and report[graph]["finite"]
    assert report["standard"]["batch_invariant"]
    assert report["opset"] == 23 and report["decode_steps"] == 20
    assert set(report["files"]) == {"model.onnx", "model_inplace.onnx", "weights.data", "tokenizer.json"}
    assert {"torch", "onnx", "onnxruntime"} <= set(report["versions"])


def _damage_first(model: onnx.ModelProto, dims_: list[int], change: float) -> None:
    init = next(t for t in model.graph.initializer if list(t.dims) == dims_)
    array = numpy_helper.to_array(init).copy()
    array.flat[0] = np.nan if np.isnan(change) else array.flat[0] + change
    init.CopyFrom(numpy_helper.from_array(array, init.name))


@pytest.mark.parametrize(
    ("target", "change", "expected"),
    [
        ([32, 64], 0.5, "standard: max |logits diff|"),  # one FFN weight nudged
        ([32], float("nan"), "standard: NaN/Inf in outputs"),  # a LayerNorm/bias entry is NaN
    ],
)
def test_verification_catches_a_broken_graph(
    tiny_bundle: Path, tmp_path: Path, target: list[int], change: float, expected: str
) -> None:
    root = Path(shutil.copytree(tiny_bundle, tmp_path / "broken"))
    graph = onnx.load(str(root / "model.onnx"))
    _damage_first(graph, target, change)
    onnx.save(graph, str(root / "model.onnx"))
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    manifest["checksums"]["model.onnx"] = sha256_file(root / "model.onnx")
    (root / MANIFEST_FILE).write_text(json.dumps(manifest))
    report = verify_bundle(load_bundle(root), tiny_model())
    assert not report["passed"]
    assert any(expected in f for f in report["failed"]), report["failed"]
    assert "inplace" not in " ".join(report["failed"])  # the untouched serving graph still passes


def test_batch_invariance_check_detects_batch_dependence() -> None:
    model = tiny_model()
    real = torch_step(model)

    def batch_dependent(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        out = real(feed)
        if feed["input_ids"].shape[0] == 1:  # a single row gets a different favourite token
            out[0][..., 42] += 100.0
        return out

    prompts = [[5, 6, 7], [8, 9]]
    shape = Shape(2, 2, 16)
    assert batch_invariant(real, prompts, 1, shape)
    assert not batch_invariant(batch_dependent, prompts, 1, shape)


def test_greedy_left_pads_and_positions() -> None:
    gen = greedy(torch_step(tiny_model()), [[5, 6, 7], [8]], 1, Shape(2, 2, 16), steps=3)
    assert gen.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert gen.tokens.shape == (2, 4) and gen.logits[0].shape == (2, 3, 320)
    assert gen.finite


def test_opset_below_dynamo_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="opset 17 is not supported"):
        export_standard_graph(tiny_model(), opset=17)


def _transposed_head_graph() -> onnx.ModelProto:
    """x @ Transpose(E): the tied-head pattern quantize_dynamic cannot see through."""
    emb = numpy_helper.from_array(np.random.default_rng(0).normal(size=(10, 4)).astype(np.float32), "emb")
    nodes = [
        helper.make_node("Transpose", ["emb"], ["emb_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "emb_t"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 10])],
        [emb],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_fold_weight_transposes_keeps_results_and_enables_quantization() -> None:
    model = _transposed_head_graph()
    x = {"x": np.random.default_rng(1).normal(size=(3, 4)).astype(np.float32)}
    before = session(model).run(None, x)[0]
    assert count_weight_matmuls(model) == {"float": 0, "quantized": 0}  # the head is invisible
    folded = onnx.ModelProto.FromString(model.SerializeToString())
    assert fold_weight_transposes(folded) == 1
    assert [n.op_type for n in folded.graph.node] == ["MatMul"]
    np.testing.assert_allclose(session(folded).run(None, x)[0], before, rtol=1e-6)
    quantized, counts = quantize_int8(model)
    assert counts == {"float": 0, "quantized": 1, "transposes_folded": 1, "gemms_rewritten": 0}
    after = session(quantized).run(None, x)[0]
    assert np.corrcoef(after.ravel(), before.ravel())[0, 1] > 0.95  # int8 of a 4-wide dot: approximate


def test_gemms_by_a_weight_become_matmuls_where_the_sums_are_the_same() -> None:
    """torch traces a Linear on 2-D rows as Gemm, a stacked weight's slice as a Gather: with transB and a
    bias, and from a Gather by a constant index, the Gemm becomes MatMul (and Add), the same to float
    rounding, and is quantized; alpha != 1 is not the same sums and stays a (counted) float Gemm."""
    rng = np.random.default_rng(0)
    stacked, bias = rng.normal(size=(3, 5, 4)), rng.normal(size=5)
    weights = {"stacked": stacked, "bias": bias, "w": rng.normal(size=(4, 5)), "index": np.array(1)}
    inits = [
        numpy_helper.from_array(v.astype(np.float32 if v.ndim else np.int64), k) for k, v in weights.items()
    ]
    nodes = [
        helper.make_node("Gather", ["stacked", "index"], ["expert"], axis=0),
        helper.make_node("Gemm", ["x", "expert", "bias"], ["y"], transB=1),
        helper.make_node("Gemm", ["x", "w"], ["z"], alpha=0.5),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 5]) for n in ("y", "z")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])]
    graph = helper.make_graph(nodes, "gemms", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = {"x": rng.normal(size=(3, 4)).astype(np.float32)}
    before = session(model).run(None, x)
    assert count_weight_matmuls(model) == {"float": 2, "quantized": 0}
    rewritten = onnx.ModelProto.FromString(model.SerializeToString())
    assert gemms_to_matmuls(rewritten) == 1
    assert [n.op_type for n in rewritten.graph.node] == ["MatMul", "Add", "Gemm"]
    assert "stacked" not in {t.name for t in rewritten.graph.initializer}  # its one slice is all it was for
    for got, expected in zip(session(rewritten).run(None, x), before, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    _, counts = quantize_nbits(model, 8, 16)
    assert (counts["gemms_rewritten"], counts["quantized"], counts["float"]) == (1, 1, 1)


def _projection_and_head_graph(k: int) -> onnx.ModelProto:
    """input_ids [batch, seq] -> embedding -> a projection of [batch, seq, k] -> one position per row (as the
    serving graph's head reads it) -> a head of [batch, k]: both ranks of MatMul input the exporter writes."""
    rng = np.random.default_rng(3)
    weights = {
        "table": rng.normal(size=(64, k)),
        "proj": rng.normal(size=(k, k)) / np.sqrt(k),
        "head": rng.normal(size=(k, LOGITS)) / np.sqrt(k),
    }
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["x"], name="tok_emb"),
        helper.make_node("MatMul", ["x", "proj"], ["hidden"]),
        helper.make_node("Unsqueeze", ["last_index", "axes_last"], ["last_2d"]),
        helper.make_node("GatherND", ["hidden", "last_2d"], ["last"], batch_dims=1),
        helper.make_node("MatMul", ["last", "head"], ["logits"]),
    ]
    return head_graph("projection_and_head", nodes, weights, {"axes_last": [-1]}, k)


def _rows_that_differ_alone(model: onnx.ModelProto) -> list[tuple[int, int, int]]:
    """(batch, seq, row) of every row whose outputs in a [batch, seq] run are not exactly its outputs run on
    its own, over batches 1-5 and sequences 1-4 (odd and even row counts, either axis the longer)."""
    sess = session(model)
    rng = np.random.default_rng(4)
    differ = []
    for batch in range(1, 6):
        for seq in range(1, 5):
            ids = rng.integers(0, 64, size=(batch, seq))
            last = rng.integers(0, seq, size=batch)
            hidden, logits = sess.run(None, {"input_ids": ids, "last_index": last})
            for b in range(batch):
                h, lg = sess.run(None, {"input_ids": ids[b : b + 1], "last_index": last[b : b + 1]})
                if not (np.array_equal(h[0], hidden[b]) and np.array_equal(lg[0], logits[b])):
                    differ.append((batch, seq, b))
    return differ


@pytest.mark.parametrize(("bits", "block"), [(4, 16), (4, 32), (4, 128), (8, 64), (8, 128)])
def test_nbits_rows_are_computed_alone_as_in_a_batch(bits: int, block: int) -> None:
    """Past INVARIANT_MAX_BLOCK the odd row counts are padded, as some CPU's one-row kernel needs (which
    blocks it takes depends on the CPU: export.quantize); either way every row must come out exact here."""
    model = _projection_and_head_graph(k=2 * block)
    quantized, counts = quantize_nbits(model, bits, block)
    padded = block > INVARIANT_MAX_BLOCK[bits]
    assert counts["quantized"] == 2 and counts["single_row_padded"] == (2 if padded else 0)
    producers = {o: n.op_type for n in quantized.graph.node for o in n.output}
    consumers = {i: n.op_type for n in quantized.graph.node for i in n.input}
    for node in (n for n in quantized.graph.node if n.op_type == "MatMulNBits"):
        wrapped = producers[node.input[0]] == "Pad" and consumers[node.output[0]] == "Slice"
        assert wrapped == padded
    assert _rows_that_differ_alone(quantized) == []
    unpadded = quantize_nbits(model, bits, block, pad_rows=False)[0]
    assert not {n.op_type for n in unpadded.graph.node} & {"Pad", "Slice"}


def test_nbits_copies_the_float_graph_unless_in_place() -> None:
    """The exporter quantizes in place so the float weights are not copied at its memory peak; other callers
    (which quantize one graph several ways) keep theirs float."""
    model = _projection_and_head_graph(k=64)
    float_ops = [n.op_type for n in model.graph.node]
    copied = quantize_nbits(model, 8, 64)[0]
    assert copied is not model and [n.op_type for n in model.graph.node] == float_ops
    same, counts = quantize_nbits(model, 8, 64, in_place=True)
    assert same is model and counts["float"] == 0
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in copied.graph.node]
    assert _rows_that_differ_alone(same) == []


@pytest.mark.parametrize("bits", [4, 8])
def test_nbits_quantizes_every_weight_matmul_and_the_token_embedding(tiny_bundle: Path, bits: int) -> None:
    layers = PRESETS["tiny"].n_layers
    for role, counts in quantized_graphs(tiny_bundle, Precision(f"int{bits}")).stats.items():
        assert counts["float"] == 0, role
        assert counts["quantized"] == 4 * layers + 1, role  # qkv, out, up, down; the head
        assert counts["quantized_gathers"] == 1, role  # the token embedding; positions stay float


@pytest.mark.parametrize("bits", [4, 8])
def test_the_quantized_embedding_looks_up_the_rounded_rows(bits: int) -> None:
    """GatherBlockQuantized returns each row within half a quantization step of the float table's."""
    table = np.random.default_rng(2).normal(size=(50, 48)).astype(np.float32)  # a partial second block
    node = helper.make_node("Gather", ["table", "input_ids"], ["rows"], name="tok_emb")
    graph = helper.make_graph(
        [node],
        "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, ["n", 48])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    quantized, counts = quantize_nbits(model, bits, 32)
    assert counts["quantized_gathers"] == 1 and [n.op_type for n in quantized.graph.node] == [
        "GatherBlockQuantized"
    ]
    assert {t.name for t in quantized.graph.initializer}.isdisjoint({"table"})  # the float table is gone
    ids = np.array([0, 7, 49, 7])
    rows = session(quantized).run(None, {"input_ids": ids})[0]
    for block in (slice(0, 32), slice(32, 48)):
        step = np.abs(table[ids, block]).max(axis=-1, keepdims=True) / (2 ** (bits - 1) - 1)
        assert (np.abs(rows[:, block] - table[ids, block]) <= step / 2 + 1e-6).all()


@DEMO_TIMEOUT
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_bundle_of_the_demo_model(
    demo_bundle: Path, demo_checkpoint: Path, tmp_path: Path, kind: str
) -> None:
    ckpt = load_checkpoint(demo_checkpoint)
    precision = Precision(kind)
    options = ExportOptions(model_name=f"demo-{kind}", precision=precision, progress=False)
    graphs = quantized_graphs(demo_bundle, precision)
    bundle = write_verified_bundle(ckpt.model, ckpt.tokenizer, graphs, tmp_path / kind, options)
    m = bundle.manifest
    assert m.quantization == kind and m.execution_providers == ["CPUExecutionProvider"]
    assert m.quantization_block_size == precision.block and m.batch_invariant
    assert m.odd_rows_padded == (kind == "int4")  # the defaults: 4 bits block 32, 8 bits block 64
    report = m.verification
    quant = report[kind]
    assert report["passed"], report["failed"]
    assert report["batch_invariance_required"] and report["batch_invariant"]
    assert report["standard"]["batch_invariant"] and report["inplace"]["batch_invariant"]
    assert quant["float_weight_matmuls"] == 0
    assert quant["fp32_perplexity"] < 0.5 * ckpt.config.vocab_size  # a trained model, not a uniform guess
    assert 0 < quant["perplexity_ratio"] <= (1.02 if kind == "int8" else 1.1)
    assert quant["max_perplexity_ratio"] == (1.02 if kind == "int8" else None)
    for share in ("top1_agreement", "greedy_prefix_agreement"):
        assert 0.0 <= quant[share] <= 1.0
    assert quant["top1_agreement"] >= (0.95 if kind == "int8" else 0.8)
    assert 0 < quant["max_abs_logits_diff"] < 10
    assert report["standard"]["finite"] and report["inplace"]["finite"]


def test_quantized_accuracy_holds_a_few_windows_logits_at_a_time(tiny_bundle: Path) -> None:
    """Its figures are those of all held-out windows' logits at once, without holding them all: at a large
    vocabulary those arrays, not the weights, would be the verification's memory peak."""
    tokenizer = load_bundle(tiny_bundle).tokenizer
    cfg = DecoderConfig(vocab_size=4096, context_length=64, d_model=32, n_layers=1, n_heads=2, d_ff=64)
    torch.manual_seed(0)
    fp32 = Decoder(cfg).eval()
    other = Decoder(cfg).eval()  # a second model as the "quantized" one: its figures differ from fp32's
    shape = Shape(cfg.n_layers, cfg.kv_heads, cfg.head_dim)
    text = Path(quantize_module.__file__).read_text()  # enough for every window, quicker than the corpus
    windows = heldout_windows(tokenizer, cfg.context_length, text)
    all_at_once = [
        greedy(torch_step(m), [list(w) for w in windows], 0, shape, steps=0).logits[0][:, :-1]
        for m in (fp32, other)
    ]
    tracemalloc.start()
    try:
        # Chunks of 3 windows: uneven (of 16), and far below all of them at once.
        budget = 3 * all_at_once[0][0].nbytes
        step, other_step = torch_step(fp32), torch_step(other)
        report = quantized_accuracy(step, other_step, tokenizer, shape, 0, cfg.context_length, text, budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    targets = windows[:, 1:]
    assert report["heldout_tokens"] == targets.size
    assert report["fp32_loss"] == pytest.approx(mean_loss(all_at_once[0], targets), rel=1e-5)
    assert report["quantized_loss"] == pytest.approx(mean_loss(all_at_once[1], targets), rel=1e-5)
    diff = np.abs(all_at_once[0] - all_at_once[1])
    assert report["max_abs_logits_diff"] == pytest.approx(float(diff.max()), rel=1e-5)
    agree = (all_at_once[0].argmax(-1) == all_at_once[1].argmax(-1)).mean()
    assert report["top1_agreement"] == pytest.approx(float(agree), abs=1e-3)  # a near tie may flip
    # A few windows' arrays, not all of one model's.
    assert len(windows) == LOSS_WINDOWS and peak < all_at_once[0].nbytes


def test_dynamic_int8_is_reported_not_batch_invariant(tiny_bundle: Path, tmp_path: Path) -> None:
    precision = Precision("int8-dynamic")
    options = ExportOptions(model_name="tiny-int8-dynamic", precision=precision, progress=False)
    graphs = quantized_graphs(tiny_bundle, precision)
    bundle = write_verified_bundle(
        tiny_model(), load_bundle(tiny_bundle).tokenizer, graphs, tmp_path / "b", options
    )
    m = bundle.manifest
    assert m.quantization == "int8" and m.quantization_block_size is None
    # Measured and reported, not required: one activation scale per step couples the rows of a batch.
    assert not m.verification["batch_invariance_required"] and not m.batch_invariant
    assert isinstance(m.verification["batch_invariant"], bool) and m.verification["passed"]


def test_fp16_graphs_are_valid_and_safe(tiny_bundle: Path) -> None:
    for file in ("model.onnx", "model_inplace.onnx"):
        model = convert_fp16(onnx.load(str(tiny_bundle / file)))
        check_graph(model)
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
        assert types["logits"] == TensorProto.FLOAT16
        assert types["input_ids"] == TensorProto.INT64
        kv = [name for name in types if "key" in name or "value" in name]
        assert kv and all(types[name] == TensorProto.FLOAT16 for name in kv)
        producers = {out: n for n in model.graph.node for out in n.output}
        for node in (n for n in model.graph.node if n.op_type == "LayerNormalization"):
            assert producers[node.input[0]].op_type == "Cast"  # normalized in fp32
        for init in model.graph.initializer:
            if init.data_type == TensorProto.FLOAT16:
                assert np.abs(numpy_helper.to_array(init).astype(np.float32)).max() <= CONSTANT_LIMIT


def test_fp16_standard_graph_runs_finite_on_cpu_with_padding(tiny_bundle: Path) -> None:
    sess = session(convert_fp16(onnx.load(str(tiny_bundle / "model.onnx"))))
    prompts, shape = [[5, 6, 7, 8], [9]], Shape(2, 2, 16)
    gen = greedy(lambda f: sess.run(None, f), prompts, 1, shape, steps=4, dtype=np.float16)
    assert gen.finite  # the padded row's fully masked attention included
    reference = greedy(torch_step(tiny_model()), prompts, 1, shape, steps=4)
    real = gen.prompt_mask.astype(bool)
    assert np.abs(gen.logits[0][real] - reference.logits[0][real]).max() < 5e-2


def _staged(
    tiny_bundle: Path, graphs: tuple[onnx.ModelProto, onnx.ModelProto], out: Path
) -> tuple[Path, dict[str, GraphSpec], int, int]:
    """The two graphs staged and committed as a bundle at `out`: (root, specs, bytes of weights.data after
    the standard graph, bytes the serving graph shared with it)."""
    fields = load_bundle(tiny_bundle).manifest.model_dump(exclude={"checksums", "graphs"})
    with BundleStage(out) as stage:
        specs = {"standard": stage.add_graph("model.onnx", graphs[0], 23)}
        data = stage.dir / "weights.data"
        written = data.stat().st_size if data.exists() else 0
        specs["inplace"] = stage.add_graph("model_inplace.onnx", graphs[1], 20)
        stage.add_tokenizer((tiny_bundle / "tokenizer.json").read_text())
        stage.write_manifest(fields | {"graphs": specs})
        shared = stage.shared_bytes
        stage.commit()
    return out, specs, written, shared


def _tiny_graphs(tiny_bundle: Path, kind: str) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    if kind == "fp32":
        return onnx.load(str(tiny_bundle / "model.onnx")), onnx.load(str(tiny_bundle / "model_inplace.onnx"))
    graphs = quantized_graphs(tiny_bundle, Precision(kind))
    return graphs.standard, graphs.inplace


def _embedded(root: Path, out: Path) -> Path:
    """The bundle at `root` in the layout of bundles written before weights.data: each graph's weights
    inside its own .onnx file, the manifest naming no external data."""
    out.mkdir()
    manifest = json.loads((root / MANIFEST_FILE).read_text())
    for spec in manifest["graphs"].values():
        if spec is None:  # a graph the bundle has not: a LoRA bundle's branch-free one
            continue
        onnx.save(onnx.load(str(root / spec["file"])), str(out / spec["file"]))
        spec["external_data"] = None
    shutil.copy(root / "tokenizer.json", out / "tokenizer.json")
    manifest["checksums"] = {p.name: sha256_file(p) for p in out.iterdir()}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_writer_stores_each_weight_once(tiny_bundle: Path, tmp_path: Path, kind: str) -> None:
    """Both graphs keep their weights in one file, each shared tensor written once: the quantized weights too
    (both graphs quantize the same [in, out] matrices to the same bytes). A bundle in the older layout (each
    graph's weights embedded) serves the same logits."""
    standard, inplace = _tiny_graphs(tiny_bundle, kind)
    inplace_bytes = sum(len(t.raw_data) for t in inplace.graph.initializer if len(t.raw_data) >= 1024)
    root, specs, written, shared = _staged(tiny_bundle, (standard, inplace), tmp_path / "ext")
    bundle = load_bundle(root)
    assert specs["standard"].external_data == specs["inplace"].external_data == "weights.data"
    assert "weights.data" in bundle.manifest.checksums
    for name in ("model.onnx", "model_inplace.onnx"):  # the graphs keep only tensors under 1 KB
        graph = onnx.load(str(root / name), load_external_data=False)
        assert all(len(t.raw_data) < 1024 for t in graph.graph.initializer)
    # Every weight of the serving graph is one the standard graph wrote: nothing was added for it. (Shared can
    # be more: a 4-bit tied embedding's gather and head have the same scales, stored once for both.)
    assert shared >= inplace_bytes and (root / "weights.data").stat().st_size == written
    assert len(session(bundle.standard_graph).get_outputs()) == 5
    older = load_bundle(_embedded(root, tmp_path / "older"))
    assert older.manifest.graphs.standard.external_data is None
    engine = Engine.from_bundle(bundle, EngineSettings(max_batch_size=1))
    inside = Engine.from_bundle(older, EngineSettings(max_batch_size=1))
    for e in (engine, inside):
        e.prefill([NewSequence("s", [5, 6, 7], SamplingParams())])
    np.testing.assert_array_equal(engine.last_logits, inside.last_logits)


def test_stage_refuses_a_non_bundle_directory(tmp_path: Path) -> None:
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a bundle"):
        BundleStage(tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_failed_stage_leaves_the_old_bundle_and_no_temp_dir(tiny_bundle: Path, tmp_path: Path) -> None:
    out = Path(shutil.copytree(tiny_bundle, tmp_path / "b"))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationFailed), BundleStage(out) as stage:
        stage.add_tokenizer("{}")
        raise VerificationFailed({"failed": ["simulated"]})
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    load_bundle(out)  # still intact


@pytest.mark.parametrize(
    ("kind", "block", "message"),
    [
        ("fp32", 32, "applies to --int8 and --int4"),
        ("int8-dynamic", 64, "applies"),
        ("int4", 48, "power of two"),
    ],
)
def test_precision_refuses_a_block_size_it_cannot_use(kind: str, block: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Precision(kind, block)


def test_a_bundle_that_must_be_batch_invariant_fails_verification_when_it_is_not() -> None:
    from export.verify import _failures

    graph = {"finite": True, "batch_invariant": False, "max_abs_logits_diff": 0.0, "greedy_identical": True}
    report = {"tolerance": 1e-4, "standard": graph, "batch_invariance_required": True}
    assert _failures(report, "none") == ["standard: batch invariance"]
    assert _failures({**report, "batch_invariance_required": False}, "none") == []
    # A quantized bundle is judged on its serving graph: the standard graph's left padding changes a row's
    # float rounding, which per-row activation quantization amplifies.
    quantized = {**report, "tolerance": None, "inplace": {**graph, "batch_invariant": True}}
    assert _failures(quantized, "int4") == []
    assert _failures({**quantized, "inplace": graph}, "int4") == ["inplace: batch invariance"]


def _rms_norm_graph() -> onnx.ModelProto:
    """The serving graph's RMSNorm alone (export/onnx_inplace.py), over x [n, 64]."""
    from export.onnx_inplace import _GraphBuilder

    norm = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 64))
    g = _GraphBuilder()
    out = g.norm("x", norm, "ln")
    graph = helper.make_graph(
        g.nodes,
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", 64])],
        g.initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_fp16_rms_norm_does_not_overflow() -> None:
    """x^2 overflows float16 past 256; real residual streams reach thousands. The fp16 graph keeps the norm's
    reduction in float32: finite, and as exact as float16 output allows."""
    fp32 = _rms_norm_graph()
    scales = np.array([[1], [300], [2000], [9000]], np.float32)
    x = (np.random.default_rng(0).normal(size=(4, 64)) * scales).astype(np.float32)
    expected = session(fp32).run(None, {"x": x})[0]
    fp16 = convert_fp16(fp32)
    got = session(fp16).run(None, {"x": x.astype(np.float16)})[0]
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-3, atol=2e-3)
    # ONNX Runtime's CPU kernels widen float16 themselves (a naive conversion stays finite here too), so the
    # overflow a GPU would hit is checked in the graph's types: the square and the mean are float32.
    assert _elem_types(fp16, ("Pow", "ReduceMean", "Sqrt")) == {onnx.TensorProto.FLOAT}
    from onnxruntime.transformers.float16 import convert_float_to_float16

    naive = convert_float_to_float16(
        onnx.ModelProto.FromString(fp32.SerializeToString()), keep_io_types=False
    )
    assert _elem_types(naive, ("Pow", "ReduceMean", "Sqrt")) == {onnx.TensorProto.FLOAT16}


def test_fp16_traced_rms_norm_of_large_activations_stays_finite() -> None:
    """`--opset 18` traces RMSNorm into primitive ops (opset 23 has RMSNormalization, kept float32 whole):
    x * reciprocal(sqrt(mean(x^2) + eps)). Its "+ eps" must stay float32 with the mean, or a residual stream
    past 256 rounds mean(x^2) to inf in float16 and the norm's output collapses to 0. ONNX Runtime's CPU
    kernels compute float16 Adds in float32 and drop such Cast pairs themselves (the values below pass even
    without the fix), so the graph is checked as a GPU would run it: mean(x^2) + eps reaches the square root
    without a float16 round trip."""
    cfg = DecoderConfig(
        vocab_size=64, context_length=32, d_model=32, n_layers=1, n_heads=2, d_ff=32, positions="rotary",
        activation="swiglu", norm="rms", qk_norm=True, tie_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        model.tok_emb.weight.mul_(1e5)  # residual rows of |x| ~ 2000: mean(x^2) ~ 4e6
        model.lm_head.weight.mul_(20)  # logits of a few units from the normalized rows
    fp32 = export_standard_graph(model, opset=18)
    fp16 = convert_fp16(fp32)
    ids = np.array([[3, 9, 27, 17]], np.int64)
    feed = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.arange(ids.shape[1], dtype=np.int64)[None],
    }
    empty = np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32)
    past = {f"past_key_values.0.{kind}": empty for kind in ("key", "value")}
    expected = session(fp32).run(["logits"], feed | past)[0]
    got = session(fp16).run(["logits"], feed | {k: v.astype(np.float16) for k, v in past.items()})[0]
    assert np.abs(expected).max() > 1  # a collapsed norm (all zeros) would not pass the comparison below
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float32), expected, atol=5e-2)
    producers = {out: n for n in fp16.graph.node for out in n.output}
    roots = [producers[n.input[0]] for n in fp16.graph.node if n.op_type == "Sqrt"]
    assert len(roots) == 5  # two block norms, q and k norms, the final norm
    for add in roots:  # the Add of the mean itself (its other input is eps), no Cast between
        assert add.op_type == "Add" and any(
            i in producers and producers[i].op_type == "ReduceMean" for i in add.input
        )


def _elem_types(model: onnx.ModelProto, ops: tuple[str, ...]) -> set[int]:
    """Element types of the outputs of the nodes of `ops`, by shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    return {types[n.output[0]] for n in inferred.graph.node if n.op_type in ops}

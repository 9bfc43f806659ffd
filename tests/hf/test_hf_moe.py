"""Mixtures of experts beyond fp32 parity (which tests/hf/test_hf_import.py checks for every family): the
experts at 8 and 4 bits stay batch invariant, their row pads are those the engine can take out, the router
stays float, and the active-parameter count is what a token reads; gpt-oss's MXFP4 expert weights read as
transformers reads them.

One tiny random Qwen3-MoE (8 experts of width 64, top 2, one dense layer) built once for the module: width
and d_model whole blocks of 32 and 64 weights, so its experts become one QMoE at --int8 and --int4.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hf_models import (
    FAMILIES,
    PROMPTS,
    STEPS,
    build,
    gpt_oss_config,
    run_inplace,
    train_bpe,
)
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM

from export.bundle_writer import ALIGNMENT
from export.checkpoint import load_checkpoint, save_checkpoint
from export.cli import main
from export.hf_import import import_checkpoint
from export.model import Decoder, DecoderConfig, count_active_parameters, count_parameters
from export.moe import (
    QMOE_NAME,
    ROUTER_SUFFIX,
    ExpertActivation,
    Experts,
    ExpertsConfig,
    experts_graph,
    experts_to_qmoe,
    is_expert_tensor,
    pad_expert_rows,
)
from export.mxfp4 import dequantize_mxfp4
from export.onnx_inplace import OPSET, _GraphBuilder, build_inplace_graph
from export.onnx_standard import export_standard_graph
from export.pipeline import architecture_fields
from export.quantize import quantize_nbits
from export.tokenizer import SPECIAL_TOKENS
from serve.api.sizing import scoring_bytes_per_position
from serve.bundle import ROW_PAD_PREFIX, Architecture, load_bundle
from serve.engine.engine import Engine
from serve.engine.row_pad import strip_row_pads
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence

# Five rows of three lengths, two of them alone-sized: each expert sees odd and even row counts.
BATCH = (*PROMPTS, (9,), (77, 78))


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-moe")
    family = FAMILIES["qwen3-moe"]
    build(family.make_config(mlp_only_layers=[1], moe_intermediate_size=64), folder)
    family.save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def moe(moe_folder: Path) -> tuple[Decoder, onnx.ModelProto]:
    model = import_checkpoint(moe_folder).model
    return model, build_inplace_graph(model)


@pytest.fixture(scope="module")
def moe_int8(moe_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model exported at --int8 as an operator exports it: both graphs, verified against transformers."""
    bundle = tmp_path_factory.mktemp("qwen3-moe-int8") / "bundle"
    assert main(["hf", "--model", str(moe_folder), "--out", str(bundle), "--int8"]) == 0
    return bundle


@pytest.mark.parametrize(("bits", "block"), [(None, None), (4, 32), (4, 16), (8, 64)])
def test_experts_are_batch_invariant(
    moe: tuple[Decoder, onnx.ModelProto], bits: int | None, block: int | None
) -> None:
    """Every row's logits at every step, bit for bit, alone and in the batch, at fp32 and quantized (where a
    kernel rounds a lone row otherwise, the experts' even row counts keep it on the batch's kernel)."""
    model, graph = moe
    quantized = graph if bits is None or block is None else quantize_nbits(graph, bits, block)[0]
    batched = run_inplace(quantized, model.cfg, BATCH)
    for row, prompt in enumerate(BATCH):
        alone = run_inplace(quantized, model.cfg, [prompt])
        for t in range(STEPS):
            assert np.array_equal(batched.logits[t][row], alone.logits[t][0]), (bits, row, t)


def test_expert_row_pads_come_out_with_the_dense_ones(moe: tuple[Decoder, onnx.ModelProto]) -> None:
    """int4 at block 32 pads: every expert's MatMulNBits reads an even row count, and the engine's strip
    leaves exactly the graph quantized without pads; the routers are float MatMuls either way."""
    _, graph = moe
    padded, counts = quantize_nbits(graph, 4, 32)
    plain, _ = quantize_nbits(graph, 4, 32, pad_rows=False, qmoe=False)  # as the padded graph: MatMulNBits
    experts = [n for n in padded.graph.node if n.op_type == "MatMulNBits" and is_expert_tensor(n.input[0])]
    assert len(experts) == 2 * 8  # up and down of the one sparse layer's 8 experts
    assert all(n.input[0].endswith("_single_row_pad") for n in experts)
    assert counts["single_row_padded"] > len(experts)  # and the dense projections' MatMulNBits
    routers = [n for n in padded.graph.node if n.name.endswith(ROUTER_SUFFIX)]
    assert [n.op_type for n in routers] == ["MatMul"]
    stripped = copy.deepcopy(padded)
    strip_row_pads(stripped)

    def structure(m: onnx.ModelProto) -> list[tuple[str, list[str], list[str]]]:
        return [(n.op_type, list(n.input), list(n.output)) for n in m.graph.node]

    assert structure(stripped) == structure(plain)


def test_an_int8_bundle_quantizes_every_expert_in_both_graphs(
    moe: tuple[Decoder, onnx.ModelProto], moe_int8: Path
) -> None:
    """The float products by a weight left in either graph are the routers: the standard graph's experts,
    which torch traces as Gemm on 2-D rows, are MatMulNBits too. So the data file holds every weight at most
    twice at 8 bits (the experts once in the serving graph's QMoE layout and once as the standard graph's
    MatMulNBits, a tied embedding as table and head), the routers and norms in float, and each tensor on a
    page of its own; with float experts in the standard graph they alone would take 4 bytes a weight."""
    model, _ = moe
    manifest = load_bundle(moe_int8).manifest
    assert manifest.graphs.inplace is not None and manifest.quantization_block_size is not None
    spans: set[tuple[int, int]] = set()
    for spec in (manifest.graphs.standard, manifest.graphs.inplace):
        graph = onnx.load(str(moe_int8 / spec.file), load_external_data=False)
        weights = {t.name for t in graph.graph.initializer}
        # and a weight's slice, as torch traces an expert's: a Gather of its stacked weights by a constant
        weights |= {n.output[0] for n in graph.graph.node if n.op_type == "Gather" and n.input[1] in weights}
        floats = [n for n in graph.graph.node if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights]
        assert len(floats) == manifest.architecture.sparse_layers, spec.file
        assert all(n.op_type == "MatMul" and n.name.endswith(ROUTER_SUFFIX) for n in floats), spec.file
        for tensor in graph.graph.initializer:
            where = {e.key: e.value for e in tensor.external_data}
            if where:
                spans.add((int(where["offset"]), int(where["length"])))
    parameters = count_parameters(model)
    float_parameters = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 1 or "router" in n)
    per_weight = 1 + 4 / manifest.quantization_block_size  # a byte and its share of a float scale
    stored = sum(length for _, length in spans)
    assert stored < 2 * parameters * per_weight + 2 * 4 * float_parameters
    assert (moe_int8 / "weights.data").stat().st_size <= stored + ALIGNMENT * len(spans)


def test_an_int8_bundles_prompt_logprobs_are_its_generation_logprobs(
    moe: tuple[Decoder, onnx.ModelProto], moe_int8: Path
) -> None:
    """The standard graph, which scores prompts, computes at the serving graph's precision: a generated
    token's score as part of a prompt is the logprob the serving graph gave it, much closer to it than
    both are to the fp32 model's."""
    model, _ = moe
    engine = Engine.from_bundle(load_bundle(moe_int8), EngineSettings(max_batch_size=1))
    for prompt in PROMPTS:
        (first,) = engine.prefill([NewSequence("s", list(prompt), SamplingParams(), logprobs=True)])
        outs = [first] + [engine.decode()[0] for _ in range(STEPS - 1)]
        engine.release(["s"])
        tokens = [out.token_id for out in outs]
        generated = np.array([out.logprob for out in outs])
        scored = np.array(engine.score_prompt([*prompt, *tokens]).logprobs[len(prompt) - 1 :])
        ids = torch.tensor([[*prompt, *tokens]])
        with torch.no_grad():
            logits, _ = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
        steps = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        fp32 = torch.log_softmax(logits[0], dim=-1)[steps, ids[0, steps + 1]].numpy()
        print(prompt[:2], np.abs(scored - generated).max(), np.abs(fp32 - generated).max())
        assert np.abs(scored - generated).max() < np.abs(fp32 - generated).max() / 4


def _standard_logits(graph: onnx.ModelProto, cfg: DecoderConfig, ids: np.ndarray) -> np.ndarray:
    """The standard graph's logits of every position of `ids` [batch, seq], from an empty past."""
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    empty = np.zeros((len(ids), cfg.kv_heads, 0, cfg.head_dim), np.float32)
    feed = {
        "input_ids": ids,
        "attention_mask": np.ones_like(ids),
        "position_ids": np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy(),
    }
    feed |= {f"past_key_values.{i}.{k}": empty for i in range(cfg.n_layers) for k in ("key", "value")}
    return np.asarray(session.run(["logits"], feed)[0])


def test_the_standard_graphs_experts_take_the_row_pads(moe: tuple[Decoder, onnx.ModelProto]) -> None:
    """int4 at block 32 pads: the traced standard graph's experts, Gemms on the flattened batch x seq rows,
    become MatMulNBits that read those rows made even and cut back to batch x seq; the engine's strip
    leaves the graph quantized without pads, and the pads change a logit by less than the quantization
    does, for odd and even row counts alike."""
    model, _ = moe
    standard = export_standard_graph(model)
    padded, counts = quantize_nbits(standard, 4, 32)
    plain, _ = quantize_nbits(standard, 4, 32, pad_rows=False)
    assert counts["float"] == 0 and counts["gemms_rewritten"] == 2 * 8 + 1  # the experts and the router
    assert not [n for n in padded.graph.node if n.op_type == "Gemm"]
    weights = {t.name for t in padded.graph.initializer}
    nbits = [n for n in padded.graph.node if n.op_type == "MatMulNBits"]
    assert all(n.input[0].endswith(f"_{ROW_PAD_PREFIX}") for n in nbits)
    assert len({n.input[0] for n in nbits if n.input[1] in weights}) < len(nbits)  # experts share a pad
    stripped = copy.deepcopy(padded)
    strip_row_pads(stripped)
    assert [(n.op_type, list(n.input)) for n in stripped.graph.node] == [
        (n.op_type, list(n.input)) for n in plain.graph.node
    ]
    rng = np.random.default_rng(0)
    for shape in ((1, 3), (2, 3), (3, 1), (1, 4)):
        ids = rng.integers(3, model.cfg.vocab_size, shape)
        fp32, unpadded = _standard_logits(standard, model.cfg, ids), _standard_logits(plain, model.cfg, ids)
        got = _standard_logits(padded, model.cfg, ids)
        assert got.shape == fp32.shape
        assert np.abs(got - unpadded).max() < np.abs(unpadded - fp32).max(), shape


def test_active_parameters_count_a_tokens_experts(moe: tuple[Decoder, onnx.ModelProto]) -> None:
    model, _ = moe
    cfg = model.cfg
    assert cfg.experts is not None
    per_expert = 3 * cfg.d_model * cfg.experts.d_ff
    unused = cfg.experts.n_experts - cfg.experts.top_k
    assert count_parameters(model) - count_active_parameters(model) == unused * per_expert


def test_a_moe_checkpoint_reads_back(moe: tuple[Decoder, onnx.ModelProto], tmp_path: Path) -> None:
    model, _ = moe
    path = save_checkpoint(tmp_path / "model.pt", model, train_bpe(specials=SPECIAL_TOKENS))
    loaded = load_checkpoint(path)
    assert loaded.config == model.cfg and loaded.config.experts is not None
    ids = torch.tensor([PROMPTS[0]])
    args = (ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    with torch.no_grad():
        assert torch.equal(loaded.model(*args)[0], model(*args)[0])


def test_a_positions_activations_follow_the_experts_it_takes(moe: tuple[Decoder, onnx.ModelProto]) -> None:
    """The manifest's experts fields: a position's feed-forward activations are its top-k experts' (or the
    dense layer's d_ff, the wider here), and the prompt-scoring memory a position takes is below what the
    same model would take with all its experts' width computed."""
    model, _ = moe
    cfg = model.cfg
    assert cfg.experts is not None
    fields = architecture_fields(cfg)
    sparse = Architecture(**fields)
    assert (sparse.n_experts, sparse.experts_top_k, sparse.sparse_layers) == (8, 2, 1)
    assert sparse.token_ffn_width == max(cfg.d_ff, 2 * cfg.experts.d_ff + 8)
    dense = {k: v for k, v in fields.items() if not k.startswith(("n_experts", "expert", "sparse"))}
    all_experts = Architecture(**{**dense, "d_ff": cfg.experts.n_experts * cfg.experts.d_ff})
    assert scoring_bytes_per_position(sparse, 128) < scoring_bytes_per_position(all_experts, 128)
    only_sparse = Architecture(**{**fields, "sparse_layers": cfg.n_layers})
    assert only_sparse.token_ffn_width == 2 * cfg.experts.d_ff + 8


def test_mxfp4_blocks_read_as_transformers_converts_them() -> None:
    from transformers.integrations import mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)  # [E, rows, K/32, 16]
    scales = torch.randint(127 - 20, 127 + 20, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, rows, K]
    theirs = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]
    assert torch.equal(ours, theirs.transpose(1, 2))


def test_gpt_oss_mxfp4_experts_read_exactly(tmp_path: Path) -> None:
    """gpt-oss's experts stored as MXFP4 blocks and scales (as its published checkpoints hold them) import to
    exactly the weights of the same experts stored dense, whose model transformers runs as ours does."""
    dense, packed = tmp_path / "dense", tmp_path / "mxfp4"
    build(gpt_oss_config(), dense)
    tensors = load_file(str(dense / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    blocks: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = tensors[name].shape  # [E, in, out]: the blocks hold [E, out, in / 32, 16]
        codes = torch.randint(0, 256, (experts, n, k // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(120, 125, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
        tensors[name] = dequantize_mxfp4(codes, scales).transpose(1, 2).contiguous()
        blocks |= {f"{name}_blocks": codes, f"{name}_scales": scales}
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    shutil.copytree(dense, packed)
    kept = {k: v for k, v in tensors.items() if f"{k}_blocks" not in blocks}
    save_file(kept | blocks, str(packed / "model.safetensors"), metadata={"format": "pt"})
    ours = import_checkpoint(packed).model
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            ours.state_dict().values(), import_checkpoint(dense).model.state_dict().values(), strict=True
        )
    )
    hf = GptOssForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        theirs = hf(ids).logits
        mine, _ = ours(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    assert float((theirs - mine).abs().max()) <= 1e-4


def _experts_only(experts: Experts, d_model: int) -> onnx.ModelProto:
    """One sparse layer's serving graph alone: x [B,S,D] in, y out."""
    g = _GraphBuilder()
    y = experts_graph(g, "x", experts, d_model, "blocks.0.ffn")
    model = g.model
    model.graph.node.extend(g.nodes)
    model.graph.input.append(
        onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["b", "s", d_model])
    )
    model.graph.output.append(onnx.helper.make_tensor_value_info(y, onnx.TensorProto.FLOAT, None))
    model.opset_import.append(onnx.helper.make_opsetid("", OPSET))
    model.ir_version = 10
    return model


def _random_experts(n_experts: int, bias: bool, d_model: int = 16, width: int = 8) -> Experts:
    torch.manual_seed(0)
    activation: ExpertActivation = "swiglu_clamped" if bias else "swiglu"
    cfg = ExpertsConfig(n_experts, 2, width, "topk_softmax", activation=activation, bias=bias)
    experts = Experts(d_model, cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(std=0.5)
    return experts.eval()


@pytest.mark.parametrize("bias", [False, True])
def test_an_expert_costs_two_operators(bias: bool) -> None:
    """In float, each expert adds its up and down products to the serving graph and nothing else (the
    routing, the gathers, the activation and the sums run once per layer)."""
    counts = [len(_experts_only(_random_experts(e, bias), 16).graph.node) for e in (4, 8)]
    assert counts[1] - counts[0] == 2 * 4


@pytest.mark.parametrize(("bits", "block"), [(4, 16), (8, 64)])
def test_quantized_experts_are_one_qmoe_a_layer(
    moe: tuple[Decoder, onnx.ModelProto], bits: int, block: int
) -> None:
    """Where no row pad applies (--int8, --int4 at block 16) a sparse layer's experts are one QMoE, whatever
    their number: no expert's products, Splits or Concats are left, and the layer's nodes do not grow with
    its experts."""
    _, graph = moe
    quantized = quantize_nbits(graph, bits, block)[0]
    nodes = quantized.graph.node
    assert [n.name for n in nodes if n.op_type == "QMoE"] == [f"blocks.0.ffn{QMOE_NAME}"]
    assert not [n.name for n in nodes if ".experts." in n.name or (n.op_type == "Concat" and "ffn" in n.name)]
    layer = [n for n in nodes if n.name.startswith("blocks.0.ffn/")]
    assert len(layer) <= 40
    sizes = []
    for e in (4, 16):
        plain = _experts_only(_random_experts(e, False, d_model=64, width=64), 64)
        sizes.append(len(quantize_nbits(plain, bits, block)[0].graph.node))
    assert sizes[0] == sizes[1]


@pytest.mark.parametrize(("bits", "block"), [(4, 16), (8, 32)])
def test_a_layers_qmoe_computes_its_matmulnbits(bits: int, block: int) -> None:
    """One layer's QMoE gives what the same quantized weights give as the sorted gather's MatMulNBits, to
    float rounding (another SwiGLU), for 1 to 9 tokens and a batch of 40, and each of the 40 tokens bit for
    bit the same alone as in the batch. Biased experts (gpt-oss), and experts at a block size whose rows
    are padded, keep their MatMulNBits."""
    experts = _random_experts(8, False, d_model=64, width=64)
    gathers = quantize_nbits(_experts_only(experts, 64), bits, block, qmoe=False)[0]
    fused = copy.deepcopy(gathers)
    assert experts_to_qmoe(fused) == 1
    assert not [n for n in fused.graph.node if n.op_type == "MatMulNBits"]
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (gathers, fused)
    ]
    rng = np.random.default_rng(0)
    for n in (*range(1, 10), 40):
        x = rng.standard_normal((1, n, 64)).astype(np.float32)
        reference, y = (s.run(None, {"x": x})[0] for s in sessions)
        np.testing.assert_allclose(y, reference, rtol=1e-4, atol=1e-4)
    batched = sessions[1].run(None, {"x": x})[0]
    for t in range(x.shape[1]):
        assert np.array_equal(sessions[1].run(None, {"x": x[:, t : t + 1]})[0][0, 0], batched[0, t]), t
    biased = _experts_only(_random_experts(8, True, d_model=64, width=64), 64)
    for model, b in ((biased, block), (_experts_only(experts, 64), 32 if bits == 4 else 128)):
        kept, counts = quantize_nbits(model, bits, b)
        assert counts["qmoe_layers"] == 0
        assert sum(n.op_type == "MatMulNBits" for n in kept.graph.node) == 2 * 8


@pytest.mark.parametrize("bias", [False, True])
def test_expert_row_pads_give_even_counts_and_the_same_output(bias: bool) -> None:
    """pad_expert_rows on one layer: every expert's products read an even row count (its real rows, the last
    repeated when odd) and the layer's output is bit for bit the unpadded one's, itself the PyTorch
    module's, for 1 to 9 tokens (experts with no token, one, and several)."""
    experts = _random_experts(8, bias)
    plain = _experts_only(experts, 16)
    padded = copy.deepcopy(plain)
    pad_expert_rows(padded)
    names = [f"blocks.0.ffn.experts.{e}/{t}" for e in range(8) for t in ("rows", "hidden")]
    padded.graph.output.extend(
        onnx.helper.make_tensor_value_info(f"{n}_{ROW_PAD_PREFIX}", onnx.TensorProto.FLOAT, None)
        for n in names
    )
    plain.graph.output.extend(
        onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names
    )
    sessions = [
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        for m in (plain, padded)
    ]
    rng = np.random.default_rng(0)
    odd = 0
    for n in range(1, 10):
        x = rng.standard_normal((1, n, 16)).astype(np.float32)
        (y, *real), (y_padded, *parts) = (s.run(None, {"x": x}) for s in sessions)
        assert np.array_equal(y, y_padded), n
        with torch.no_grad():
            np.testing.assert_allclose(y, experts(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)
        for rows, part in zip(real, parts, strict=True):
            m = len(rows)
            assert len(part) == m + m % 2 and np.array_equal(part[:m], rows), n
            assert m % 2 == 0 or np.array_equal(part[m], rows[m - 1])
            odd += m % 2
    assert odd  # the pads were exercised

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
from hf_models import PROMPTS, STEPS, build, gpt_oss_config, qwen3_moe_config, run_inplace, train_bpe
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM

from export.checkpoint import load_checkpoint, save_checkpoint
from export.hf_import import import_checkpoint
from export.model import Decoder, count_active_parameters, count_parameters
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
from export.pipeline import architecture_fields
from export.quantize import quantize_nbits
from export.tokenizer import SPECIAL_TOKENS
from serve.api.sizing import scoring_bytes_per_position
from serve.bundle import ROW_PAD_PREFIX, Architecture
from serve.engine.row_pad import strip_row_pads

# Five rows of three lengths, two of them alone-sized: each expert sees odd and even row counts.
BATCH = (*PROMPTS, (9,), (77, 78))


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Decoder, onnx.ModelProto]:
    folder = tmp_path_factory.mktemp("qwen3-moe")
    build(qwen3_moe_config(mlp_only_layers=[1], moe_intermediate_size=64), folder)
    model = import_checkpoint(folder).model
    return model, build_inplace_graph(model)


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

"""The serving graph: the decoder written directly as ONNX, with an in-place KV cache.

Why not the traced graph: its attention concatenates past and new keys/values, so every decode step copies the
whole cache (measured: 42% of a batch-16, 512-token decode). ONNX Runtime's
`GroupQueryAttention` (com.microsoft) instead writes the new keys/values into a preallocated
`[batch, heads, capacity, head_dim]` buffer; binding one OrtValue as both the past input and the present
output makes the update in place. The graph is written from the state dict, as ONNX Runtime GenAI's builder
does, and checked against the PyTorch model by export.verify.

Semantics the engine relies on (GroupQueryAttention has no key-padding mask):
- rows are right-padded: a row's cache entries [0, len) are valid;
- `seqlens_k[b]` = tokens in row b's cache after this step, minus one;
- `total_sequence_length` = the padded `seq` at prefill, max over rows of tokens in cache at decode;
- `last_index[b]` picks the position whose logits are returned, so the head runs on one position per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.model import Decoder, rotary_tables, sinusoidal_table

OPSET = 20
MS_DOMAIN = "com.microsoft"


def inplace_io_names(n_layers: int) -> tuple[list[str], list[str]]:
    kv_in = [f"past_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    kv_out = [f"present_{kind}.{i}" for i in range(n_layers) for kind in ("key", "value")]
    inputs = ["input_ids", "position_ids", "seqlens_k", "total_sequence_length", "last_index", *kv_in]
    return inputs, ["logits", *kv_out]


class _GraphBuilder:
    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        return name

    def const_i64(self, name: str, values: list[int]) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def node(
        self,
        op: str,
        inputs: list[str],
        name: str,
        outputs: list[str] | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        outputs = outputs or [name]
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs

    def linear(self, x: str, w: torch.Tensor, b: torch.Tensor | None, name: str) -> str:
        # nn.Linear stores [out, in]; MatMul wants [in, out]. A plain initializer (no Transpose node) lets
        # quantize_dynamic quantize every projection, the tied head included.
        (y,) = self.node(
            "MatMul", [x, self.weight(f"{name}.weight_t", w.detach().numpy().T)], f"{name}/matmul"
        )
        if b is None:
            return y
        return self.node("Add", [y, self.weight(f"{name}.bias", b.detach().numpy())], f"{name}/add")[0]

    def layer_norm(self, x: str, ln: torch.nn.LayerNorm, name: str) -> str:
        scale = self.weight(f"{name}.weight", ln.weight.detach().numpy())
        bias = self.weight(f"{name}.bias", ln.bias.detach().numpy())
        return self.node("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=ln.eps)[0]


def build_inplace_graph(model: Decoder) -> onnx.ModelProto:
    """Write `model` as the in-place GroupQueryAttention graph described in the module docstring."""
    cfg = model.cfg
    if cfg.positions == "rotary" and cfg.head_dim % 16:
        raise ValueError(
            f"rotary positions need head_dim to be a multiple of 16 for ONNX Runtime's GroupQueryAttention "
            f"(got {cfg.head_dim} = d_model {cfg.d_model} / n_heads {cfg.n_heads})"
        )
    model = model.eval()
    g = _GraphBuilder()

    (x,) = g.node(
        "Gather", [g.weight("tok_emb.weight", model.tok_emb.weight.detach().numpy()), "input_ids"], "tok_emb"
    )
    rotary_inputs: list[str] = []
    if cfg.positions == "learned":
        table = model.pos_emb.weight.detach().numpy()
    elif cfg.positions == "sinusoidal":
        table = sinusoidal_table(cfg.context_length, cfg.d_model).numpy()
    else:
        table = None
        cos, sin = rotary_tables(cfg.context_length, cfg.head_dim, cfg.rope_theta)
        rotary_inputs = [g.weight("rope.cos", cos.numpy()), g.weight("rope.sin", sin.numpy())]
    if table is not None:
        (pos,) = g.node("Gather", [g.weight("pos_table", table), "position_ids"], "pos_emb")
        (x,) = g.node("Add", [x, pos], "emb_add")

    for i, block in enumerate(model.block_list()):
        p = f"blocks.{i}"
        h = g.layer_norm(x, block.ln_attn, f"{p}.ln_attn")
        qkv = g.linear(h, block.attn.qkv.weight, block.attn.qkv.bias, f"{p}.attn.qkv")
        attn_inputs = [
            qkv,
            "",
            "",
            f"past_key.{i}",
            f"past_value.{i}",
            "seqlens_k",
            "total_sequence_length",
            *rotary_inputs,
        ]
        # The presents are graph outputs directly (no Identity), so a buffer bound to both past and present is
        # written in place rather than copied.
        (attn, _, _) = g.node(
            "GroupQueryAttention",
            attn_inputs,
            f"{p}.attn.gqa",
            domain=MS_DOMAIN,
            outputs=[f"{p}.attn.gqa", f"present_key.{i}", f"present_value.{i}"],
            num_heads=cfg.n_heads,
            kv_num_heads=cfg.n_heads,
            do_rotary=int(bool(rotary_inputs)),
            rotary_interleaved=0,
        )
        a = g.linear(attn, block.attn.out.weight, block.attn.out.bias, f"{p}.attn.out")
        (x,) = g.node("Add", [x, a], f"{p}.attn_residual")
        h = g.layer_norm(x, block.ln_ffn, f"{p}.ln_ffn")
        h = g.linear(h, block.ffn.up.weight, block.ffn.up.bias, f"{p}.ffn.up")
        (h,) = g.node("Gelu" if cfg.activation == "gelu" else "Relu", [h], f"{p}.ffn.act")
        h = g.linear(h, block.ffn.down.weight, block.ffn.down.bias, f"{p}.ffn.down")
        (x,) = g.node("Add", [x, h], f"{p}.ffn_residual")

    # Only the last_index position of each row reaches the final norm and the vocabulary projection.
    (idx,) = g.node("Unsqueeze", ["last_index", g.const_i64("axes_last", [-1])], "last_index_2d")
    (x,) = g.node("GatherND", [x, idx], "gather_last", batch_dims=1)  # [B,D]
    x = g.layer_norm(x, model.ln_f, "ln_f")
    g.node("MatMul", [x, g.weight("lm_head.weight_t", model.lm_head.weight.detach().numpy().T)], "logits")

    return _make_model(g, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.vocab_size)


def _make_model(g: _GraphBuilder, n_layers: int, heads: int, head_dim: int, vocab: int) -> onnx.ModelProto:
    kv_shape: list[str | int] = ["batch", heads, "capacity", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("last_index", TensorProto.INT64, ["batch"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", vocab])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", TensorProto.FLOAT, kv_shape))
    graph = helper.make_graph(g.nodes, "textgen_inplace", inputs, outputs, g.initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
        producer_name="textgen-export",
    )
    model.ir_version = 10
    return model

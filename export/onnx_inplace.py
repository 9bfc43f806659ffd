"""The serving graph: the decoder written directly as ONNX, with an in-place KV cache.

Why not the traced graph: its attention concatenates past and new keys/values, so every decode step copies the
whole cache (a large part of a long batched decode: docs/benchmarks.md). ONNX Runtime's
`GroupQueryAttention` (com.microsoft) instead writes the new keys/values into a preallocated
`[batch, kv heads, capacity, head_dim]` buffer; binding one OrtValue as both the past input and the present
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

from export.model import (
    GATED_ACTIVATIONS,
    Block,
    Decoder,
    DecoderConfig,
    LayerAttention,
    rotary_tables,
    sinusoidal_table,
)
from export.moe import Experts, experts_graph
from serve.lora_layout import (
    LORA_POSITIONS_INPUT,
    LORA_ROUTING_INPUTS,
    LORA_ROWS_INPUT,
    LORA_TOKENS_INPUT,
    LoraBranch,
    LoraLayout,
)

OPSET = 20
MS_DOMAIN = "com.microsoft"


class _GraphBuilder:
    def __init__(self, lora: LoraLayout | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.lora = lora
        self._lora_branches = {} if lora is None else {b.projection: b for b in lora.branches}
        self._consts: dict[str, list[int] | float] = {}
        # The weights go straight into the model they end in: helper.make_graph and helper.make_model would
        # each copy every initializer (three copies of the weights alive at once at the peak).
        self.model = onnx.ModelProto()

    @property
    def initializers(self) -> Any:  # the graph's repeated TensorProto field
        return self.model.graph.initializer

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name))
        return name

    def const_i64(self, name: str, values: list[int]) -> str:
        """An int64 initializer; asked for again by name, the same one (the LoRA branches share theirs)."""
        return self._constant(name, values, np.int64)

    def scalar(self, name: str, value: float) -> str:
        """A float32 scalar initializer; asked for again by name, the same one."""
        return self._constant(name, value, np.float32)

    def _constant(self, name: str, value: list[int] | float, dtype: type[np.generic]) -> str:
        known = self._consts.get(name)
        if known is None:
            self._consts[name] = value
            self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        elif known != value:
            raise ValueError(f"constant {name!r} asked for as {value}, already {known}")
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
        if b is not None:
            (y,) = self.node("Add", [y, self.weight(f"{name}.bias", b.detach().numpy())], f"{name}/add")
        branch = self._lora_branches.get(name)
        return y if branch is None else self.lora_branch(x, y, branch)

    def lora_branch(self, x: str, y: str, branch: LoraBranch) -> str:
        """y + (x @ a_s) @ b_s for each token with an adapter, s its slot: the tokens gathered slot by slot
        (lora_rows), each slot's products on its own tokens, added back where they came from
        (export/lora.py), in products that sum a token's terms in the same blocks alone and in any batch
        (LoraLayout says why)."""
        assert self.lora is not None
        name, rank, parts = f"{branch.projection}/lora", self.lora.max_rank, len(branch.parts)
        # FusedMatMul with alpha 1/2 then 2, not MatMul: ONNX Runtime's CPU MatMul by a weight it has not
        # packed at load computes a single row (a lone decode step) with another kernel than several, which
        # rounds differently; an alpha other than 1 keeps every row count on one kernel. Scaling by powers of
        # two is exact, so the product is x @ a @ b still.
        (xs,) = self.node("GatherND", [x, LORA_ROWS_INPUT], f"{name}/by_slot")  # [k,1,n,in]
        (xa,) = self.node(
            "FusedMatMul", [xs, branch.a_input], f"{name}/a", domain=MS_DOMAIN, alpha=0.5
        )  # [k,groups,n,group]
        (xa,) = self.node("Transpose", [xa], f"{name}/a_tokens", perm=[0, 2, 1, 3])  # [k,n,groups,group]
        width = self.lora.width(branch)
        (xa,) = self.node(
            "Reshape", [xa, self.const_i64(f"lora.width_{width}", [0, 0, width])], f"{name}/a_flat"
        )  # [k,n,parts*rank]
        xas = (
            self.node(
                "Split",
                [xa, self.const_i64(f"lora.split_{parts}", [rank] * parts)],
                f"{name}/split",
                outputs=[f"{name}/part_{j}" for j in range(parts)],
                axis=-1,
            )
            if parts > 1
            else [xa]
        )  # [k,n,rank] each
        # Each part's own b over its own output features: no part multiplies the zeros of the others.
        ds = []  # [k,n,features] each
        for j, xa_j in enumerate(xas):
            b = branch.b_input(j)
            ds += self.node("FusedMatMul", [xa_j, b], f"{name}/b{j}", domain=MS_DOMAIN, alpha=2.0)
        (d,) = self.node("Concat", ds, f"{name}/concat", axis=2) if parts > 1 else ds
        (d,) = self.node("GatherND", [d, LORA_POSITIONS_INPUT], f"{name}/own")  # [m,out]
        return self.node("ScatterND", [y, LORA_TOKENS_INPUT, d], f"{name}/add", reduction="add")[0]

    def swiglu(self, h: str, d_ff: int, name: str) -> str:
        """silu(gate) * up of h [..., 2F] = [gate; up]."""
        return self.gated(h, d_ff, name, "swiglu")

    def gated(self, h: str, d_ff: int, name: str, activation: str) -> str:
        """act(gate) * up of h [..., 2F] = [gate; up]: silu (SwiGLU) or tanh-approximated GELU (GeGLU)."""
        gate, up = self.node(
            "Split",
            [h, self.const_i64(f"{name}.gate_up_sizes", [d_ff, d_ff])],
            f"{name}.gate_up",
            outputs=[f"{name}.gate", f"{name}.up_half"],
            axis=-1,
        )
        if activation == "geglu":
            (act,) = self.node("Gelu", [gate], f"{name}.gelu", approximate="tanh")
        else:
            (sig,) = self.node("Sigmoid", [gate], f"{name}.sigmoid")
            (act,) = self.node("Mul", [gate, sig], f"{name}.silu")
        return self.node("Mul", [act, up], f"{name}.act")[0]

    def norm(self, x: str, module: torch.nn.Module, name: str) -> str:
        """LayerNormalization, or RMSNorm as x / sqrt(mean(x^2) + eps) * weight over the last axis: the
        primitive ops ONNX Runtime's SimplifiedLayerNormFusion turns into one kernel."""
        if isinstance(module, torch.nn.LayerNorm):
            scale = self.weight(f"{name}.weight", module.weight.detach().numpy())
            bias = self.weight(f"{name}.bias", module.bias.detach().numpy())
            return self.node("LayerNormalization", [x, scale, bias], name, axis=-1, epsilon=module.eps)[0]
        if not isinstance(module, torch.nn.RMSNorm) or module.weight is None or module.eps is None:
            raise TypeError(f"{name}: not a LayerNorm or an RMSNorm with weight and eps: {module}")
        (sq,) = self.node("Pow", [x, self.weight(f"{name}.two", np.array(2.0))], f"{name}/pow")
        (ms,) = self.node(
            "ReduceMean", [sq, self.const_i64(f"{name}.axes", [-1])], f"{name}/mean", keepdims=1
        )
        (ms,) = self.node("Add", [ms, self.weight(f"{name}.eps", np.array(module.eps))], f"{name}/add_eps")
        (rms,) = self.node("Sqrt", [ms], f"{name}/sqrt")
        (y,) = self.node("Div", [x, rms], f"{name}/div")
        return self.node("Mul", [y, self.weight(f"{name}.weight", module.weight.detach().numpy())], name)[0]

    def scaled(self, x: str, scale: float, name: str) -> str:
        """x times a constant, or x itself for 1."""
        if scale == 1.0:
            return x
        return self.node("Mul", [x, self.weight(f"{name}.value", np.array(scale))], name)[0]

    def softcap(self, x: str, cap: float, name: str) -> str:
        """cap * tanh(x / cap)."""
        c = self.weight(f"{name}.cap", np.array(cap))
        (y,) = self.node("Div", [x, c], f"{name}/div")
        (y,) = self.node("Tanh", [y], f"{name}/tanh")
        return self.node("Mul", [y, c], name)[0]

    def head_norm(self, x: str, module: torch.nn.Module, heads: int, head_dim: int, name: str) -> str:
        """The norm over each head of x [B,S,heads*Dh]: reshaped to [B,S,heads,Dh] and back."""
        (h,) = self.node(
            "Reshape", [x, self.const_i64(f"{name}.heads", [0, 0, heads, head_dim])], f"{name}/split"
        )
        h = self.norm(h, module, name)
        return self.node(
            "Reshape", [h, self.const_i64(f"{name}.flat", [0, 0, heads * head_dim])], f"{name}/join"
        )[0]


def local_window_size(sliding_window: int) -> int:
    """GroupQueryAttention's local_window_size for a window of W keys (the query's own included, as
    transformers' Mistral): W itself, -1 (off) for no window. Measured on ONNX Runtime 1.32's CPU kernel
    against transformers' Mistral with window 8 on sequences of up to 48 tokens (tests/hf/test_hf_import.py):
    W matches to 1e-5 in prefill and decode, W - 1 and W + 1 differ by > 1 in the logits."""
    return sliding_window if sliding_window else -1


def build_inplace_graph(model: Decoder, lora: LoraLayout | None = None) -> onnx.ModelProto:
    """Write `model` as the in-place GroupQueryAttention graph described in the module docstring, with
    `lora`'s branches (export/lora.py) if given."""
    cfg = model.cfg
    if cfg.positions == "rotary" and (cfg.head_dim % 16 or cfg.rotary_features % 16):
        raise ValueError(
            "rotary positions need head_dim and the rotated features to be multiples of 16 for ONNX "
            f"Runtime's GroupQueryAttention (got {cfg.head_dim} and {cfg.rotary_features})"
        )
    model = model.eval()
    g = _GraphBuilder(lora)

    (x,) = g.node(
        "Gather", [g.weight("tok_emb.weight", model.tok_emb.weight.detach().numpy()), "input_ids"], "tok_emb"
    )
    x = g.scaled(x, cfg.embedding_scale, "emb_scale")
    if cfg.positions != "rotary":
        if cfg.positions == "learned":
            table = model.pos_emb.weight.detach().numpy()
        else:
            table = sinusoidal_table(cfg.context_length, cfg.d_model).numpy()
        (pos,) = g.node("Gather", [g.weight("pos_table", table), "position_ids"], "pos_emb")
        (x,) = g.node("Add", [x, pos], "emb_add")
    rotary_inputs: dict[float, list[str]] = {}
    for j, theta in enumerate(cfg.rope_thetas):
        # [context, rotary/2] each, the RoPE scaling already in the frequencies
        cos, sin = rotary_tables(cfg, theta)
        suffix = f"_{j}" if j else ""
        rotary_inputs[theta] = [
            g.weight(f"rope.cos{suffix}", cos.numpy()),
            g.weight(f"rope.sin{suffix}", sin.numpy()),
        ]

    for i, (block, layer) in enumerate(zip(model.block_list(), cfg.layers, strict=True)):
        rotary = rotary_inputs.get(layer.rope_theta, []) if layer.rotary else []
        x = _block(g, cfg, block, layer, rotary, x, i)

    # Only the last_index position of each row reaches the final norm and the vocabulary projection.
    (idx,) = g.node("Unsqueeze", ["last_index", g.const_i64("axes_last", [-1])], "last_index_2d")
    (x,) = g.node("GatherND", [x, idx], "gather_last", batch_dims=1)  # [B,D]
    x = g.norm(x, model.ln_f, "ln_f")
    head = [x, g.weight("lm_head.weight_t", model.lm_head.weight.detach().numpy().T)]
    if cfg.logit_scale == 1.0 and not cfg.logit_softcap:
        g.node("MatMul", head, "logits")
    else:
        # The head's input declared [batch, d_model]: export/row_pad.py reads a projection's rows from it when
        # the projection's own output is not the graph's [batch, vocab] output.
        g.model.graph.value_info.append(
            helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", cfg.d_model])
        )
        (y,) = g.node("MatMul", head, "lm_head")
        y = g.scaled(y, cfg.logit_scale, "logit_scale")
        if cfg.logit_softcap:
            y = g.softcap(y, cfg.logit_softcap, "logit_softcap")
        g.node("Identity", [y], "logits")

    return _make_model(g, cfg.n_layers, cfg.kv_heads, cfg.head_dim, cfg.vocab_size)


def _block(
    g: _GraphBuilder,
    cfg: DecoderConfig,
    block: Block,
    layer: LayerAttention,
    rotary: list[str],
    x: str,
    i: int,
) -> str:
    """Layer i: attention then MLP, each with the norms of cfg.norm_placement and the residual scale."""
    p = f"blocks.{i}"
    attn = block.attn
    h = g.norm(x, block.ln_attn, f"{p}.ln_attn") if block.ln_attn is not None else x
    qkv = g.linear(h, attn.qkv.weight, attn.qkv.bias, f"{p}.attn.qkv")  # [B,S,H*Dh + 2*Hkv*Dh]
    if attn.q_norm is not None and attn.k_norm is not None:
        # The q/k norms come before the rotation GroupQueryAttention applies: q, k, v go in apart.
        q, k, v = g.node(
            "Split",
            [qkv, g.const_i64(f"{p}.attn.qkv_sizes", [cfg.q_dim, cfg.kv_dim, cfg.kv_dim])],
            f"{p}.attn.qkv_split",
            outputs=[f"{p}.attn.q", f"{p}.attn.k", f"{p}.attn.v"],
            axis=-1,
        )
        if attn.per_head_norm:
            q = g.head_norm(q, attn.q_norm, cfg.n_heads, cfg.head_dim, f"{p}.attn.q_norm")
            k = g.head_norm(k, attn.k_norm, cfg.kv_heads, cfg.head_dim, f"{p}.attn.k_norm")
        else:
            q, k = g.norm(q, attn.q_norm, f"{p}.attn.q_norm"), g.norm(k, attn.k_norm, f"{p}.attn.k_norm")
        qkv_inputs = [q, k, v]
    else:
        qkv_inputs = [qkv, "", ""]  # packed
    attn_inputs = [
        *qkv_inputs,
        f"past_key.{i}",
        f"past_value.{i}",
        "seqlens_k",
        "total_sequence_length",
        *rotary,
    ]
    if attn.sinks is not None:  # inputs 7-10 (cos, sin, position_ids, attention_bias) before head_sink
        sinks = g.weight(f"{p}.attn.sinks", attn.sinks.detach().numpy())
        attn_inputs += [""] * (11 - len(attn_inputs)) + [sinks]
    attrs: dict[str, Any] = {}
    if layer.window:
        attrs["local_window_size"] = local_window_size(layer.window)
    if cfg.attn_scale:
        attrs["scale"] = cfg.attn_scale
    if cfg.attn_softcap:
        attrs["softcap"] = cfg.attn_softcap  # after the scale, before the mask: as Gemma 2
    # The presents are graph outputs directly (no Identity), so a buffer bound to both past and present is
    # written in place rather than copied.
    (y, _, _) = g.node(
        "GroupQueryAttention",
        attn_inputs,
        f"{p}.attn.gqa",
        domain=MS_DOMAIN,
        outputs=[f"{p}.attn.gqa", f"present_key.{i}", f"present_value.{i}"],
        num_heads=cfg.n_heads,
        kv_num_heads=cfg.kv_heads,
        do_rotary=int(bool(rotary)),
        rotary_interleaved=0,
        **attrs,
    )
    a = g.linear(y, attn.out.weight, attn.out.bias, f"{p}.attn.out")
    if block.ln_attn_out is not None:
        a = g.norm(a, block.ln_attn_out, f"{p}.ln_attn_out")
    (x,) = g.node("Add", [x, g.scaled(a, cfg.residual_scale, f"{p}.attn_scale")], f"{p}.attn_residual")
    h = g.norm(x, block.ln_ffn, f"{p}.ln_ffn") if block.ln_ffn is not None else x
    if isinstance(block.ffn, Experts):
        h = experts_graph(g, h, block.ffn, cfg.d_model, f"{p}.ffn")
    else:
        h = g.linear(h, block.ffn.up.weight, block.ffn.up.bias, f"{p}.ffn.up")
        h = _activation(g, h, cfg.activation, cfg.d_ff, f"{p}.ffn")
        h = g.linear(h, block.ffn.down.weight, block.ffn.down.bias, f"{p}.ffn.down")
    if block.ln_ffn_out is not None:
        h = g.norm(h, block.ln_ffn_out, f"{p}.ln_ffn_out")
    return g.node("Add", [x, g.scaled(h, cfg.residual_scale, f"{p}.ffn_scale")], f"{p}.ffn_residual")[0]


def _activation(g: _GraphBuilder, h: str, activation: str, d_ff: int, name: str) -> str:
    """The MLP's activation of h [B,S,F] (SwiGLU, GeGLU: of h [B,S,2F] = [gate; up]: act(gate) * up)."""
    if activation in GATED_ACTIVATIONS:
        return g.gated(h, d_ff, name, activation)
    if activation == "gelu_tanh":
        return g.node("Gelu", [h], f"{name}.act", approximate="tanh")[0]
    return g.node("Gelu" if activation == "gelu" else "Relu", [h], f"{name}.act")[0]


def _make_model(g: _GraphBuilder, n_layers: int, heads: int, head_dim: int, vocab: int) -> onnx.ModelProto:
    kv_shape: list[str | int] = ["batch", heads, "capacity", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("last_index", TensorProto.INT64, ["batch"]),
    ]
    if g.lora is not None:
        inputs += _lora_inputs(g.lora)
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", vocab])]
    for i in range(n_layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}.{i}", TensorProto.FLOAT, kv_shape))
    model = g.model
    model.graph.name = "textgen_inplace"
    model.graph.node.extend(g.nodes)
    model.graph.input.extend(inputs)
    model.graph.output.extend(outputs)
    model.opset_import.extend([helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    model.producer_name = "textgen-export"
    model.ir_version = 10
    return model


def _lora_inputs(lora: LoraLayout) -> list[onnx.ValueInfoProto]:
    return [
        helper.make_tensor_value_info(
            name, TensorProto.INT64 if name in LORA_ROUTING_INPUTS else TensorProto.FLOAT, shape
        )
        for name, shape in lora.input_shapes().items()
    ]

"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, each a SwiGLU MLP of its own.

`ExpertsConfig` is the part of a DecoderConfig that makes layers sparse; `Experts` is the PyTorch module,
and `experts_graph` writes it into the ONNX serving graph (export/onnx_inplace.py).

Routing, as each family normalizes it (`ROUTINGS`), from the router's logits l over E experts:
- "softmax_topk": w = the k largest of softmax(l), unnormalized (OLMoE, Qwen3-MoE without norm_topk_prob);
- "softmax_topk_norm": the same k, divided by their sum (Mixtral, Qwen3-MoE with norm_topk_prob);
- "topk_softmax": softmax over the k largest logits (gpt-oss) — the same weights as "softmax_topk_norm" in
  exact arithmetic, computed as the family computes them.

In the serving graph the experts are routed gathers: per expert, the tokens that chose it are gathered
(NonZero of its id in the top-k indices), multiplied by its weights, scaled by their routing weight and
added back where they came from (ScatterND). ONNX Runtime 1.32's CPU `MoE` kernel computes the same to 2e-6
but not batch invariantly: on a random 32-expert layer every token's output differed bit for bit between
the token alone and in a batch of 64, while the gathers give identical bits (a token meets the same packed
MatMul whatever else its expert computes). The gathers also leave each expert's projections as plain
MatMuls of constant weights, which the int8/int4 quantizer turns into MatMulNBits like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper
from torch import Tensor, nn

from serve.bundle import ROW_PAD_PREFIX

if TYPE_CHECKING:
    from export.onnx_inplace import _GraphBuilder

Routing = Literal["softmax_topk", "softmax_topk_norm", "topk_softmax"]
ROUTINGS = ("softmax_topk", "softmax_topk_norm", "topk_softmax")
# swiglu: silu(gate) * up. swiglu_clamped (gpt-oss): gate clamped above at `limit`, up to [-limit, limit],
# then gate * sigmoid(alpha * gate) * (up + 1).
ExpertActivation = Literal["swiglu", "swiglu_clamped"]
EXPERT_ACTIVATIONS = ("swiglu", "swiglu_clamped")
EXPERTS_NAME = "experts"  # in the names of the serving graph's expert nodes: blocks.{i}.ffn.experts.{e}/...
ROUTER_SUFFIX = "/router"  # of the router's MatMul: blocks.{i}.ffn/router


@dataclass(frozen=True)
class ExpertsConfig:
    """Sparse feed-forward layers: every layer but `dense_layers`, whose FFN stays the dense d_ff MLP."""

    n_experts: int
    top_k: int
    d_ff: int  # each expert's hidden width
    routing: Routing = "softmax_topk"
    dense_layers: tuple[int, ...] = ()
    activation: ExpertActivation = "swiglu"
    swiglu_alpha: float = 1.702  # swiglu_clamped
    swiglu_limit: float = 7.0  # swiglu_clamped
    bias: bool = False  # biases on the router and on each expert's projections (gpt-oss)

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"experts' {name} must be a positive integer, got {value!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"experts' top_k ({self.top_k}) exceeds n_experts ({self.n_experts})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"experts' routing must be one of {', '.join(ROUTINGS)}, not {self.routing!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(
                f"experts' activation must be one of {', '.join(EXPERT_ACTIVATIONS)}, not {self.activation!r}"
            )
        # A config read back from JSON gives a list: kept as a sorted tuple, so configs compare equal.
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))

    def sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> ExpertsConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown experts config keys: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


def route(logits: Tensor, top_k: int, routing: Routing) -> tuple[Tensor, Tensor]:
    """Each token's experts and their weights, ([N,k] float, [N,k] int64), from router logits [N,E]."""
    if routing == "topk_softmax":
        top, experts = torch.topk(logits, top_k, dim=-1)
        return top.softmax(dim=-1), experts
    weights, experts = torch.topk(logits.float().softmax(dim=-1), top_k, dim=-1)
    if routing == "softmax_topk_norm":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Experts(nn.Module):
    """router [E,D]; up [E,2F,D] (each expert's [gate; up]); down [E,D,F]. y = sum over a token's experts of
    its weight times down_e(silu(gate_e x) * up_e x)."""

    def __init__(self, d_model: int, cfg: ExpertsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, f = cfg.n_experts, cfg.d_ff
        self.router = nn.Linear(d_model, e, bias=cfg.bias)
        self.up = nn.Parameter(torch.empty(e, 2 * f, d_model))
        self.down = nn.Parameter(torch.empty(e, d_model, f))
        nn.init.normal_(self.up, std=0.02)
        nn.init.normal_(self.down, std=0.02)
        self.up_bias = nn.Parameter(torch.zeros(e, 2 * f)) if cfg.bias else None
        self.down_bias = nn.Parameter(torch.zeros(e, d_model)) if cfg.bias else None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [N,D]
        weights, experts = route(self.router(flat), self.cfg.top_k, self.cfg.routing)  # [N,k] each
        if torch.compiler.is_exporting():
            return self._dense(flat, weights, experts).reshape(x.shape)
        out = torch.zeros_like(flat)
        for e in torch.unique(experts).tolist():  # ascending, as the serving graph adds them
            rows, slot = torch.where(experts == e)
            out.index_add_(0, rows, self._expert(flat[rows], e) * weights[rows, slot, None].to(x.dtype))
        return out.reshape(x.shape)

    def _expert(self, x: Tensor, e: int) -> Tensor:
        up_bias = None if self.up_bias is None else self.up_bias[e]
        down_bias = None if self.down_bias is None else self.down_bias[e]
        gate, up = F.linear(x, self.up[e], up_bias).chunk(2, dim=-1)
        if self.cfg.activation == "swiglu_clamped":
            limit = self.cfg.swiglu_limit
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            h = gate * torch.sigmoid(gate * self.cfg.swiglu_alpha) * (up + 1)
        else:
            h = F.silu(gate) * up
        return F.linear(h, self.down[e], down_bias)

    def _dense(self, flat: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Every expert on every token, weighted by 0 where not chosen: the same sums (adding an exact zero
        changes nothing) without the data-dependent loop, which torch.export cannot trace (the standard
        graph, export/onnx_standard.py). E / k times the arithmetic: the serving graph does not use it."""
        out = torch.zeros_like(flat)
        for e in range(self.cfg.n_experts):
            w = (weights * (experts == e).to(weights.dtype)).sum(dim=-1, keepdim=True)  # [N,1]
            out = out + self._expert(flat, e) * w.to(flat.dtype)
        return out

    def active_parameters(self) -> int:
        """Weights one token reads: the router and its top-k experts."""
        per_expert = sum(
            p[0].numel() for p in (self.up, self.down, self.up_bias, self.down_bias) if p is not None
        )
        router = sum(p.numel() for p in self.router.parameters())
        return router + self.cfg.top_k * per_expert


def experts_graph(g: _GraphBuilder, x: str, module: Experts, d_model: int, name: str) -> str:
    """The experts of x [B,S,D] as routed gathers (module docstring); returns the [B,S,D] output."""
    cfg = module.cfg
    (flat,) = g.node("Reshape", [x, g.const_i64("experts.flat", [-1, d_model])], f"{name}/flat")  # [N,D]
    router = module.router.weight.detach().numpy().T
    # The router stays float at --int8/--int4 (export/quantize.py leaves ROUTER_SUFFIX nodes): which experts a
    # token takes should not move with the weights' rounding.
    (logits,) = g.node(
        "MatMul", [flat, g.weight(f"{name}.router.weight_t", router)], f"{name}{ROUTER_SUFFIX}"
    )
    if module.router.bias is not None:
        bias = g.weight(f"{name}.router.bias", module.router.bias.detach().numpy())
        (logits,) = g.node("Add", [logits, bias], f"{name}/router_bias")
    weights, chosen = _routing(g, logits, cfg, name)  # [N,k] each
    (shape,) = g.node("Shape", [flat], f"{name}/shape")
    (acc,) = g.node("ConstantOfShape", [shape], f"{name}/zeros")  # float zeros [N,D]
    up, down = module.up.detach().numpy(), module.down.detach().numpy()
    for e in range(cfg.n_experts):
        p = f"{name}.{EXPERTS_NAME}.{e}"
        (hit,) = g.node("Equal", [chosen, g.const_i64(f"experts.id_{e}", [e])], f"{p}/hit")  # [N,k]
        (where,) = g.node("NonZero", [hit], f"{p}/where")  # [2,m]: (token, slot), tokens ascending
        (pairs,) = g.node("Transpose", [where], f"{p}/pairs", perm=[1, 0])  # [m,2]
        (rows,) = g.node("Gather", [where, g.const_i64("experts.zero", [0])], f"{p}/rows", axis=0)  # [1,m]
        (rows,) = g.node("Squeeze", [rows, g.const_i64("experts.zero", [0])], f"{p}/rows_1d")  # [m]
        (tokens,) = g.node("Gather", [flat, rows], f"{p}/tokens", axis=0)  # [m,D]
        (h,) = g.node("MatMul", [tokens, g.weight(f"{p}.up.weight_t", up[e].T)], f"{p}/up")  # [m,2F]
        if module.up_bias is not None:
            bias = g.weight(f"{p}.up.bias", module.up_bias[e].detach().numpy())
            (h,) = g.node("Add", [h, bias], f"{p}/up_bias")
        h = _activation(g, h, cfg, f"{p}/act")
        down_bias = None if module.down_bias is None else module.down_bias[e].detach().numpy()
        (h,) = g.node(
            "MatMul",
            [h, g.weight(f"{p}.down.weight_t", down[e].T)],
            f"{p}/out" if down_bias is None else f"{p}/down",
        )  # [m,D]
        if down_bias is not None:  # the expert's output is named {p}/out either way (pad_expert_rows)
            (h,) = g.node("Add", [h, g.weight(f"{p}.down.bias", down_bias)], f"{p}/out")
        (w,) = g.node("GatherND", [weights, pairs], f"{p}/weight")  # [m]
        (w,) = g.node("Unsqueeze", [w, g.const_i64("experts.one", [1])], f"{p}/weight_col")  # [m,1]
        (h,) = g.node("Mul", [h, w], f"{p}/weighted")
        (idx,) = g.node("Unsqueeze", [rows, g.const_i64("experts.one", [1])], f"{p}/indices")  # [m,1]
        (acc,) = g.node("ScatterND", [acc, idx, h], f"{p}/add", reduction="add")
    (x_shape,) = g.node("Shape", [x], f"{name}/x_shape")
    return g.node("Reshape", [acc, x_shape], f"{name}/out")[0]


def _activation(g: _GraphBuilder, h: str, cfg: ExpertsConfig, name: str) -> str:
    """The experts' activation of h [m, 2F] = [gate; up]."""
    if cfg.activation == "swiglu":
        return g.swiglu(h, cfg.d_ff, name)
    gate, up = g.node(
        "Split",
        [h, g.const_i64(f"experts.gate_up_{cfg.d_ff}", [cfg.d_ff, cfg.d_ff])],
        f"{name}.gate_up",
        outputs=[f"{name}.gate", f"{name}.up_half"],
        axis=-1,
    )
    limit = cfg.swiglu_limit
    (gate,) = g.node("Min", [gate, g.scalar(f"experts.limit_{limit}", limit)], f"{name}.gate_clamped")
    low, high = g.scalar(f"experts.limit_{-limit}", -limit), g.scalar(f"experts.limit_{limit}", limit)
    (up,) = g.node("Clip", [up, low, high], f"{name}.up_clamped")
    (scaled,) = g.node(
        "Mul", [gate, g.scalar(f"experts.alpha_{cfg.swiglu_alpha}", cfg.swiglu_alpha)], f"{name}.scaled"
    )
    (sig,) = g.node("Sigmoid", [scaled], f"{name}.sigmoid")
    (glu,) = g.node("Mul", [gate, sig], f"{name}.glu")
    (up,) = g.node("Add", [up, g.scalar("experts.one_f", 1.0)], f"{name}.up_plus_one")
    return g.node("Mul", [glu, up], f"{name}.act")[0]


def _routing(g: _GraphBuilder, logits: str, cfg: ExpertsConfig, name: str) -> tuple[str, str]:
    k = g.const_i64(f"experts.k_{cfg.top_k}", [cfg.top_k])
    if cfg.routing == "topk_softmax":
        top, chosen = g.node("TopK", [logits, k], f"{name}/topk", outputs=[f"{name}/top", f"{name}/chosen"])
        return g.node("Softmax", [top], f"{name}/weights", axis=-1)[0], chosen
    (probs,) = g.node("Softmax", [logits], f"{name}/probs", axis=-1)
    top, chosen = g.node("TopK", [probs, k], f"{name}/topk", outputs=[f"{name}/top", f"{name}/chosen"])
    if cfg.routing == "softmax_topk":
        return top, chosen
    (total,) = g.node("ReduceSum", [top, g.const_i64("experts.last", [-1])], f"{name}/top_sum", keepdims=1)
    return g.node("Div", [top, total], f"{name}/weights")[0], chosen


# -- quantized experts: even row counts ---------------------------------------------------------------------

_EXPERT_TENSOR = re.compile(rf"\.{EXPERTS_NAME}\.\d+/")


def is_expert_tensor(name: str) -> bool:
    """Whether a serving graph tensor belongs to one expert's rows (`experts_graph` names them so)."""
    return bool(_EXPERT_TENSOR.search(name))


def routers(model: onnx.ModelProto) -> list[str]:
    """The names of the routers' MatMuls, which the quantizers leave float."""
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name.endswith(ROUTER_SUFFIX)]


def pad_expert_rows(model: onnx.ModelProto) -> int:
    """Give every expert's MatMulNBits an even row count, as export/row_pad.py does for the dense
    projections (export/quantize.py says which block sizes need it, and why): an expert's gathered token
    indices get their last one repeated when their count is odd, the expert computes that token twice, and
    its output is cut back to its real rows before the routing weights. Named as row_pad names its pads, so
    the engine takes these out with the others on a CPU that needs none (serve/engine/row_pad.py). Returns
    how many MatMulNBits read padded rows."""
    p = ROW_PAD_PREFIX
    graph = model.graph
    nodes = list(graph.node)
    starts = {
        n.output[0]: k
        for k, n in enumerate(nodes)
        if n.op_type == "Gather" and n.output[0].endswith("/tokens")
    }
    out: list[onnx.NodeProto] = []
    padded = 0
    k = 0
    while k < len(nodes):
        node = nodes[k]
        if node.output[0] not in starts or not is_expert_tensor(node.output[0]):
            out.append(node)
            k += 1
            continue
        expert = node.output[0].removesuffix("/tokens")
        rows = node.input[1]
        end = next(j for j in range(k, len(nodes)) if nodes[j].output[0] == f"{expert}/out")
        chain = nodes[k : end + 1]  # gather, up, the activation, down: each row on its own
        inside = {o for n in chain for o in n.output}
        m, odd, pads = f"{p}_{expert}_m", f"{p}_{expert}_odd", f"{p}_{expert}_pads"
        out += [
            helper.make_node("Shape", [rows], [m], name=m),
            helper.make_node("Mod", [m, f"{p}_experts_two"], [odd], name=odd),
            helper.make_node("Concat", [f"{p}_experts_zero", odd], [pads], name=pads, axis=0),
            helper.make_node("Pad", [rows, pads], [f"{rows}_{p}"], name=f"{rows}_{p}_pad", mode="edge"),
        ]
        for n in chain:
            n.input[:] = [f"{i}_{p}" if i in inside or i == rows else i for i in n.input]
            n.output[:] = [f"{o}_{p}" for o in n.output]
        out += chain
        real = f"{expert}/out"
        cut = [f"{real}_{p}", f"{p}_experts_zero", m, f"{p}_experts_zero"]
        out.append(helper.make_node("Slice", cut, [real], name=f"{real}_{p}_cut"))
        padded += sum(n.op_type == "MatMulNBits" for n in chain)
        k = end + 1
    if padded:
        del graph.node[:]
        graph.node.extend(out)
        for name, value in (("two", 2), ("zero", 0)):
            graph.initializer.append(
                numpy_helper.from_array(np.array([value], np.int64), f"{p}_experts_{name}")
            )
    return padded

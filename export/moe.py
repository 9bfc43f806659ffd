"""Mixture-of-experts feed-forward: a router picks each token's top-k experts, each a SwiGLU MLP of its own.

`ExpertsConfig` is the part of a DecoderConfig that makes layers sparse; `Experts` is the PyTorch module,
and `experts_graph` writes it into the ONNX serving graph (export/onnx_inplace.py).

Routing, as each family normalizes it (`ROUTINGS`), from the router's logits l over E experts:
- "softmax_topk": w = the k largest of softmax(l), unnormalized (OLMoE, Qwen3-MoE without norm_topk_prob);
- "softmax_topk_norm": the same k, divided by their sum (Mixtral, Qwen3-MoE with norm_topk_prob);
- "topk_softmax": softmax over the k largest logits (gpt-oss) — the same weights as "softmax_topk_norm" in
  exact arithmetic, computed as the family computes them.

In the serving graph a sparse layer sorts its tokens' (token, slot) pairs by expert once (TopK, which
breaks ties by the lower index, so one expert's rows keep their tokens' order), counts each expert's rows,
and gathers every pair's token row at once. A Split by the counts hands each expert its own rows, zero
rows for one no token took: an expert is its up MatMul and its down MatMul and nothing else, the
activation (and gpt-oss's biases, gathered per row by expert) running once over every row between two
Splits. One Gather puts the outputs back in pair order, each token's pairs by ascending expert; they are
scaled by their routing weights and added one rank at a time starting from zero, the order in which
`Experts.forward` adds them. No ScatterND with repeated indices: ONNX Runtime 1.32's CPU ScatterND applies
its updates in parallel chunks, which for one row hit twice is neither ordered nor safe.

Each MatMul computes a row the same whatever the rows beside it, so a token's output is bit for bit the
same alone and in any batch. ONNX Runtime 1.32's CPU `MoE` kernel computes the same to 2e-6 but not batch
invariantly: on a random 32-expert layer every token's output differed bit for bit between the token alone
and in a batch of 64. The experts' projections stay plain MatMuls of constant weights, which the int8/int4
quantizer turns into MatMulNBits like any other (`pad_expert_rows` then makes their row counts even).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

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
ROUTER_WEIGHT_SUFFIX = ".router.weight"  # of its weight in the traced standard graph: the Linear's parameter


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
    """The experts of x [B,S,D] as one sorted gather (module docstring); returns the [B,S,D] output."""
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
    k = g.const_i64(f"experts.k_{cfg.top_k}", [cfg.top_k])
    # A token's pairs (token, slot) reordered by expert, ascending: pair j = token * k + rank, the order in
    # which its outputs are added up at the end. TopK breaks ties by the lower index (ONNX's definition).
    chosen, slots = g.node(
        "TopK", [chosen, k], f"{name}/by_expert", outputs=[f"{name}/experts_asc", f"{name}/slots"], largest=0
    )  # [N,k] each
    (weights,) = g.node("GatherElements", [weights, slots], f"{name}/weights_asc", axis=1)  # [N,k]
    minus_one = g.const_i64("experts.minus_one", [-1])
    (pair_experts,) = g.node("Reshape", [chosen, minus_one], f"{name}/pair_experts")  # [Nk]
    (pairs,) = g.node("Shape", [pair_experts], f"{name}/pairs")  # [1]: Nk
    # The pairs sorted by expert, one expert's by j (so by token): each expert's rows side by side.
    sorted_experts, order = g.node(
        "TopK",
        [pair_experts, pairs],
        f"{name}/sort",
        outputs=[f"{name}/sorted_experts", f"{name}/order"],
        largest=0,
    )  # [Nk] each
    (rows,) = g.node("Div", [order, k], f"{name}/sorted_tokens")  # [Nk]: token ids, by expert
    (column,) = g.node("Unsqueeze", [pair_experts, g.const_i64("experts.one", [1])], f"{name}/pair_column")
    ids = g.const_i64(f"experts.ids_{cfg.n_experts}", list(range(cfg.n_experts)))
    (hit,) = g.node("Equal", [column, ids], f"{name}/hit")  # [Nk,E]
    (hit,) = g.node("Cast", [hit], f"{name}/hit_i", to=onnx.TensorProto.INT64)
    (counts,) = g.node(
        "ReduceSum", [hit, g.const_i64("experts.zero", [0])], f"{name}/counts", keepdims=0
    )  # [E]: each expert's row count, zero for one no token took
    (tokens,) = g.node("Gather", [flat, rows], f"{name}/tokens", axis=0)  # [Nk,D]
    up, down = module.up.detach().numpy(), module.down.detach().numpy()
    expert = [f"{name}.{EXPERTS_NAME}.{e}" for e in range(cfg.n_experts)]
    parts = g.node("Split", [tokens, counts], f"{name}/split", outputs=[f"{p}/rows" for p in expert], axis=0)
    ups = [
        g.node("MatMul", [part, g.weight(f"{p}.up.weight_t", up[e].T)], f"{p}/up")[0]
        for e, (p, part) in enumerate(zip(expert, parts, strict=True))
    ]  # [m_e,2F] each
    (h,) = g.node("Concat", ups, f"{name}/up", axis=0)  # [Nk,2F]
    if module.up_bias is not None:
        h = _expert_bias(g, h, sorted_experts, module.up_bias, f"{name}/up_bias")
    h = _activation(g, h, cfg, f"{name}/act")  # on each row on its own: once for every expert
    hidden = g.node(
        "Split", [h, counts], f"{name}/split_hidden", outputs=[f"{p}/hidden" for p in expert], axis=0
    )
    downs = [
        g.node("MatMul", [part, g.weight(f"{p}.down.weight_t", down[e].T)], f"{p}/down")[0]
        for e, (p, part) in enumerate(zip(expert, hidden, strict=True))
    ]  # [m_e,D] each
    out = f"{name}/expert_out"  # [Nk,D]: the experts' outputs, by expert (pad_expert_rows reads the name)
    if module.down_bias is None:
        g.node("Concat", downs, out, axis=0)
    else:
        (h,) = g.node("Concat", downs, f"{name}/down", axis=0)
        _expert_bias(g, h, sorted_experts, module.down_bias, out)
    # Back to the pairs' order: pair j's output at row j; the sort's inverse permutation is the sort of its
    # indices.
    _, unsort = g.node(
        "TopK", [order, pairs], f"{name}/unsort", outputs=[f"{name}/unsorted", f"{name}/unsort"], largest=0
    )
    (h,) = g.node("Gather", [out, unsort], f"{name}/by_pair", axis=0)  # [Nk,D]
    (w,) = g.node("Reshape", [weights, g.const_i64("experts.column", [-1, 1])], f"{name}/weight_col")
    (h,) = g.node("Mul", [h, w], f"{name}/weighted")
    (h,) = g.node(
        "Reshape",
        [h, g.const_i64(f"experts.by_token_{cfg.top_k}_{d_model}", [-1, cfg.top_k, d_model])],
        f"{name}/by_token",
    )
    ranks = (
        g.node(
            "Split",
            [h],
            f"{name}/ranks",
            outputs=[f"{name}/rank_{r}" for r in range(cfg.top_k)],
            axis=1,
            num_outputs=cfg.top_k,
        )
        if cfg.top_k > 1
        else [h]
    )  # [N,1,D] each
    # From zero, in ascending expert order, one add at a time: the sum Experts.forward computes.
    (acc,) = g.node("Add", [g.scalar("experts.zero_f", 0.0), ranks[0]], f"{name}/sum_0")
    for r in range(1, cfg.top_k):
        (acc,) = g.node("Add", [acc, ranks[r]], f"{name}/sum_{r}")
    (x_shape,) = g.node("Shape", [x], f"{name}/x_shape")
    return g.node("Reshape", [acc, x_shape], f"{name}/out")[0]


def _expert_bias(g: _GraphBuilder, h: str, sorted_experts: str, bias: Tensor, name: str) -> str:
    """h [Nk, n] (rows by expert) plus each row's expert's bias: one Gather of the [E, n] biases."""
    table = g.weight(f"{name}.table", bias.detach().numpy())
    (rows,) = g.node("Gather", [table, sorted_experts], f"{name}/rows", axis=0)
    return g.node("Add", [h, rows], name)[0]


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

# The per-layer tensors pad_expert_rows finds by name (experts_graph writes them).
_TOKENS, _SORTED_TOKENS, _COUNTS = "/tokens", "/sorted_tokens", "/counts"
_SORTED_EXPERTS, _EXPERT_OUT = "/sorted_experts", "/expert_out"
_EXPERT_TENSOR = re.compile(rf"\.{EXPERTS_NAME}\.\d+/")


def is_expert_tensor(name: str) -> bool:
    """Whether a serving graph tensor belongs to one expert's rows (`experts_graph` names them so)."""
    return bool(_EXPERT_TENSOR.search(name))


def router_name(weight: str) -> str | None:
    """The node name `routers` knows a router's MatMul by, from its weight's name in the traced standard
    graph (the module's parameter, ...ffn.router.weight); None for any other weight."""
    prefix = weight.removesuffix(ROUTER_WEIGHT_SUFFIX)
    return f"{prefix}{ROUTER_SUFFIX}" if prefix != weight else None


def routers(model: onnx.ModelProto) -> list[str]:
    """The names of the routers' MatMuls, which the quantizers leave float."""
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name.endswith(ROUTER_SUFFIX)]


def pad_expert_rows(model: onnx.ModelProto) -> int:
    """Give every expert's MatMulNBits an even row count, as export/row_pad.py does for the dense
    projections (export/quantize.py says which block sizes need it, and why): in each sparse layer, an
    expert with an odd count gets the token ids of its rows with its last one repeated, the row counts the
    Splits cut by grow to match, the expert computes that token twice, and one Gather takes the real rows
    back before the routing weights. Named as row_pad names its pads, so the engine takes these out with the
    others on a CPU that needs none (serve/engine/row_pad.py). Returns how many MatMulNBits read padded
    rows."""
    p = ROW_PAD_PREFIX
    graph = model.graph
    nodes = list(graph.node)
    starts = [k for k, n in enumerate(nodes) if n.op_type == "Gather" and n.name.endswith(_TOKENS)]
    if not starts:
        return 0
    out: list[onnx.NodeProto] = []
    padded = 0
    done = 0
    for k in starts:
        layer = nodes[k].name.removesuffix(_TOKENS)
        end = next(j for j in range(k, len(nodes)) if nodes[j].output[0] == f"{layer}{_EXPERT_OUT}")
        chain = nodes[k : end + 1]  # the gather, the experts, their activation and biases: rows on their own
        rows, counts, sorted_experts = (f"{layer}{s}" for s in (_SORTED_TOKENS, _COUNTS, _SORTED_EXPERTS))
        reads = {i for n in chain for i in n.input}
        out += nodes[done:k]
        out += _padded_rows(layer, counts, sorted_experts)
        out.append(_take(rows, f"{p}_{layer}_source", f"{rows}_{p}", f"{rows}_{p}_pad"))
        if sorted_experts in reads:  # the biases' gathers read each row's expert
            pad = f"{sorted_experts}_{p}_pad"
            out.append(_take(sorted_experts, f"{p}_{layer}_source", f"{sorted_experts}_{p}", pad))
        inside = {o for n in chain for o in n.output} | {rows, counts, sorted_experts}
        for n in chain:
            n.input[:] = [f"{i}_{p}" if i in inside else i for i in n.input]
            n.output[:] = [f"{o}_{p}" for o in n.output]
        out += chain
        real = f"{layer}{_EXPERT_OUT}"
        out.append(_take(f"{real}_{p}", f"{p}_{layer}_real", real, f"{real}_{p}_cut"))
        padded += sum(n.op_type == "MatMulNBits" for n in chain)
        done = end + 1
    out += nodes[done:]
    del graph.node[:]
    graph.node.extend(out)
    for name, value in (("two", [2]), ("zero", 0), ("one", 1), ("axis", [1])):
        graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), f"{p}_experts_{name}"))
    return padded


def _padded_rows(layer: str, counts: str, sorted_experts: str) -> list[onnx.NodeProto]:
    """The counts made even ({counts}_pad), and which real row each padded row takes (`{p}_{layer}_source`)
    and where each real row lands among the padded ones (`{p}_{layer}_real`). Expert e's rows move down by
    shift_e, the odd counts before it; padded row j, of the expert whose padded rows reach past j, takes real
    row j - shift_e, or the expert's last real row for its repeated one."""
    p, c = ROW_PAD_PREFIX, f"{ROW_PAD_PREFIX}_experts"
    v = f"{p}_{layer}"  # the names of this layer's pad arithmetic

    def node(op: str, inputs: list[str], output: str, **attrs: int) -> onnx.NodeProto:
        name = output if output.startswith(v) else f"{v}{output.removeprefix(layer)}"  # starts with p
        made = helper.make_node(op, inputs, [output], name=name)
        made.attribute.extend(helper.make_attribute(key, value) for key, value in attrs.items())
        return made

    return [
        node("Mod", [counts, f"{c}_two"], f"{v}_odd"),
        node("Add", [counts, f"{v}_odd"], f"{counts}_{p}"),  # named so the strip gives the real counts back
        node("CumSum", [f"{v}_odd", f"{c}_zero"], f"{v}_shift", exclusive=1),
        node("CumSum", [counts, f"{c}_zero"], f"{v}_ends"),
        node("CumSum", [f"{counts}_{p}", f"{c}_zero"], f"{v}_padded_ends"),
        node("ReduceSum", [f"{counts}_{p}"], f"{v}_padded_total", keepdims=0),
        node("Range", [f"{c}_zero", f"{v}_padded_total", f"{c}_one"], f"{v}_j"),
        node("Unsqueeze", [f"{v}_j", f"{c}_axis"], f"{v}_j_column"),
        node("LessOrEqual", [f"{v}_padded_ends", f"{v}_j_column"], f"{v}_past"),  # [rows, E]
        node("Cast", [f"{v}_past"], f"{v}_past_i", to=onnx.TensorProto.INT64),
        node("ReduceSum", [f"{v}_past_i", f"{c}_axis"], f"{v}_expert", keepdims=0),
        node("Gather", [f"{v}_shift", f"{v}_expert"], f"{v}_row_shift", axis=0),
        node("Sub", [f"{v}_j", f"{v}_row_shift"], f"{v}_moved_back"),
        node("Gather", [f"{v}_ends", f"{v}_expert"], f"{v}_row_end", axis=0),
        node("Sub", [f"{v}_row_end", f"{c}_one"], f"{v}_row_last"),
        node("Min", [f"{v}_moved_back", f"{v}_row_last"], f"{v}_source"),
        node("ReduceSum", [counts], f"{v}_total", keepdims=0),
        node("Range", [f"{c}_zero", f"{v}_total", f"{c}_one"], f"{v}_i"),
        node("Gather", [f"{v}_shift", sorted_experts], f"{v}_real_shift", axis=0),
        node("Add", [f"{v}_i", f"{v}_real_shift"], f"{v}_real"),
    ]


def _take(data: str, indices: str, output: str, name: str) -> onnx.NodeProto:
    return helper.make_node("Gather", [data, indices], [output], name=name, axis=0)


# -- quantized experts: one QMoE per layer ------------------------------------------------------------------

_BY_PAIR, _FLAT, _HIT = "/by_pair", "/flat", "/hit"
_EXPERT_NBITS = re.compile(rf"\.{EXPERTS_NAME}\.(\d+)/(up|down)")
QMOE_NAME = "/qmoe"  # the layer's QMoE node: blocks.{i}.ffn/qmoe
MS_DOMAIN = "com.microsoft"


def experts_to_qmoe(model: onnx.ModelProto) -> int:
    """Replace each sparse layer's quantized experts (its sorted gather, 2E MatMulNBits and their Splits
    and Concats) by one ONNX Runtime `QMoE` over the layer's (token, slot) pairs, each pair a row routed to
    its one expert (k=1, a one-hot router row), with the same packed weights and scales. Returns the layers
    rewritten.

    Why k=1 over pairs: QMoE's CPU kernel with k > 1 adds a token's experts in an order set by the batch
    (experts taken by most rows first, and across its threads' partial sums), so a token's sum moves with
    its company. With one expert per row the kernel's sum is 0 + 1 x the expert's output, exact; the
    routing weights and the sum over a token's experts stay in the graph, in ascending expert order from
    zero, as `Experts.forward` adds them. Each expert's rows go through MLAS's block-quantized GEMM (the
    MatMulNBits kernel, int8 activations as accuracy_level 4 gives it) as a MatMulNBits would, so a row
    comes out the same whatever its expert's row count wherever MatMulNBits needs no row pad
    (export/quantize.py, which calls this only there)."""
    graph = model.graph
    nodes = list(graph.node)
    weights = {t.name: t for t in graph.initializer}
    layers = [
        n.name.removesuffix(_TOKENS) for n in nodes if n.op_type == "Gather" and n.name.endswith(_TOKENS)
    ]
    added: dict[str, list[onnx.NodeProto]] = {}
    for layer in layers:
        experts = _layer_nbits(nodes, layer)
        # Biased experts (gpt-oss) keep their MatMulNBits: with the biases as its inputs, ONNX Runtime
        # 1.32's QMoE came out ~1 off the graph's own bias Adds on a random layer of 8 experts.
        if experts is None or any(f"{layer}/{b}_bias.table" in weights for b in ("up", "down")):
            continue
        added[layer] = _qmoe_nodes(graph, weights, nodes, layer, experts)
    if not added:
        return 0
    out: list[onnx.NodeProto] = []
    for n in nodes:
        layer = n.name.removesuffix(_BY_PAIR)
        out += added.get(layer, []) if n.name.endswith(_BY_PAIR) else [n]
    del graph.node[:]
    graph.node.extend(out)
    _prune(model)
    return len(added)


def _layer_nbits(nodes: list[onnx.NodeProto], layer: str) -> dict[str, list[onnx.NodeProto]] | None:
    """A layer's expert MatMulNBits, {"up": [by expert], "down": [...]}; None when its experts are not all
    MatMulNBits without zero points (a float graph, or one the quantizer left partly float)."""
    found: dict[str, dict[int, onnx.NodeProto]] = {"up": {}, "down": {}}
    for n in nodes:
        m = _EXPERT_NBITS.search(n.name)
        if m and n.name.startswith(f"{layer}.{EXPERTS_NAME}."):
            if n.op_type != "MatMulNBits" or any(n.input[3:]):
                return None
            found[m.group(2)][int(m.group(1))] = n
    count = len(found["up"])
    if not count or sorted(found["up"]) != list(range(count)) or sorted(found["down"]) != list(range(count)):
        return None
    for n in (found["up"][0], found["down"][0]):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        # QMoE takes MLAS's block-quantized GEMM only where whole blocks tile K; else it dequantizes to a
        # float GEMM, another kernel with other roundings.
        if attrs["K"] % attrs["block_size"]:
            return None
    return {which: [found[which][e] for e in range(count)] for which in found}


def _stacked(
    weights: dict[str, onnx.TensorProto], experts: list[onnx.NodeProto], order: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The experts' packed MatMulNBits weights [E, N, K / pack] and scales [E, N, K / block], their output
    rows (N) in `order`."""
    packed, scales = [], []
    for n in experts:
        b = numpy_helper.to_array(weights[n.input[1]])  # [N, K / block, block bytes]
        s = numpy_helper.to_array(weights[n.input[2]]).reshape(b.shape[0], -1)  # [N, K / block]
        b = b.reshape(b.shape[0], -1)
        packed.append(b if order is None else b[order])
        scales.append(s if order is None else s[order])
    return np.stack(packed), np.stack(scales)


def _qmoe_nodes(
    graph: onnx.GraphProto,
    weights: dict[str, onnx.TensorProto],
    nodes: list[onnx.NodeProto],
    layer: str,
    experts: dict[str, list[onnx.NodeProto]],
) -> list[onnx.NodeProto]:
    """The nodes that compute `{layer}/by_pair` (each pair's expert output, in pair order) with one QMoE,
    their constants added to `graph`."""
    attrs = {a.name: helper.get_attribute_value(a) for a in experts["up"][0].attribute}
    d_model, width = int(attrs["K"]), int(attrs["N"]) // 2
    top_k = _top_k(nodes, layer)
    # QMoE's CPU SwiGLU reads [gate; up] interleaved: gate_0, up_0, gate_1, up_1, ...
    interleave = np.stack([np.arange(width), width + np.arange(width)], axis=1).reshape(-1)
    fc1, fc1_scales = _stacked(weights, experts["up"], interleave)
    fc2, fc2_scales = _stacked(weights, experts["down"], None)
    by_name = {n.name: n for n in nodes}
    clamped = by_name.get(f"{layer}/act.gate_clamped")
    if clamped is None:  # silu(gate) * up = gate * sigmoid(1 * gate) * (up + 0), nothing clamped
        alpha, beta, limit = 1.0, 0.0, float(np.finfo(np.float32).max)
    else:
        limit = float(numpy_helper.to_array(weights[clamped.input[1]]))
        alpha = float(numpy_helper.to_array(weights[by_name[f"{layer}/act.scaled"].input[1]]))
        beta = 1.0
    consts = {
        f"{layer}.experts.fc1": fc1,
        f"{layer}.experts.fc1_scales": fc1_scales,
        f"{layer}.experts.fc2": fc2,
        f"{layer}.experts.fc2_scales": fc2_scales,
    }
    graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(v), k) for k, v in consts.items())
    shared = {
        "experts.pair_repeat": np.array([1, top_k, 1], np.int64),
        "experts.rows_flat": np.array([-1, d_model], np.int64),
        "experts.one": np.array([1], np.int64),
    }
    known = {t.name for t in graph.initializer}
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in shared.items() if k not in known)

    def node(op: str, inputs: list[str], output: str, **kw: Any) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output], name=output, **kw)

    rows, router = f"{layer}/pair_rows", f"{layer}/pair_router"
    made = [
        node("Unsqueeze", [f"{layer}{_FLAT}", "experts.one"], f"{layer}/flat_column"),
        node("Expand", [f"{layer}/flat_column", "experts.pair_repeat"], f"{layer}/pair_tokens"),
        node("Reshape", [f"{layer}/pair_tokens", "experts.rows_flat"], rows),  # [Nk, D]: pair j = token j / k
        node("Cast", [f"{layer}{_HIT}"], router, to=onnx.TensorProto.FLOAT),  # [Nk, E]: one-hot
    ]
    out = f"{layer}{_BY_PAIR}"
    inputs = [rows, router, f"{layer}.experts.fc1", f"{layer}.experts.fc1_scales", ""]
    inputs += [f"{layer}.experts.fc2", f"{layer}.experts.fc2_scales"]
    made.append(
        helper.make_node(
            "QMoE",
            inputs,
            [out],
            name=f"{layer}{QMOE_NAME}",
            domain=MS_DOMAIN,
            k=1,
            activation_type="swiglu",
            swiglu_fusion=1,
            activation_alpha=alpha,
            activation_beta=beta,
            swiglu_limit=limit,
            normalize_routing_weights=0,
            expert_weight_bits=int(attrs["bits"]),
            block_size=int(attrs["block_size"]),
            accuracy_level=int(attrs["accuracy_level"]),
        )
    )
    return made


def _top_k(nodes: list[onnx.NodeProto], layer: str) -> int:
    """The layer's k, from its by_token Reshape's constant name (experts.by_token_{k}_{d_model})."""
    reshape = next(n for n in nodes if n.name == f"{layer}/by_token")
    return int(reshape.input[1].removeprefix("experts.by_token_").split("_")[0])


def _prune(model: onnx.ModelProto) -> None:
    """Drop the nodes no graph output depends on any more, then the initializers no node reads."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    kept: list[onnx.NodeProto] = []
    for n in reversed(graph.node):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(i for i in n.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(used)

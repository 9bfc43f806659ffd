"""Even row counts for every MatMulNBits: the graph rewrite behind a 4-bit bundle's batch invariance.

ONNX Runtime's many-row MatMulNBits kernel takes the rows in pairs and leaves an odd last row (a lone decode
row included) to a one-row kernel that rounds differently at some block sizes (export/quantize.py says
which). `pad_single_rows` makes every MatMulNBits' row count even: an odd [batch, seq] (or [batch]) gets its
last row repeated (Pad, edge mode) one position along the longer of the two axes, the fewest rows.

The padded rows then travel: an op that computes each row on its own (elementwise with row-free constants, a
norm, a reduction or a split along the last axis, MatMulNBits itself) runs on the padded tensor and hands a
padded tensor on, and a tensor is cut back (Slice) only where an op that mixes rows or positions
(attention, reshapes, the last position's gather) or a graph output reads it. A decoder's residual stream,
norms and MLP stay padded from the first projection to the head, so a layer has one Slice (before its
attention) and one Pad (after it) instead of a Pad and a Slice around each of its projections: at batch 1,
where the Pad and Slice are a good share of a step's operators, that is what the pad costs in nodes.

Every real row goes through exactly the ops it went through before, on the same values: a row's result
depends neither on the repeated row nor on the rows beside it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from export.moe import is_expert_tensor
from serve.bundle import ROW_PAD_PREFIX  # names of the nodes and constants pad_single_rows adds

TOKEN_IDS_INPUT = "input_ids"  # [batch, seq]: its shape gives the pads (both graphs)

# Rows laid out as [batch, seq, d] (the residual stream), [batch, d] (the head after the last-position
# gather) or [batch x seq, d] (every position's row, flattened: the traced standard graph's experts, which
# torch writes as a Linear on 2-D rows): what a Pad adds and a Slice cuts along, and the rank of every tensor
# padded so.
BATCH_SEQ, BATCH, FLAT = "batch_seq", "batch", "flat"
RANK = {BATCH_SEQ: 3, BATCH: 2, FLAT: 2}
IDS = "ids"  # a [batch, seq] input of ids

ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Exp", "Sigmoid", "Tanh", "Erf", "Relu",
    "Softplus", "Gelu", "Cast", "Identity",
}  # fmt: skip
REDUCTIONS = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceL2"}
NORMS = {"LayerNormalization", "RMSNormalization", "SimplifiedLayerNormalization"}
# Ops whose first output has its first input's rows (and so its layout), though they mix positions inside.
ROWS_KEPT = {"GroupQueryAttention"}


def pad_single_rows(model: onnx.ModelProto) -> int:
    """Make every MatMulNBits run on an even number of rows (module docstring); returns how many MatMulNBits
    read padded rows. The pads are computed once per run from input_ids' shape; when they are zero the Pads
    and Slices copy a step's activations, not weights."""
    graph = model.graph
    layouts = _matmul_layouts(model)
    if not layouts:
        return 0
    kinds = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    if any(a.type in kinds for node in graph.node for a in node.attribute):
        raise ValueError("a graph with subgraphs cannot be row-padded")
    rewrite = _Rewrite(graph, layouts)
    nodes = rewrite.nodes()
    del graph.node[:]
    graph.node.extend(_row_pad_nodes(rewrite.pad_layouts) + nodes)
    consts = {"zero": [0], "one": [1], "two": [2], "zeros": [0, 0], "axes": [0, 1]}
    graph.initializer.extend(_int64s(k, c) for k, c in consts.items())
    return len(layouts)


class _Rewrite:
    """Which nodes run on padded rows (in graph order), then the graph with its Pads and Slices."""

    def __init__(self, graph: onnx.GraphProto, matmul_layouts: dict[str, str]) -> None:
        self._graph = graph
        self._matmul_layouts = matmul_layouts
        self._constants = {t.name: t for t in graph.initializer}
        for node in graph.node:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if node.op_type == "Constant" and value is not None:
                self._constants[node.output[0]] = value
        # Graph inputs without a batch axis are weights (a LoRA bundle's adapters, export/lora.py): no rows.
        self._row_free = _row_free_inputs(graph)
        self._layouts = _ids_inputs(graph)  # real tensors whose rows line up with input_ids' (or are ids)
        self._padded: dict[str, str] = {}  # a tensor computed on padded rows: its layout
        self._pads: dict[str, str] = {}  # real tensors some node reads padded: their layout
        self._emitted: set[str] = set()  # real tensors whose Pad is written
        self._cuts: set[str] = set()  # padded tensors something reads real
        self.pad_layouts: set[str] = set()  # of the Pads written

    def nodes(self) -> list[onnx.NodeProto]:
        nodes = list(self._graph.node)
        modes = [self._decide(node) for node in nodes]
        self._cuts |= {o.name for o in self._graph.output} & self._padded.keys()
        return [new for node, layout in zip(nodes, modes, strict=True) for new in self._emit(node, layout)]

    # -- deciding --------------------------------------------------------------------------------------------
    def _decide(self, node: onnx.NodeProto) -> str | None:
        """The layout the node runs padded in, or None (real rows); notes what it produces."""
        layout = self._padded_layout(node)
        if layout is None:
            cut = [i for i in node.input if i in self._padded]
            self._cuts.update(cut)
            self._layouts.update((i, self._padded[i]) for i in cut)  # cut back, it has the same rows
            real = self._real_layout(node)
            if real is not None:
                self._layouts[node.output[0]] = real
        else:
            self._pads.update((i, layout) for i in self._rows(node) if i not in self._padded)
            self._padded.update((o, layout) for o in node.output if o)
        return layout

    def _rows(self, node: onnx.NodeProto) -> list[str]:
        return [i for i in node.input if i and i not in self._constants and i not in self._row_free]

    def _padded_layout(self, node: onnx.NodeProto) -> str | None:
        rows = self._rows(node)
        if node.op_type == "MatMulNBits" and rows[0] in self._matmul_layouts:
            return self._padded.get(rows[0], self._matmul_layouts[rows[0]])
        # A real tensor padded already (for a MatMulNBits) is read padded: a branch beside the projection
        # (a LoRA bundle's, export/lora.py) then runs on the same padded rows.
        padded = {
            i: self._padded.get(i) or self._pads[i] for i in rows if i in self._padded or i in self._pads
        }
        if not padded:
            return None
        layout = _one_layout({padded.get(i, self._layouts.get(i)) for i in rows})
        # Every input lines up (a real one gets padded too), and the op keeps rows apart.
        return layout if layout is not None and self._row_wise(node, RANK[layout]) else None

    def _real_layout(self, node: onnx.NodeProto) -> str | None:
        """The layout of a real node's first output, where its rows are known to line up with input_ids'."""
        rows = self._rows(node)
        table = node.input[0] in self._constants or node.input[0] in self._row_free
        if node.op_type in ("Gather", "GatherBlockQuantized") and table:
            axis = _attr(node, "gather_axis" if node.op_type == "GatherBlockQuantized" else "axis", 0)
            return BATCH_SEQ if axis == 0 and self._layouts.get(node.input[1]) == IDS else None
        if node.op_type in ROWS_KEPT:
            rows = rows[:1]  # the query: the other inputs are the KV cache and lengths
        layout = _one_layout({self._layouts.get(i) for i in rows})
        if layout is None:
            return None
        return layout if node.op_type in ROWS_KEPT or self._row_wise(node, RANK[layout]) else None

    def _row_wise(self, node: onnx.NodeProto, rank: int) -> bool:
        """Whether each row of the output depends on that row of the inputs alone (inputs of `rank`)."""
        op = node.op_type
        if node.domain not in ("", "ai.onnx", "com.microsoft"):
            return False
        if op in ELEMENTWISE:
            constants = [self._constants[i] for i in node.input if i in self._constants]
            return all(len(c.dims) <= rank and all(d == 1 for d in c.dims[:-1]) for c in constants)
        last = (-1, rank - 1)
        if op in REDUCTIONS:
            return _attr(node, "keepdims", 1) == 1 and self._axes(node) in [[a] for a in last]
        if op in NORMS:
            return len([o for o in node.output if o]) == 1 and _attr(node, "axis", -1) in last
        if op == "Split":
            return _attr(node, "axis", 0) in last
        if op in ("MatMul", "FusedMatMul") and not _attr(node, "transA", 0):  # by a weight: rows kept apart
            weight = node.input[1]
            return weight in self._row_free or (
                weight in self._constants and len(self._constants[weight].dims) == 2
            )
        return False

    def _axes(self, node: onnx.NodeProto) -> list[int] | None:
        axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
        if axes is None and len(node.input) > 1 and node.input[1] in self._constants:
            axes = numpy_helper.to_array(self._constants[node.input[1]]).astype(int).tolist()
        return axes

    # -- writing ---------------------------------------------------------------------------------------------
    def _emit(self, node: onnx.NodeProto, layout: str | None) -> list[onnx.NodeProto]:
        if layout is None:
            return [node]
        pads = []
        for k, name in enumerate(node.input):
            if not name or name in self._constants or name in self._row_free:
                continue
            if name not in self._padded and name not in self._emitted:
                pads.append(_pad(name, layout))
                self._emitted.add(name)
                self.pad_layouts.add(layout)
            node.input[k] = _padded_name(name)
        cuts = [_cut(o, self._padded[o]) for o in node.output if o in self._cuts]
        for k, name in enumerate(node.output):
            if name:
                node.output[k] = _padded_name(name)
        return [*pads, node, *cuts]


def _one_layout(layouts: set[str | None]) -> str | None:
    """The layout all of a node's row inputs share, or None (none known, ids, or several)."""
    layout = layouts.pop() if len(layouts) == 1 else None
    return layout if layout in RANK else None


def _padded_name(name: str) -> str:
    return f"{name}_{ROW_PAD_PREFIX}"


def _pad(name: str, layout: str) -> onnx.NodeProto:
    p = ROW_PAD_PREFIX
    pads, axes = {
        BATCH_SEQ: (f"{p}_pads3", f"{p}_axes"),
        BATCH: (f"{p}_pads2", f"{p}_zero"),
        FLAT: (f"{p}_pads_flat", f"{p}_zero"),
    }[layout]
    padded = _padded_name(name)
    return helper.make_node("Pad", [name, pads, "", axes], [padded], mode="edge", name=f"{padded}_pad")


def _cut(real: str, layout: str) -> onnx.NodeProto:
    p = ROW_PAD_PREFIX
    if layout == BATCH_SEQ:
        starts, ends, axes = f"{p}_zeros", f"{p}_shape", f"{p}_axes"
    else:
        starts, ends, axes = f"{p}_zero", f"{p}_b" if layout == BATCH else f"{p}_rows", f"{p}_zero"
    padded = _padded_name(real)
    return helper.make_node("Slice", [padded, starts, ends, axes], [real], name=f"{padded}_cut")


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _int64s(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, dtype=np.int64), f"{ROW_PAD_PREFIX}_{name}")


def _matmul_layouts(model: onnx.ModelProto) -> dict[str, str]:
    """The layout of each MatMulNBits input, from its shape: declared (value_info, as the traced graph has
    them), or that of the graph output it produces (the serving graph's head: [batch, vocab] from [batch,
    d]), or rank 3 (export.model's residual stream, [batch, seq, d], which every other projection reads). Of
    rank 2, [batch, d] where its first axis is input_ids' batch axis, else [batch x seq, d]."""
    declared = {v.name: _dims(v) for v in model.graph.value_info}
    outputs = {v.name: _dims(v) for v in model.graph.output}
    batch = next((_dims(i)[0] for i in model.graph.input if i.name == TOKEN_IDS_INPUT), None)
    shapes = {
        n.input[0]: declared.get(n.input[0], outputs.get(n.output[0], [batch, None, None]))
        for n in model.graph.node
        if n.op_type == "MatMulNBits" and not is_expert_tensor(n.input[0])  # export.moe pads those
    }
    ranks = {len(dims) for dims in shapes.values()}
    if not ranks <= {2, 3}:
        raise ValueError(f"MatMulNBits inputs of rank {sorted(ranks)}: expected 2 or 3")
    return {
        name: BATCH_SEQ if len(dims) == 3 else BATCH if dims[0] == batch else FLAT
        for name, dims in shapes.items()
    }


def _dims(value: onnx.ValueInfoProto) -> list[str | int | None]:
    return [d.dim_param or d.dim_value or None for d in value.type.tensor_type.shape.dim]


def _ids_inputs(graph: onnx.GraphProto) -> dict[str, str]:
    """Graph inputs shaped [batch, seq] as input_ids is (input_ids, position_ids): a table's rows gathered by
    them line up with input_ids' rows."""
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    ids = dims.get(TOKEN_IDS_INPUT)
    return {name: IDS for name, d in dims.items() if ids and d == ids}


def _row_free_inputs(graph: onnx.GraphProto) -> set[str]:
    """Graph inputs with no axis of input_ids' batch: weights fed at run time, the same for every row."""
    ids = next(i for i in graph.input if i.name == TOKEN_IDS_INPUT)
    batch = ids.type.tensor_type.shape.dim[0].dim_param
    return {
        i.name
        for i in graph.input
        if batch and all(d.dim_param != batch for d in i.type.tensor_type.shape.dim)
    }


def _row_pad_nodes(layouts: set[str]) -> list[onnx.NodeProto]:
    """The pads (and the shape to cut back to) shared by every Pad and Slice, from input_ids' shape.
    [batch, seq, ...]: when batch x seq is odd, one more position along the longer axis, which adds the
    fewer rows (one more seq position adds batch rows). [batch, ...]: one more row when batch is odd.
    [batch x seq, ...]: one more row when batch x seq is odd."""
    p = ROW_PAD_PREFIX
    nodes = [helper.make_node("Shape", [TOKEN_IDS_INPUT], [f"{p}_shape"])]
    nodes.append(helper.make_node("Gather", [f"{p}_shape", f"{p}_zero"], [f"{p}_b"], axis=0))
    if layouts & {BATCH_SEQ, FLAT}:
        nodes += [
            helper.make_node("ReduceProd", [f"{p}_shape"], [f"{p}_rows"], keepdims=1),
            helper.make_node("Mod", [f"{p}_rows", f"{p}_two"], [f"{p}_odd"]),
        ]
    if FLAT in layouts:  # one more row when batch x seq is odd
        nodes.append(helper.make_node("Concat", [f"{p}_zero", f"{p}_odd"], [f"{p}_pads_flat"], axis=0))
    if BATCH_SEQ in layouts:
        nodes += [
            helper.make_node("Gather", [f"{p}_shape", f"{p}_one"], [f"{p}_s"], axis=0),
            helper.make_node("Greater", [f"{p}_s", f"{p}_b"], [f"{p}_seq_longer"]),
            helper.make_node("Cast", [f"{p}_seq_longer"], [f"{p}_seq_longer_i"], to=onnx.TensorProto.INT64),
            helper.make_node("Mul", [f"{p}_odd", f"{p}_seq_longer_i"], [f"{p}_more_seq"]),
            helper.make_node("Sub", [f"{p}_odd", f"{p}_more_seq"], [f"{p}_more_batch"]),
            helper.make_node(
                "Concat", [f"{p}_zeros", f"{p}_more_batch", f"{p}_more_seq"], [f"{p}_pads3"], axis=0
            ),
        ]
    if BATCH in layouts:
        nodes += [
            helper.make_node("Mod", [f"{p}_b", f"{p}_two"], [f"{p}_b_odd"]),
            helper.make_node("Concat", [f"{p}_zero", f"{p}_b_odd"], [f"{p}_pads2"], axis=0),
        ]
    for i, node in enumerate(nodes):
        node.name = f"{p}_{i}"
    return nodes

"""The graph speculation verifies with: the serving graph rewritten to score a fixed number of positions of
one row, each position's attention computed exactly as a decode step computes it.

A decode step on a CPU is bound by reading the weights, so the projections and the MLP of every proposed
position run batched, as one [1, positions, d] run. The attention does not: ONNX Runtime's GroupQueryAttention
sums a multi-token query in another order than a one-token one (its probs x V product runs a matrix kernel
where one query runs a vector kernel), enough to part a greedy output from the plain one after a few dozen
tokens on an int8 or int4 bundle. So each layer's GroupQueryAttention becomes a chain of one-position nodes:
node j takes the row's cache as node j - 1 left it, appends position j's keys and values, and attends with
one query over the L + j + 1 keys a decode step would see. Every node's present output is a graph output of
its own (`chained_present_outputs`) that the engine binds to the same KV row as the past input, so each
node appends in place, as a decode step does, and no cache is copied.

The chain has `positions` nodes, the most a run scores; a run of fewer tokens S runs the projections on its S
rows, and the chain's nodes past its last position repeat that position (the same keys and values written
to the same place; their outputs are dropped). The exported one-position-per-row gather
(`last_index`) becomes a flat one over `pick_index` (row * seq + position), so one run returns the logits
of every proposed position, through the same norm and head as a decode step.

Graphs that keep export's row pads (export/row_pad.py, on CPUs whose kernels compute a lone row unlike a
batch's) are refused: there the projections themselves would not be a decode step's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from serve.bundle import ROW_PAD_PREFIX
from serve.engine.runtime import InMemoryGraph, editable_graph
from serve.errors import BundleError

if TYPE_CHECKING:
    import onnx

LAST_INDEX = "last_index"  # [batch]: the exported graph's one position per row
PICK_INDEX = "pick_index"  # [picks]: the rewritten graph's flat positions, row * seq + position
LOGITS = "logits"
ATTENTION = "GroupQueryAttention"


def chained_present_outputs(positions: int) -> list[str]:
    """The suffixes of the extra present outputs per KV buffer ("present_key.3" + suffix): bind each to the
    buffer's row, as "present_key.3" itself is."""
    return [f".pos{j}" for j in range(positions - 1)]


def verification_graph(graph: Path | InMemoryGraph, positions: int) -> InMemoryGraph:
    """`graph` (a path, or a graph already rewritten at load) rewritten to score `positions` tokens of one
    row as `positions` decode steps would; BundleError when the graph is not the shape this rewrite knows."""
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    model, folder = editable_graph(graph)
    where = graph if isinstance(graph, Path) else folder
    if any(node.name.startswith(ROW_PAD_PREFIX) for node in model.graph.node):
        raise BundleError(
            f"{where}: speculation needs the serving graph without row pads, and this CPU keeps them (it "
            "computes a lone row of the graph's MatMulNBits unlike a batch's): serve without --speculative"
        )
    _flat_gather(model, where)
    _chain_attention(model, positions, where)
    return InMemoryGraph(model.SerializeToString(), folder)


def _flat_gather(model: onnx.ModelProto, where: object) -> None:
    from onnx import TensorProto, helper

    graph = model.graph
    readers = [node for node in graph.node if LAST_INDEX in node.input]
    unsqueeze = readers[0] if len(readers) == 1 and readers[0].op_type == "Unsqueeze" else None
    gathers = [] if unsqueeze is None else [n for n in graph.node if unsqueeze.output[0] in n.input]
    if unsqueeze is None or len(gathers) != 1 or gathers[0].op_type != "GatherND":
        raise BundleError(
            f"{where}: speculation cannot rewrite this graph: its {LAST_INDEX} does not feed one gather"
        )
    gather = gathers[0]
    hidden, picked = gather.input[0], gather.output[0]
    flat = f"{picked}_flat"
    nodes = [
        helper.make_node("Flatten", [hidden], [flat], name=f"{picked}_flatten", axis=2),
        helper.make_node("Gather", [flat, PICK_INDEX], [picked], name=f"{picked}_pick", axis=0),
    ]
    kept = []
    for node in graph.node:
        if node is gather:
            kept.extend(nodes)
        elif node is not unsqueeze:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    used = {name for node in kept for name in node.input}
    gone = [t for t in graph.initializer if t.name in unsqueeze.input[1:] and t.name not in used]
    for tensor in gone:  # the Unsqueeze's axes, now read by no node
        graph.initializer.remove(tensor)
    index = next(i for i, value in enumerate(graph.input) if value.name == LAST_INDEX)
    graph.input[index].CopyFrom(helper.make_tensor_value_info(PICK_INDEX, TensorProto.INT64, ["picks"]))
    for output in graph.output:
        if output.name == LOGITS:
            output.type.tensor_type.shape.dim[0].dim_param = "picks"


def _chain_attention(model: onnx.ModelProto, positions: int, where: object) -> None:
    """Each GroupQueryAttention node becomes `positions` one-position nodes chained through the KV row."""
    graph = model.graph
    attention = [node for node in graph.node if node.op_type == ATTENTION]
    if not attention:
        raise BundleError(f"{where}: speculation cannot rewrite this graph: it has no {ATTENTION}")
    seqlens, total = attention[0].input[5], attention[0].input[6]
    nodes = _position_inputs(graph, seqlens, total, positions)
    outputs = []
    for node in graph.node:
        if node.op_type != ATTENTION:
            nodes.append(node)
            continue
        chained, presents = _chained(node, positions, seqlens, total)
        nodes.extend(chained)
        outputs.extend(presents)
    del graph.node[:]
    graph.node.extend(nodes)
    types = {value.name: value for value in graph.output}
    for name in outputs:  # typed as the buffer's own present output
        value = graph.output.add()
        value.CopyFrom(types[name.rsplit(".pos", 1)[0]])
        value.name = name


def _position_inputs(
    graph: onnx.GraphProto, seqlens: str, total: str, positions: int
) -> list[onnx.NodeProto]:
    """The run's S tokens (1 <= S <= positions) per chain node j: the position it takes, min(j, S - 1) (the
    nodes past the run's last position repeat it: same keys and values to the same place, their output
    dropped), and that position's seqlens_k and total_sequence_length (the run's, less S - 1 - j)."""
    from onnx import TensorProto, helper, numpy_helper

    def const(name: str, value: int) -> str:
        graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64), f"verify.{name}"))
        return f"verify.{name}"

    nodes = [
        helper.make_node("Shape", ["input_ids"], ["verify.seq"], start=1, end=2),  # [S]
        helper.make_node("Sub", ["verify.seq", const("one", 1)], ["verify.last"]),  # [S - 1]
    ]
    for j in range(positions):
        take, back = f"verify.take{j}", f"verify.back{j}"
        back32 = f"{back}_i32"
        nodes += [
            helper.make_node("Min", ["verify.last", const(f"j{j}", j)], [take]),  # the position node j takes
            helper.make_node("Sub", ["verify.last", take], [back]),
            helper.make_node("Cast", [back], [back32], to=TensorProto.INT32),
            helper.make_node("Sub", [seqlens, back32], [f"{seqlens}.pos{j}"]),
            helper.make_node("Squeeze", [back32], [f"{back32}_scalar"]),
            helper.make_node("Sub", [total, f"{back32}_scalar"], [f"{total}.pos{j}"]),
        ]
    const("zero", 0)  # where each layer's cut of the chained outputs starts, and on which axis
    const("axis1", 1)
    # Each layer's q, k, v pieces: [1, S, d] padded to [1, positions, d] by repeating the last position.
    nodes += [
        helper.make_node("Sub", [const("positions", positions), "verify.seq"], ["verify.short"]),
        helper.make_node("Concat", [const("pad0", 0), const("pad1", 0), const("pad2", 0), const("pad3", 0),
                                    "verify.short", "verify.pad2"], ["verify.pads"], axis=0),
    ]  # fmt: skip
    return nodes


def _chained(
    node: onnx.NodeProto, positions: int, seqlens: str, total: str
) -> tuple[list[onnx.NodeProto], list[str]]:
    """The one-position nodes replacing `node`, and the extra present outputs they write."""
    from onnx import helper

    inputs = list(node.input)
    qkv, (past_key, past_value), rotary = inputs[:3], inputs[3:5], inputs[7:]
    nodes = []
    present_key, present_value = node.output[1], node.output[2]
    extra: list[str] = []
    attended = []
    key, value = past_key, past_value
    split: list[list[str]] = []
    for name in qkv:  # packed q|k|v, or q, k and v apart
        if not name:
            split.append([""] * positions)
            continue
        padded, parts = f"{name}.padded", [f"{name}.pos{j}" for j in range(positions)]
        nodes.append(helper.make_node("Pad", [name, "verify.pads"], [padded], mode="edge"))
        nodes.append(helper.make_node("Split", [padded], parts, axis=1, num_outputs=positions))
        split.append(parts)
    for j in range(positions):
        pieces = [parts[j] for parts in split]
        last = j == positions - 1
        keys = present_key if last else f"{present_key}.pos{j}"
        values = present_value if last else f"{present_value}.pos{j}"
        if not last:
            extra += [keys, values]
        out = f"{node.output[0]}.pos{j}"
        step = helper.make_node(
            ATTENTION,
            [*pieces, key, value, f"{seqlens}.pos{j}", f"{total}.pos{j}", *rotary],
            [out, keys, values],
            name=f"{node.name}.pos{j}",
            domain=node.domain,
        )
        step.attribute.extend(node.attribute)
        nodes.append(step)
        attended.append(out)
        key, value = keys, values
    whole = f"{node.output[0]}.positions"
    nodes.append(helper.make_node("Concat", attended, [whole], name=f"{node.name}.concat", axis=1))
    # The run's own positions only: the projections after the attention run S rows, as before it.
    cut = [whole, "verify.zero", "verify.seq", "verify.axis1"]
    nodes.append(helper.make_node("Slice", cut, [node.output[0]], name=f"{node.name}.cut"))
    return nodes, extra

"""The serving graph rewritten to return logits at several positions of a row: what speculation scores with.

The exported graph gathers one position per row (`last_index[b]`: `GatherND` of the last hidden states) before
the final norm and the vocabulary projection. Verifying proposed tokens needs the logits of every proposed
position of the speculating row, so at load the engine swaps that gather for a flat one: the hidden states
[batch, seq, d] are flattened to [batch * seq, d] and `pick_index[p]` (row * seq + position) picks each
returned position, giving logits [picks, vocab]. A plain step picks one position per row, the same values the
exported gather picks, through the same norm and head, so everything else the engine runs is unchanged.

Graphs that keep export's row pads (export/row_pad.py, on CPUs that need them) pad the head per row and are
not rewritten: speculation is refused for them at load, with the reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from serve.bundle import ROW_PAD_PREFIX
from serve.engine.row_pad import inline_small_external_tensors
from serve.engine.runtime import InMemoryGraph
from serve.errors import BundleError

if TYPE_CHECKING:
    import onnx

LAST_INDEX = "last_index"  # [batch]: the exported graph's one position per row
PICK_INDEX = "pick_index"  # [picks]: the rewritten graph's flat positions, row * seq + position
LOGITS = "logits"


def verification_graph(graph: Path | InMemoryGraph) -> InMemoryGraph:
    """`graph` (a path, or a graph already rewritten at load) with its one-position-per-row gather replaced
    by the flat `pick_index` gather; BundleError when the graph is not the shape this rewrite knows."""
    import onnx

    if isinstance(graph, InMemoryGraph):
        model, folder = onnx.load_from_string(graph.model), graph.folder
    else:
        model, folder = onnx.load(str(graph), load_external_data=False), graph.parent
        inline_small_external_tensors(model, folder)
    where = graph if isinstance(graph, Path) else folder
    if any(node.name.startswith(ROW_PAD_PREFIX) for node in model.graph.node):
        raise BundleError(
            f"{where}: speculation needs the serving graph without row pads, and this CPU keeps them (it "
            "computes a lone row of the graph's MatMulNBits unlike a batch's): serve without --speculative"
        )
    _flat_gather(model, where)
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

"""The KV cache's element type, chosen when the server starts (`--kv-cache-dtype`): the bundle's own, or
float16 for a float32 bundle, whose serving graph is then rewritten at load.

ONNX Runtime's GroupQueryAttention keeps a floating-point cache in the type of its query (its type
constraints: T_CACHE = T for float32 and float16; its 8-bit caches take an fp32 query but need each layer's
key and value scales, which no bundle has), and the engine binds the cache as both the past input and the
present output of the graph so each step appends in place: a Cast between the cache and the attention would
copy the whole cache every step. So the rewrite runs each attention node in float16: its query, key and value
(and the rotary tables) go through a Cast to float16 before it, its output through a Cast back to float32
after it, and the graph's past and present KV tensors become float16. The projections, norms, MLP and head
stay as exported; what changes precision is what the cache keeps and the attention's own arithmetic.
docs/benchmarks.md ("KV cache dtype") has what it costs in speed and accuracy.

Only the graph's structure is edited (serve/engine/graph_file.py): the weights stay where they lie in the
bundle's files, and ONNX Runtime reads them from there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from serve.engine.runtime import InMemoryGraph, editable_graph
from serve.engine.types import KV_CACHE_DTYPES, KvCacheDtype
from serve.errors import BundleError

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

ATTENTION = "GroupQueryAttention"
# GroupQueryAttention's inputs by position: the float ones the rewrite casts (query or packed qkv, key,
# value, cos_cache, sin_cache), the cache, and the lengths. Any other input (a bias, sinks, scales, norms)
# is one this rewrite does not know the precision of: such a graph is refused.
_CAST_INPUTS = (0, 1, 2, 7, 8)
_KNOWN_INPUTS = (*_CAST_INPUTS, 3, 4, 5, 6)
_KV_PREFIXES = ("past_key.", "past_value.", "present_key.", "present_value.")


def needs_rewrite(dtype: KvCacheDtype, manifest_dtype: str, where: object) -> bool:
    """Whether a graph of `manifest_dtype` ("float32", "float16") must be rewritten for a cache of `dtype`;
    BundleError for a float16 bundle asked for a float32 cache (all of its graph computes in float16)."""
    if dtype == "auto" or KV_CACHE_DTYPES[dtype] == manifest_dtype:
        return False
    if manifest_dtype != "float32":
        raise BundleError(
            f"{where}: the bundle is {manifest_dtype}, so its KV cache is too; --kv-cache-dtype {dtype} "
            "needs a float32 bundle (or leave it at auto)"
        )
    return True


def fp16_cache_graph(graph: Path | InMemoryGraph) -> InMemoryGraph:
    """The float32 serving graph `graph` (a path, or a graph already rewritten at load) with a float16 KV
    cache; BundleError when it is not a graph this rewrite knows."""
    model, folder = editable_graph(graph)
    nodes = fp16_attention(model, graph if isinstance(graph, Path) else folder)
    log.info("KV cache in float16: the graph's %d attention nodes run in float16", nodes)
    return InMemoryGraph(model.SerializeToString(), folder)


def fp16_attention(model: onnx.ModelProto, where: object) -> int:
    """Rewrite `model` in place as the module docstring says; returns the attention nodes rewritten."""
    from onnx import TensorProto

    graph = model.graph
    kv = [value for value in [*graph.input, *graph.output] if value.name.startswith(_KV_PREFIXES)]
    if not kv or any(value.type.tensor_type.elem_type != TensorProto.FLOAT for value in kv):
        raise BundleError(f"{where}: the graph's KV cache is not float32: it cannot be made float16")
    casts: dict[str, str] = {}  # a float32 tensor -> its float16 copy (the rotary tables serve every layer)
    nodes: list[onnx.NodeProto] = []
    attention = 0
    for node in graph.node:
        if node.op_type != ATTENTION:
            nodes.append(node)
            continue
        unknown = [i for i, name in enumerate(node.input) if name and i not in _KNOWN_INPUTS]
        if unknown:
            raise BundleError(
                f"{where}: {node.name} has {ATTENTION} inputs (at positions {unknown}) that the float16 KV "
                "cache rewrite does not handle: serve it with --kv-cache-dtype auto"
            )
        for i in (i for i in _CAST_INPUTS if i < len(node.input) and node.input[i]):
            name = node.input[i]
            if name not in casts:
                casts[name] = f"{name}.fp16"
                nodes.append(_cast(name, casts[name], TensorProto.FLOAT16))
            node.input[i] = casts[name]
        output = node.output[0]
        node.output[0] = f"{output}.fp16"
        nodes += [node, _cast(node.output[0], output, TensorProto.FLOAT)]
        attention += 1
    if not attention:
        raise BundleError(f"{where}: the graph has no {ATTENTION}: no KV cache this rewrite knows")
    del graph.node[:]
    graph.node.extend(nodes)
    for value in kv:
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    return attention


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    from onnx import helper

    return helper.make_node("Cast", [source], [target], name=f"{target}/cast", to=to)

"""FP16 graphs for the CUDA and TensorRT execution providers.

`onnxruntime.transformers.float16` converts weights, activations, graph inputs/outputs and the KV cache to
float16, except:
- LayerNormalization, RMSNormalization and Softmax (when the graph has one: the decomposed opset-18 form)
  stay float32 behind Casts: their reductions lose too much in half precision;
- RMSNorm written out of primitive ops (the serving graph's, export/onnx_inplace.py: x / sqrt(mean(x^2) +
  eps) * weight; the standard graph's at opset 18, traced: x * reciprocal(sqrt(mean(x^2) + eps)) * weight)
  stays float32 up to the square root's consumer: x^2 and mean(x^2) overflow float16 once |x| > 256, and
  the residual streams of real models run to thousands. The converter isolates each kept node behind Casts
  of its own, so the float16 round trips between them are removed again (a round trip right after x^2
  would overflow just the same). The weight multiply runs in float16 on the normalized values.
  tests/export/test_export.py checks the graph's types and that rows of |x| ~ 9000 come out finite and within
  2e-3. On CPU, whose kernels widen float16 themselves, a naive conversion of the serving graph's norm
  stays finite too (the overflow there is a GPU kernel's); a float16 "+ eps" between the mean and the
  square root overflows anywhere, since mean(x^2) itself is rounded to float16 (the traced graph's test);
- constants are clipped to +-1e4 rather than fp16's 65504. The attention mask's "minus infinity" is
  float32's finfo.min; clipped to -65504, a score added to it in fp16 arithmetic overflows to -inf, and a
  fully masked (padding) row then softmaxes to NaN, which would spread through the padded positions' keys
  and values. -1e4 leaves headroom and still gives masked keys a weight of exp(-1e4) = 0. (On CPU both
  limits stayed finite on the demo model: ONNX Runtime's CPU kernels widen fp16 internally; GPU kernels
  need not, and this was not measurable here.)
No GPU here: validity is checked on CPU with onnx.checker and strict shape inference; numerics are checked
by `textgen-bench gpu-check` on a GPU machine.
"""

from __future__ import annotations

import onnx
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
from onnxruntime.transformers.onnx_model import OnnxModel

FP32_OPS = ("LayerNormalization", "RMSNormalization", "Softmax")
# The ops of a written-out RMSNorm (only RMSNorm uses them in our graphs); its "+ eps" is the Add of a mean.
RMS_NORM_OPS = ("Pow", "ReduceMean", "Sqrt", "Div")


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A deep copy that, unlike a serialization round trip, works past protobuf's 2 GB."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def rms_norm_nodes(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes of written-out RMSNorms up to the division, kept in float32: the ops above, and
    each Add of a ReduceMean's output (mean(x^2) + eps; the tracer names it otherwise than our builder)."""
    means = {out for n in model.graph.node if n.op_type == "ReduceMean" for out in n.output}
    return [
        n.name
        for n in model.graph.node
        if n.op_type in RMS_NORM_OPS or (n.op_type == "Add" and any(i in means for i in n.input))
    ]


CONSTANT_LIMIT = 1e4


def _drop_cast_round_trips(model: onnx.ModelProto, fp32_nodes: set[str]) -> int:
    """The converter isolates each kept node behind its own Casts, so between two kept nodes a value goes to
    float16 and back: x^2 would overflow right there. Wire each such Cast(float16) -> Cast(float) pair
    straight through (the value stays float32); returns how many were removed."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    casts_to = {n.name: next((a.i for a in n.attribute if a.name == "to"), None) for n in graph.node}
    removed = 0
    for node in list(graph.node):
        if node.op_type != "Cast" or casts_to[node.name] != onnx.TensorProto.FLOAT:
            continue
        inner = producers.get(node.input[0])
        if inner is None or inner.op_type != "Cast" or casts_to[inner.name] != onnx.TensorProto.FLOAT16:
            continue
        source = producers.get(inner.input[0])
        if source is None or source.name not in fp32_nodes:
            continue
        for consumer in graph.node:  # read the float32 value itself
            for i, name in enumerate(consumer.input):
                if name == node.output[0]:
                    consumer.input[i] = inner.input[0]
        graph.node.remove(node)
        removed += 1
    used = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
    for node in list(graph.node):  # Cast(float16)s nobody reads any more
        if node.op_type == "Cast" and not any(out in used for out in node.output):
            graph.node.remove(node)
    return removed


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of `model` (the caller's graph is left untouched), checked for validity."""
    converted = convert_float_to_float16(
        copy_model(model),
        keep_io_types=False,
        max_finite_val=CONSTANT_LIMIT,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS],
        node_block_list=rms_norm_nodes(model),
    )
    _drop_cast_round_trips(converted, set(rms_norm_nodes(model)))
    # The converter appends its Casts at the end of the node list; ONNX requires topological order.
    OnnxModel(converted).topological_sort()
    # Some intermediate type annotations it leaves are stale (float where the tensor is now float16): drop
    # them all; strict shape inference below recomputes every type from the inputs and initializers.
    del converted.graph.value_info[:]
    check_graph(converted)
    return converted


def check_graph(model: onnx.ModelProto) -> None:
    """onnx.checker plus strict shape inference; raises onnx's ValidationError/InferenceError if invalid."""
    onnx.checker.check_model(model)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)

"""FP16 graphs for the CUDA and TensorRT execution providers.

`onnxruntime.transformers.float16` converts weights, activations, graph inputs/outputs and the KV cache to
float16, except:
- LayerNormalization and Softmax (when the graph has one: the decomposed opset-18 form) stay float32 behind
  Casts: their reductions lose too much in half precision;
- constants are clipped to +-1e4 rather than fp16's 65504. The attention mask's "minus infinity" is
  float32's finfo.min; clipped to -65504, a score added to it in fp16 arithmetic overflows to -inf, and a
  fully masked (padding) row then softmaxes to NaN, which would spread through the padded positions' keys
  and values. -1e4 leaves headroom and still gives masked keys a weight of exp(-1e4) = 0. (On CPU both
  limits stayed finite on the demo model: ONNX Runtime's CPU kernels widen fp16 internally; GPU kernels
  need not, and this was not measurable here.)
No GPU here: validity is checked on CPU with onnx.checker and strict shape inference; numerics are checked
by bench/gpu_check.py on a GPU machine.
"""

from __future__ import annotations

import onnx
from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16
from onnxruntime.transformers.onnx_model import OnnxModel

FP32_OPS = ("LayerNormalization", "Softmax")
CONSTANT_LIMIT = 1e4


def convert_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A float16 copy of `model` (the caller's graph is left untouched), checked for validity."""
    converted = convert_float_to_float16(
        onnx.ModelProto.FromString(model.SerializeToString()),
        keep_io_types=False,
        max_finite_val=CONSTANT_LIMIT,
        op_block_list=[*DEFAULT_OP_BLOCK_LIST, *FP32_OPS],
    )
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

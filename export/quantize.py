"""INT8: ONNX Runtime dynamic quantization of the weight MatMuls (signed int8 weights, QInt8).

QInt8 because the issue measured it faster than QUInt8 on this CPU. Known trap: when the exporter leaves the
tied output head as `MatMul(x, Transpose(embedding))`, quantize_dynamic sees no constant weight and skips it
(16 of 17 MatMuls on bench-a). `fold_weight_transposes` replaces such Transposes of initializers with
pre-transposed initializers first, so the head, the largest MatMul, is quantized too. The in-place builder
already writes the head as its own [d, vocab] initializer.

Accuracy against fp32 (`int8_accuracy`): mean next-token loss and perplexity of both on held-out text (stdlib
files the demo model never trained on), top-1 agreement of the two at every position, and greedy agreement
over the fixed prompt set. Target: perplexity within 2% of fp32.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from tokenizers import Tokenizer

from export.fp16 import copy_model
from export.generation import PROMPTS, Shape, StepFn, agreement_prefix, encode_prompts, greedy
from export.train import encode_stream, load_corpus

MAX_PERPLEXITY_RATIO = 1.02
LARGE_MODEL_BYTES = 1_500_000_000  # weights past which quantize_dynamic must write external data
QUANTIZED_MATMUL_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")
HELDOUT_BUDGET_BYTES = 1_000_000  # of corpus read; its held-out share (~5%) is plenty for the estimate
HELDOUT_PERCENT = 5
LOSS_WINDOWS = 16
LOSS_WINDOW_TOKENS = 128
GREEDY_STEPS = 32


def fold_weight_transposes(model: onnx.ModelProto) -> int:
    """Turn MatMul(x, Transpose(W)), W an initializer, into MatMul(x, W^T). Returns how many were folded."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    consumers = Counter(name for node in graph.node for name in node.input)
    folded = 0
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        tr = producers.get(node.input[1])
        if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
            continue
        weight = numpy_helper.to_array(inits[tr.input[0]])
        perm = next((list(a.ints) for a in tr.attribute if a.name == "perm"), None)
        name = f"{tr.input[0]}.transposed"
        if name not in inits:
            inits[name] = numpy_helper.from_array(np.ascontiguousarray(weight.transpose(perm)), name)
            graph.initializer.append(inits[name])
        node.input[1] = name
        consumers[tr.output[0]] -= 1
        if consumers[tr.output[0]] == 0:
            graph.node.remove(tr)
        folded += 1
    return folded


def count_weight_matmuls(model: onnx.ModelProto) -> dict[str, int]:
    """MatMuls with a constant weight left in float, and quantized MatMul ops."""
    inits = {t.name for t in model.graph.initializer}
    ops = Counter(n.op_type for n in model.graph.node)
    float_weight = sum(1 for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in inits)
    return {"float": float_weight, "quantized": sum(ops[o] for o in QUANTIZED_MATMUL_OPS)}


@contextmanager
def _quiet_root_logger() -> Iterator[None]:
    # quantize_dynamic logs "consider pre-processing" on the root logger on every call; the pre-processing
    # that matters here (exposing the head's weight) is fold_weight_transposes, already done.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def quantize_int8(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Dynamic INT8 quantization of every weight MatMul; returns the graph and the MatMul counts."""
    model = copy_model(model)  # the caller's graph stays fp32
    large = sum(len(t.raw_data) for t in model.graph.initializer) > LARGE_MODEL_BYTES
    folded = fold_weight_transposes(model)
    with tempfile.TemporaryDirectory() as tmp, _quiet_root_logger():
        out = Path(tmp) / "int8.onnx"
        quantize_dynamic(
            model,
            out,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            # Shape inference cannot type the outputs of com.microsoft ops (GroupQueryAttention).
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
            use_external_data_format=large,  # past protobuf's 2 GB the graph cannot be one file
        )
        quantized = onnx.load(str(out))  # loads the external data too: the temp dir goes away
    counts = count_weight_matmuls(quantized)
    return quantized, {**counts, "transposes_folded": folded}


def heldout_windows(tokenizer: Tokenizer, context_length: int) -> np.ndarray:
    """[N, L] token windows of held-out stdlib text, L = min(context, LOSS_WINDOW_TOKENS)."""
    corpus = load_corpus(HELDOUT_BUDGET_BYTES, HELDOUT_PERCENT)
    stream = encode_stream(tokenizer, corpus.heldout).numpy()
    length = min(context_length, LOSS_WINDOW_TOKENS)
    count = min(LOSS_WINDOWS, len(stream) // length)
    if count == 0:
        raise ValueError("not enough held-out text for a single window")
    return stream[: count * length].reshape(count, length)


def _full_logits(step: StepFn, windows: np.ndarray, shape: Shape) -> np.ndarray:
    n, length = windows.shape
    empty = np.zeros((n, shape.n_heads, 0, shape.head_dim), np.float32)
    feed: dict[str, np.ndarray] = {
        "input_ids": windows.astype(np.int64),
        "attention_mask": np.ones((n, length), np.int64),
        "position_ids": np.broadcast_to(np.arange(length, dtype=np.int64), (n, length)).copy(),
    }
    feed.update({f"past_key_values.{i}.{k}": empty for i in range(shape.n_layers) for k in ("key", "value")})
    return step(feed)[0][:, :-1]  # [N, L-1, V]: predictions of tokens 1..L-1


def mean_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return float(-np.take_along_axis(log_probs, targets[..., None], axis=-1).mean())


def int8_accuracy(
    fp32: StepFn, int8: StepFn, tokenizer: Tokenizer, shape: Shape, pad_id: int, context_length: int
) -> dict[str, Any]:
    windows = heldout_windows(tokenizer, context_length)
    ref_logits, q_logits = _full_logits(fp32, windows, shape), _full_logits(int8, windows, shape)
    targets = windows[:, 1:]
    ref_loss, q_loss = mean_loss(ref_logits, targets), mean_loss(q_logits, targets)
    steps = min(GREEDY_STEPS, context_length // 2)
    prompts = encode_prompts(tokenizer, context_length, steps)
    ref_tokens = greedy(fp32, prompts, pad_id, shape, steps).tokens
    q_tokens = greedy(int8, prompts, pad_id, shape, steps).tokens
    ratio = math.exp(q_loss) / math.exp(ref_loss)
    return {
        "heldout_tokens": int(targets.size),
        "fp32_loss": ref_loss,
        "int8_loss": q_loss,
        "fp32_perplexity": math.exp(ref_loss),
        "int8_perplexity": math.exp(q_loss),
        "perplexity_ratio": ratio,
        "max_perplexity_ratio": MAX_PERPLEXITY_RATIO,
        "top1_agreement": float((ref_logits.argmax(-1) == q_logits.argmax(-1)).mean()),
        "greedy_prompts": len(PROMPTS),
        "greedy_steps": steps,
        "greedy_identical_prompts": int(np.all(ref_tokens == q_tokens, axis=1).sum()),
        "greedy_prefix_agreement": float(agreement_prefix(ref_tokens, q_tokens).mean()),
    }

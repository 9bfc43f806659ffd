"""Weight quantization for CPU serving, with ONNX Runtime's own tools, and its accuracy against fp32.

- `quantize_nbits` (`--int8`, `--int4`): weight-only block quantization by
  `onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`: every weight MatMul (the LM head
  included) becomes `MatMulNBits` (symmetric, one float scale per block of `block_size` weights along K,
  accuracy_level 4: the CPU kernel quantizes each activation row to int8 on its own and computes in int8).
  The token embedding becomes `GatherBlockQuantized` too: at 4 bits by the tool; at 8 bits, which the tool
  does not do for Gathers, by its own block quantizer (`_gather_8bit`). A tied embedding is quantized
  twice: once as the gather's [vocab, d] table and once as the head's [d, vocab] weight (MatMulNBits repacks
  its weight at load, so one shared initializer would not save memory at run time). Position and rotary
  tables, norms and the KV cache stay float.
  Because each activation row gets its own scale, a row's logits do not depend on the rows batched with it,
  as long as ONNX Runtime computes a row with the same kernel alone and in a batch. It does not: MLAS's
  many-row MatMulNBits kernel takes rows in pairs and leaves a lone row (and the odd last row of an odd
  count) to a one-row kernel whose sums differ by up to 5e-2 on the logits, and which block sizes take it
  depends on the CPU (ONNX Runtime 1.32, AMD EPYC: past block 32 at 4 bits and 64 at 8 bits with AVX-512
  VNNI; past 16 at 4 bits and at no block at 8 bits with AVX2 only). A bundle is exported on one machine
  and served on another, so `export.row_pad.pad_single_rows` makes every MatMulNBits' row count even past
  the largest block every measured CPU computes alike (`INVARIANT_MAX_BLOCK`: 16 at 4 bits, 64 at 8
  bits), and a row then takes the pair kernel alone as in a batch (`textgen-bench batch-invariance`
  measures with and without the pad; measured exact for every even count up to 64 at 1 to 16 threads on
  both CPUs): every MatMulNBits bundle is batch invariant. The pad costs speed where it applies (a lone
  decode row computed as two, and a Pad and a Slice around each attention; docs/benchmarks.md), so the
  8-bit default, which no measured CPU needs it for, goes without.
- `quantize_int8` (`--int8-dynamic`): dynamic INT8 (`quantize_dynamic`, QInt8 weights, activations quantized
  per tensor at run time). Fast at large batches (docs/benchmarks.md, "Quantization (INT8, INT4)"), but one
  activation scale spans the whole batch, so a row's tokens depend on its neighbours: not batch invariant.

QInt8 because it measured faster than QUInt8 on the x86 CPUs tried. Known trap: when the exporter leaves the
tied output head as `MatMul(x, Transpose(embedding))`, quantize_dynamic sees no constant weight and skips it
(16 of 17 MatMuls on bench-a). `fold_weight_transposes` replaces such Transposes of initializers with
pre-transposed initializers first, so the head, the largest MatMul, is quantized too. The in-place builder
already writes the head as its own [d, vocab] initializer. The other trap is Gemm, which neither quantizer
takes: torch's dynamo exporter writes a Linear on 2-D rows as one (the standard graph's experts and routers,
on the flattened [batch x seq, d] rows), and `gemms_to_matmuls` makes MatMuls of them first, so a mixture of
experts scores prompts with the experts it generates with, not float ones (and stores them at its precision).

Accuracy against fp32 (`quantized_accuracy`): mean next-token loss and perplexity of both on held-out text
(stdlib files the demo model never trained on, or the user's --eval-text), top-1 agreement of the two at
every position, the largest logit difference there, and greedy agreement over the fixed prompt set. Target
for 8 bits: perplexity within 2% of fp32; 4 bits is reported, not judged.
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
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantFormat, QuantType, quantize_dynamic
from tokenizers import Tokenizer

from export.fp16 import copy_model
from export.generation import PROMPTS, Shape, StepFn, agreement_prefix, encode_prompts, greedy
from export.moe import experts_to_qmoe, pad_expert_rows, router_name, routers
from export.row_pad import TOKEN_IDS_INPUT, pad_single_rows
from export.train import encode_stream, load_corpus

MAX_PERPLEXITY_RATIO = 1.02
LARGE_MODEL_BYTES = 1_500_000_000  # weights past which quantize_dynamic must write external data
QUANTIZED_MATMUL_OPS = ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "MatMulNBits")
NBITS = (4, 8)
DEFAULT_BLOCK_SIZE = {4: 32, 8: 64}
# The largest MatMulNBits block at which every CPU measured (module docstring) gave a row alone exactly
# its result in a batch; past it `pad_single_rows` applies.
INVARIANT_MAX_BLOCK = {4: 16, 8: 64}
ACCURACY_LEVEL_INT8 = 4  # MatMulNBits' CPU compute in int8 (activations quantized per row, per block)
HELDOUT_BUDGET_BYTES = 1_000_000  # of corpus read; its held-out share (~5%) is plenty for the estimate
HELDOUT_PERCENT = 5
LOSS_WINDOWS = 16
LOSS_WINDOW_TOKENS = 128
GREEDY_STEPS = 32
# The held-out logits quantized_accuracy holds at once, per model: all windows at a small vocabulary (one
# call), a window or two at a large one (16 windows of 128 positions at 262,144 ids are 2.1 GB per model).
ACCURACY_LOGITS_BYTES = 256 * 2**20


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


def gemms_to_matmuls(model: onnx.ModelProto) -> int:
    """Turn each Gemm by a constant weight into MatMul (and an Add of its bias), which the quantizers take:
    torch's dynamo exporter writes a Linear on 2-D rows as Gemm (the standard graph's experts and routers,
    export/onnx_standard.py). A weight is an initializer or a Gather of one by a constant index (an expert's
    slice of its layer's stacked [E, N, K] parameter), which becomes an initializer of its own: the stacked
    one goes once no node reads it. Only where the result is the same sums: transA 0, alpha 1, and beta 1
    where there is a bias; a transB weight is stored transposed, as `fold_weight_transposes` does. A
    router's MatMul is named as the serving graph names it (export.moe.ROUTER_SUFFIX), so it stays float in
    both graphs. Returns how many were rewritten."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    arrays: dict[str, np.ndarray] = {}  # initializers read as arrays, each once

    def array(name: str) -> np.ndarray:
        if name not in arrays:
            arrays[name] = numpy_helper.to_array(inits[name])
        return arrays[name]

    def constant(name: str) -> np.ndarray | None:
        if name in inits:
            return array(name)
        gather = producers.get(name)
        if gather is None or gather.op_type != "Gather" or not all(i in inits for i in gather.input[:2]):
            return None
        axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
        return np.take(array(gather.input[0]), array(gather.input[1]), axis=axis)

    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()  # the weights' former names
    rewritten = 0
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        exact = attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0
        exact = exact and (bias is None or attrs.get("beta", 1.0) == 1.0)
        weight = constant(node.input[1]) if node.op_type == "Gemm" and exact else None
        if weight is None or weight.ndim != 2:
            nodes.append(node)
            continue
        source = node.input[1]
        name = f"{source}.transposed" if attrs.get("transB", 0) else f"{source}.folded"
        if name not in inits:
            values = np.ascontiguousarray(weight.T if attrs.get("transB", 0) else weight)
            inits[name] = numpy_helper.from_array(values, name)
            graph.initializer.append(inits[name])
        replaced.add(source)
        product = f"{node.output[0]}_matmul" if bias else node.output[0]
        matmul_name = router_name(source) or node.name
        nodes.append(helper.make_node("MatMul", [node.input[0], name], [product], name=matmul_name))
        if bias:
            add = helper.make_node("Add", [product, bias], list(node.output), name=f"{node.name}_bias")
            nodes.append(add)
        rewritten += 1
    # The Gathers of the weights, and the initializers they and the Gemms read, go where nothing else reads
    # them: the graph keeps one copy of each weight.
    outputs = {o.name for o in graph.output}
    used = {name for n in nodes for name in n.input} | outputs
    gathers = [producers[r] for r in replaced if r in producers and r not in used]
    dropped = {g.output[0] for g in gathers}
    nodes = [n for n in nodes if not (n.op_type == "Gather" and n.output[0] in dropped)]
    used = {name for n in nodes for name in n.input} | outputs
    sources = replaced | {i for g in gathers for i in g.input}
    del graph.node[:]
    graph.node.extend(nodes)
    for name in sources - used:
        if name in inits:
            graph.initializer.remove(inits[name])
    return rewritten


def weight_tensors(model: onnx.ModelProto) -> set[str]:
    """The tensors a product by a weight reads as its weight: initializers, and the Gathers of an initializer
    by a constant index (the traced standard graph's experts, each a slice of its layer's stacked
    parameter)."""
    inits = {t.name for t in model.graph.initializer}
    gathers = (n for n in model.graph.node if n.op_type == "Gather")
    return inits | {n.output[0] for n in gathers if all(i in inits for i in n.input[:2])}


def count_weight_matmuls(model: onnx.ModelProto) -> dict[str, int]:
    """MatMuls and Gemms by a weight (`weight_tensors`) left in float (the experts' routers, float on
    purpose, not counted), and quantized MatMul ops."""
    weights = weight_tensors(model)
    ops = Counter(n.op_type for n in model.graph.node)
    kept = set(routers(model))
    float_weight = sum(
        1
        for n in model.graph.node
        if n.op_type in ("MatMul", "Gemm") and n.input[1] in weights and n.name not in kept
    )
    return {"float": float_weight, "quantized": sum(ops[o] for o in QUANTIZED_MATMUL_OPS)}


def count_quantized_gathers(model: onnx.ModelProto) -> int:
    """Embedding lookups in block-quantized form (GatherBlockQuantized)."""
    return sum(1 for n in model.graph.node if n.op_type == "GatherBlockQuantized")


@contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    # quantize_dynamic logs "consider pre-processing" on the root logger on every call (the pre-processing
    # that matters here, exposing the head's weight, is fold_weight_transposes, already done);
    # MatMulNBitsQuantizer logs every node at INFO and warns that it raises the opset to 21 for int4 types.
    loggers = [logging.getLogger(name) for name in names or ("",)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def quantize_int8(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Dynamic INT8 quantization of every weight MatMul; returns the graph and the MatMul counts."""
    model = copy_model(model)  # the caller's graph stays fp32
    large = sum(len(t.raw_data) for t in model.graph.initializer) > LARGE_MODEL_BYTES
    folded = fold_weight_transposes(model)
    gemms = gemms_to_matmuls(model)
    with tempfile.TemporaryDirectory() as tmp, _quiet_loggers():
        out = Path(tmp) / "int8.onnx"
        quantize_dynamic(
            model,
            out,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            nodes_to_exclude=routers(model),
            # Shape inference cannot type the outputs of com.microsoft ops (GroupQueryAttention).
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
            use_external_data_format=large,  # past protobuf's 2 GB the graph cannot be one file
        )
        quantized = onnx.load(str(out))  # loads the external data too: the temp dir goes away
    counts = count_weight_matmuls(quantized)
    return quantized, {**counts, "transposes_folded": folded, "gemms_rewritten": gemms}


def check_block_size(block_size: int) -> int:
    """MatMulNBits (and GatherBlockQuantized) take a power of two of at least 16 weights per block."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(
            f"block size must be a power of two >= 16 (ONNX Runtime's MatMulNBits), got {block_size}"
        )
    return block_size


def batch_invariant_scheme(bits: int | None, block_size: int | None) -> bool:
    """Whether ONNX Runtime computes a row the same alone as in a batch for this weight format: float (None)
    and MatMulNBits (any block: `pad_single_rows`); not dynamic INT8 (bits 8 without a block size)."""
    return bits is None or block_size is not None


def pads_rows(bits: int, block_size: int) -> bool:
    """Whether quantize_nbits pads this format's odd row counts (`pad_single_rows`)."""
    return block_size > INVARIANT_MAX_BLOCK[bits]


def _non_token_gathers(model: onnx.ModelProto) -> list[str]:
    """Names of the Gathers of constant tables other than the token embedding (positions, rotary cos/sin):
    the quantizer must leave them float. Unnamed ones are named so they can be excluded."""
    inits = {t.name for t in model.graph.initializer}
    names = []
    for i, node in enumerate(model.graph.node):
        if node.op_type == "Gather" and node.input[0] in inits and node.input[1] != TOKEN_IDS_INPUT:
            node.name = node.name or f"gather_{i}"
            names.append(node.name)
    return names


def _matmul_nbits() -> Any:
    """onnxruntime.quantization.matmul_nbits_quantizer. It calls logging.basicConfig(level=INFO) when
    imported, which would print every INFO line of every library (the exporter's) from then on: imported
    here, with the root logger put back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    from onnxruntime.quantization import matmul_nbits_quantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    return matmul_nbits_quantizer


def _gather_8bit(model: onnx.ModelProto, block_size: int) -> int:
    """The token embedding's Gather as an 8-bit GatherBlockQuantized; returns how many were replaced.

    The tool quantizes Gathers to 4 bits only, so its block quantizer does it: a table's rows are the columns
    of its transpose, and quantizing table^T as a MatMul weight gives [vocab, d / block, block] uint8 (zero
    point 128, symmetric) and [vocab, d / block] scales: GatherBlockQuantized's layout along axis 1, whose
    default uint8 zero point is 128 too. A width that is not a multiple of the block ends in a partial block
    (the quantizer pads it; the padding is cut off)."""
    nbits = _matmul_nbits()
    config = nbits.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=8)
    block_quant = nbits.DefaultWeightOnlyQuantizer(config).qbits_block_quant
    inits = {t.name: t for t in model.graph.initializer}
    replaced: list[str] = []  # the float tables
    for node in model.graph.node:
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if node.op_type != "Gather" or node.input[1] != TOKEN_IDS_INPUT or node.input[0] not in inits or axis:
            continue
        table = numpy_helper.to_array(inits[node.input[0]])
        if table.ndim != 2 or table.dtype != np.float32:
            continue
        packed, scales, _ = block_quant(np.ascontiguousarray(table.T))
        rows = np.ascontiguousarray(packed.reshape(len(table), -1)[:, : table.shape[1]])
        data = numpy_helper.from_array(rows, f"{node.input[0]}_gather_Q8")
        scale = numpy_helper.from_array(scales, f"{node.input[0]}_gather_scales")
        model.graph.initializer.extend([data, scale])
        gather = helper.make_node(
            "GatherBlockQuantized",
            [data.name, node.input[1], scale.name],
            list(node.output),
            name=f"{node.name}_Q8",
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=1,
            block_size=block_size,
            bits=8,
        )
        replaced.append(node.input[0])
        node.CopyFrom(gather)
    used = {name for node in model.graph.node for name in node.input}
    for name in set(replaced) - used:
        model.graph.initializer.remove(inits[name])
    return len(replaced)


def quantize_nbits(
    model: onnx.ModelProto,
    bits: int,
    block_size: int,
    pad_rows: bool = True,
    qmoe: bool = True,
    in_place: bool = False,
) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Weight-only MatMulNBits of every weight MatMul, and GatherBlockQuantized of the token embedding; with
    `pad_single_rows` where `pads_rows` (`pad_rows=False` measures without); elsewhere a sparse layer's
    experts then one QMoE (`experts_to_qmoe`; `qmoe=False` keeps their MatMulNBits, to measure against).

    The caller's graph is left float unless `in_place`: then `model` itself is quantized and returned, for
    a caller that drops the float graph anyway (the exporter), so its weights are not copied once more at
    the export's memory peak (a copy is a second float copy of every weight: 1.4 GiB at 373M parameters)."""
    if bits not in NBITS:
        raise ValueError(f"bits must be one of {NBITS}, got {bits}")
    check_block_size(block_size)
    if not in_place:
        model = copy_model(model)
    folded = fold_weight_transposes(model)
    gemms = gemms_to_matmuls(model)
    quantizer = _matmul_nbits().MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL_INT8,
        nodes_to_exclude=[*_non_token_gathers(model), *routers(model)],
        quant_format=QuantFormat.QOperator,
        op_types_to_quantize=("MatMul", "Gather") if bits == 4 else ("MatMul",),
    )
    with _quiet_loggers("onnxruntime.quantization.matmul_nbits_quantizer"):
        quantizer.process()
    quantized: onnx.ModelProto = quantizer.model.model
    if bits == 8:
        _gather_8bit(quantized, block_size)
    pad = pad_rows and pads_rows(bits, block_size)
    # Where MatMulNBits needs its rows padded, the experts keep their MatMulNBits and pad_expert_rows: QMoE
    # fed every pair row twice (even counts) measured slower at 4 tokens (docs/benchmarks.md).
    fused = experts_to_qmoe(quantized) if qmoe and not pad else 0
    padded = pad_expert_rows(quantized) + pad_single_rows(quantized) if pad else 0
    counts = count_weight_matmuls(quantized)
    gathers = count_quantized_gathers(quantized)
    return quantized, {
        **counts,
        "transposes_folded": folded,
        "gemms_rewritten": gemms,
        "quantized_gathers": gathers,
        "single_row_padded": padded,
        "qmoe_layers": fused,
    }


def heldout_windows(tokenizer: Tokenizer, context_length: int, text: str | None = None) -> np.ndarray:
    """[N, L] token windows of held-out text, L = min(context, LOSS_WINDOW_TOKENS): `text` (the user's
    --eval-text), else the stdlib files the demo model is not trained on."""
    texts = [text] if text is not None else load_corpus(HELDOUT_BUDGET_BYTES, HELDOUT_PERCENT).heldout
    stream = encode_stream(tokenizer, texts).numpy()
    length = min(context_length, LOSS_WINDOW_TOKENS)
    count = min(LOSS_WINDOWS, len(stream) // length)
    if count == 0:
        raise ValueError(f"not enough held-out text for a single window of {length} tokens")
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


def quantized_accuracy(
    fp32: StepFn,
    quantized: StepFn,
    tokenizer: Tokenizer,
    shape: Shape,
    pad_id: int,
    context_length: int,
    eval_text: str | None = None,
    logits_bytes: int = ACCURACY_LOGITS_BYTES,
) -> dict[str, Any]:
    """The quantized model against the fp32 one: held-out perplexity, logits and greedy tokens. The windows
    are run in chunks of at most `logits_bytes` of logits per model (at least one window), each chunk's
    figures kept and its logits dropped: both models' logits of every window, and the loss's temporaries
    as large, would otherwise be the export's memory peak at a large vocabulary."""
    windows = heldout_windows(tokenizer, context_length, eval_text)
    ref_nll = q_nll = max_diff = 0.0
    top1_agree = start = 0
    per_chunk = 1  # the first window tells one window's size
    while start < len(windows):
        chunk = windows[start : start + per_chunk]
        ref_logits, q_logits = _full_logits(fp32, chunk, shape), _full_logits(quantized, chunk, shape)
        targets = chunk[:, 1:]
        # Sums of the losses, so the mean is over every target whatever the chunks.
        ref_nll += mean_loss(ref_logits, targets) * targets.size
        q_nll += mean_loss(q_logits, targets) * targets.size
        max_diff = max(max_diff, float(np.abs(ref_logits - q_logits).max()))
        top1_agree += int((ref_logits.argmax(-1) == q_logits.argmax(-1)).sum())
        start += len(chunk)
        per_chunk = max(1, logits_bytes // ref_logits[0].nbytes)
        del ref_logits, q_logits
    targets_size = windows[:, 1:].size
    ref_loss, q_loss = ref_nll / targets_size, q_nll / targets_size
    steps = min(GREEDY_STEPS, context_length // 2)
    prompts = encode_prompts(tokenizer, context_length, steps)
    ref_tokens = greedy(fp32, prompts, pad_id, shape, steps).tokens
    q_tokens = greedy(quantized, prompts, pad_id, shape, steps).tokens
    ratio = math.exp(q_loss) / math.exp(ref_loss)
    return {
        "heldout_text": "eval text" if eval_text is not None else "stdlib held-out split",
        "heldout_tokens": int(targets_size),
        "fp32_loss": ref_loss,
        "quantized_loss": q_loss,
        "fp32_perplexity": math.exp(ref_loss),
        "quantized_perplexity": math.exp(q_loss),
        "perplexity_ratio": ratio,
        "max_abs_logits_diff": max_diff,
        "top1_agreement": top1_agree / targets_size,
        "greedy_prompts": len(PROMPTS),
        "greedy_steps": steps,
        "greedy_identical_prompts": int(np.all(ref_tokens == q_tokens, axis=1).sum()),
        "greedy_prefix_agreement": float(agreement_prefix(ref_tokens, q_tokens).mean()),
    }

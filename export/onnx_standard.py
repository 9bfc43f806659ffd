"""The standard graph: the decoder traced with `torch.onnx.export(..., dynamo=True)`, KV cache as inputs.

This is the portable contract graph (standard ONNX ops only): the one TensorRT and other runtimes can build,
and the reference the in-place serving graph (`export.onnx_inplace`) is checked against.

    inputs   input_ids [batch, seq] int64, attention_mask [batch, total] int64 (total = past + seq),
             position_ids [batch, seq] int64, past_key_values.{i}.key/value [batch, heads, past, head_dim]
    outputs  logits [batch, seq, vocab], present.{i}.key/value [batch, heads, past + seq, head_dim]

where heads are the key/value heads (n_kv_heads; fewer than the query heads in grouped-query attention).

A zero-length past works (prefill): the trace uses past = 2 so the exporter does not specialize the axis to
0 or 1, and ONNX Runtime accepts the empty tensors.

Opset: 23 by default, where SDPA becomes the standard `Attention` op (one node per layer instead of the
MatMul/Softmax/... decomposition: 125 vs 197 nodes on the demo model); it gives the same tokens and was
never slower than 18 in alternated runs. `--opset 18` gives the decomposed form for TensorRT older than
10.14, whose ONNX parser has no `Attention` importer. Export takes tens of seconds even for tiny models
(torch.export plus the onnxscript optimizer), so tests export once per session.
"""

from __future__ import annotations

import warnings

import onnx
import torch
from torch import Tensor, nn
from torch.export import Dim

from export.model import Decoder

DEFAULT_OPSET = 23
MIN_OPSET = 18  # the dynamo exporter's lowest supported opset
TRACE_PAST = 2  # any length >= 2: 0 and 1 would be specialized into the graph


def standard_io_names(n_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    present = [f"present.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


class _FlatKV(nn.Module):
    """The decoder with its per-layer (key, value) pairs flattened into positional inputs and outputs."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, *past: Tensor
    ) -> tuple[Tensor, ...]:
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)]
        logits, presents = self.model(input_ids, attention_mask, position_ids, pairs)
        return (logits, *[t for kv in presents for t in kv])


def _example_inputs(model: Decoder) -> tuple[Tensor, ...]:
    cfg = model.cfg
    batch, seq = 2, 3
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, TRACE_PAST + seq, dtype=torch.int64)
    pos = torch.arange(TRACE_PAST, TRACE_PAST + seq).expand(batch, seq).contiguous()
    kv = [torch.zeros(batch, cfg.kv_heads, TRACE_PAST, cfg.head_dim) for _ in range(2 * cfg.n_layers)]
    return (ids, mask, pos, *kv)


def _dynamic_shapes(n_layers: int) -> dict[str, object]:
    batch, seq, past, total = Dim("batch"), Dim("seq"), Dim("past"), Dim("total")
    return {
        "input_ids": {0: batch, 1: seq},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: seq},
        "past": tuple({0: batch, 2: past} for _ in range(2 * n_layers)),
    }


def export_standard_graph(model: Decoder, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Trace `model` (fp32) into the standard KV-cache graph described in the module docstring."""
    if opset < MIN_OPSET:
        raise ValueError(f"opset {opset} is not supported: the dynamo exporter needs opset >= {MIN_OPSET}")
    model = model.eval().float()
    inputs, outputs = standard_io_names(model.cfg.n_layers)
    with torch.no_grad(), warnings.catch_warnings():
        # The exporter warns per reused Dim name that it "will not be used"; the names do land in the graph.
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used.*")
        program = torch.onnx.export(
            _FlatKV(model).eval(),
            _example_inputs(model),
            dynamic_shapes=_dynamic_shapes(model.cfg.n_layers),
            input_names=inputs,
            output_names=outputs,
            opset_version=opset,
            dynamo=True,
            verbose=False,
        )
    if program is None:  # only None for the legacy exporter, never with dynamo=True
        raise RuntimeError("torch.onnx.export returned no program")
    proto = program.model_proto
    proto.producer_name = "textgen-export"
    return proto

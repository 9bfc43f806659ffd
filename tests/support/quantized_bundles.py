"""Quantized variants of the tiny bundle for tests: its fp32 graphs converted as the exporter converts them
(seconds, no tracing), to be verified and written with `write_verified_bundle`."""

from __future__ import annotations

from pathlib import Path

import onnx
import torch

from export.model import Decoder
from export.pipeline import PRESETS, ExportedGraphs, Precision
from export.quantize import quantize_int8, quantize_nbits
from serve.bundle import load_bundle


def tiny_model() -> Decoder:
    """The weights of the `tiny_bundle` fixture (random preset "tiny", seed 0)."""
    torch.manual_seed(0)
    return Decoder(PRESETS["tiny"]).eval()


def quantized_graphs(fp32: Path, precision: Precision) -> ExportedGraphs:
    """The fp32 bundle's two graphs quantized as `precision` says, as export_bundle converts them."""
    bundle = load_bundle(fp32)
    graphs = []
    for path in (bundle.standard_graph, bundle.inplace_graph):
        assert path is not None
        model = onnx.load(str(path))
        if precision.kind == "int8-dynamic":
            graphs.append(quantize_int8(model))
        else:
            assert precision.bits and precision.block
            graphs.append(quantize_nbits(model, precision.bits, precision.block))
    (standard, s_counts), (inplace, i_counts) = graphs
    return ExportedGraphs(standard, inplace, {"standard": s_counts, "inplace": i_counts})

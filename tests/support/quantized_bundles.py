"""Quantized variants of the tiny bundle for tests: its fp32 graphs converted as the exporter converts them
(seconds, no tracing), to be verified and written with `write_verified_bundle`; and a rotary GQA bundle at
any precision made so."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx
import torch

from export.model import Decoder, DecoderConfig
from export.pipeline import (
    PRESETS,
    ExportedGraphs,
    ExportOptions,
    Precision,
    export_bundle,
    write_verified_bundle,
)
from export.quantize import quantize_int8, quantize_nbits
from serve.bundle import load_bundle


def tiny_model() -> Decoder:
    """The weights of the `tiny_bundle` fixture (random preset "tiny", seed 0)."""
    torch.manual_seed(0)
    return Decoder(PRESETS["tiny"]).eval()


def quantized_graphs(fp32: Path, precision: Precision) -> ExportedGraphs:
    """The fp32 bundle's graphs (two; a LoRA bundle's three) quantized as `precision` says, as export_bundle
    converts them."""
    bundle = load_bundle(fp32)
    base = bundle.manifest.graphs.inplace_base
    paths = {
        "standard": bundle.standard_graph,
        "inplace": bundle.inplace_graph,
        **({} if base is None else {"inplace_base": bundle.checked_graph(base)}),
    }
    graphs, counts = {}, {}
    for role, path in paths.items():
        assert path is not None
        model = onnx.load(str(path))
        if precision.kind == "int8-dynamic":
            graphs[role], counts[role] = quantize_int8(model)
        else:
            assert precision.bits and precision.block
            graphs[role], counts[role] = quantize_nbits(model, precision.bits, precision.block)
    return ExportedGraphs(
        graphs["standard"], graphs["inplace"], counts, inplace_base=graphs.get("inplace_base")
    )


def rotary_gqa_bundle(tiny_bundle: Path, out: Path, precision: Precision) -> Path:
    """A random Llama-shaped bundle (rotary positions, 2 KV heads for 4 query heads, RMSNorm, SwiGLU), the
    shape of the models users import, at `precision`."""
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=320, context_length=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
        positions="rotary", activation="swiglu", norm="rms", qkv_bias=False, out_bias=False, mlp_bias=False,
    )  # fmt: skip
    model = Decoder(config).eval()
    tokenizer = load_bundle(tiny_bundle).tokenizer
    options = ExportOptions(model_name="gqa-fp32", precision=Precision(), progress=False)
    fp32 = out / "fp32"
    if not (fp32 / "manifest.json").exists():  # exported once for every precision made from it
        export_bundle(model, tokenizer, fp32, options)
    if precision.kind == "fp32":
        return fp32
    graphs = quantized_graphs(fp32, precision)
    options = replace(options, model_name=f"gqa-{precision.kind}", precision=precision)
    return write_verified_bundle(model, tokenizer, graphs, out / precision.kind, options).root

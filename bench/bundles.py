"""The models a scenario measures when none is named, under $TEXTGEN_HOME (else ./models, as textgen-export
has it): bench-a, a random-weight GPT-2 shape (vocab 8192, context 1024, d_model 512, 8 layers, 8 heads,
d_ff 2048), exported at a precision on first use, and the demo model's bundle (`make serve` builds it)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.proc import run_logged

if TYPE_CHECKING:
    from export.pipeline import PrecisionKind


def models_home() -> Path:
    # export.demo.textgen_home's rule; importing it would import torch, which most scenarios do without
    return Path(os.environ.get("TEXTGEN_HOME") or "models")


def demo_bundle() -> Path:
    return models_home() / "demo" / "bundle"


def bench_a(kind: PrecisionKind = "fp32", folder: Path | None = None) -> Path:
    """bench-a at `kind` in `folder` (default models/bench/bench-a-KIND), exported unless a bundle of that
    precision is there (an INT8 bundle written before MatMulNBits was dynamic INT8 is replaced, not measured
    under the wrong name)."""
    from export.pipeline import Precision
    from serve.bundle import load_bundle
    from serve.errors import BundleError

    out = folder or models_home() / "bench" / f"bench-a-{kind}"
    want = Precision(kind)
    try:
        m = load_bundle(out).manifest
        if (m.quantization, m.quantization_block_size) == (want.quantization, want.block):
            return out
    except BundleError:
        pass
    command = [sys.executable, "-m", "export", "random", "--preset", "bench-a", "--out", str(out)]
    run_logged(command + ([f"--{kind}"] if kind != "fp32" else []))
    return out

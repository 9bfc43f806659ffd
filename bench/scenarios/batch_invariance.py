"""Which weight formats ONNX Runtime computes the same for a row alone and in a batch: the measurement
behind export.quantize.pad_single_rows and the manifest's `batch_invariant`.

For each format (float32, float16, dynamic INT8, MatMulNBits at 8 and 4 bits over a range of block sizes)
the fp32 bundle's serving graph is converted as `textgen-export` converts it and run by the serving engine: 16
held-out prompts of different lengths prefilled and decoded together (greedy), then each prompt alone.
Reported: the largest |logit difference| between a row's logits alone and in the batch, over the steps
where both had been fed the same tokens (0: exactly invariant), and how many rows' greedy tokens differ:
for the graph as exported, and for the MatMulNBits formats export.quantize pads also without the single-row
pad (ONNX Runtime's one-row kernel on its own, the reason for the pad; which blocks it differs at depends
on the CPU).

    textgen-bench batch-invariance --bundle models/demo/bundle
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from bench.report import table_head, table_row
from export.fp16 import convert_fp16
from export.quantize import heldout_windows, pads_rows, quantize_int8, quantize_nbits
from export.verify import engine_greedy
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, SessionConfig

ROWS = 16
STEPS = 8
FORMATS: tuple[tuple[str, int | None, int | None], ...] = (
    ("float32", None, None),
    ("float16", None, None),
    ("int8 dynamic", 8, None),
    *(("int8 MatMulNBits", 8, b) for b in (16, 32, 64, 128, 256)),
    *(("int4 MatMulNBits", 4, b) for b in (16, 32, 64, 128, 256)),
)


def converted(
    model: onnx.ModelProto, name: str, bits: int | None, block: int | None, pad_rows: bool
) -> onnx.ModelProto:
    if bits is None:
        return convert_fp16(model) if name == "float16" else model
    return quantize_int8(model)[0] if block is None else quantize_nbits(model, bits, block, pad_rows)[0]


def measure_format(
    bundle: Bundle,
    fp32: onnx.ModelProto,
    settings: EngineSettings,
    prompts: list[list[int]],
    fmt: tuple[str, int | None, int | None],
    pad_rows: bool,
) -> str:
    name, bits, block = fmt
    assert bundle.inplace_graph is not None
    with tempfile.TemporaryDirectory() as tmp:
        graph = Path(tmp) / bundle.inplace_graph.name
        onnx.save(converted(fp32, name, bits, block, pad_rows), str(graph))
        manifest = bundle.manifest.model_copy(update={"dtype": "float16" if name == "float16" else "float32"})
        engine = Engine.from_bundle(replace(bundle, root=Path(tmp), manifest=manifest), settings)
        worst, differing = measure(engine, prompts)
    return f"{worst:.1e}, {differing} / {ROWS}"


def measure(engine: Engine, prompts: list[list[int]]) -> tuple[float, int]:
    """(max |logits alone - in the batch| while a row was fed the same tokens, rows whose tokens differ)."""
    together, batch_logits = engine_greedy(engine, prompts, STEPS)
    worst, differing = 0.0, 0
    for row, prompt in enumerate(prompts):
        alone, logits = engine_greedy(engine, [prompt], STEPS)
        same = np.cumprod(alone[0] == together[row])  # fed the same tokens up to and including step t
        steps = [0] + [t for t in range(1, STEPS + 1) if same[t - 1]]
        diffs = [np.abs(logits[t][0].astype(np.float32) - batch_logits[t][row]).max() for t in steps]
        worst = max(worst, float(max(diffs)))
        differing += int(not same[-1])
    return worst, differing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, help="a float32 bundle")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle)
    assert bundle.inplace_graph is not None, "the bundle has no serving graph"
    arch = bundle.manifest.architecture
    windows = heldout_windows(bundle.tokenizer, arch.context_length)
    prompts = [[int(t) for t in windows[i % len(windows)][: 4 + 3 * i]] for i in range(ROWS)]
    fp32 = onnx.load(str(bundle.inplace_graph))
    settings = EngineSettings(
        max_batch_size=ROWS, session=SessionConfig(providers=("cpu",), threads=args.threads)
    )
    print(
        f"{bundle.manifest.model_name}: {ROWS} rows, prefill + {STEPS} decode steps through the engine, "
        f"onnxruntime {ort.__version__}, {args.threads} threads\n"
    )
    header = [
        "weights",
        "block",
        "as exported: max abs logit diff, rows with other tokens",
        "without the pad",
    ]
    print("\n".join(table_head(header)))
    for fmt in FORMATS:
        _, bits, block = fmt
        exported = measure_format(bundle, fp32, settings, prompts, fmt, pad_rows=True)
        padded = bits is not None and block is not None and pads_rows(bits, block)
        raw = measure_format(bundle, fp32, settings, prompts, fmt, pad_rows=False) if padded else "-"
        print(table_row([fmt[0], str(block or "-"), str(exported), str(raw)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Engine speed on the bench-a workload, beside the peer stacks run from their folder (--anchors-dir).

Workload (identical to the anchors'): bench-a shape (GPT-2: vocab 8192, context 1024, d_model 512, 8 layers,
8 heads, d_ff 2048, tied head, random weights), 32 fixed random prompt tokens per row (the anchors' own ids),
exactly 128 new tokens, greedy, batch 1/4/16, 2 threads; one untimed warm-up, 3 timed runs, median.
tok/s = 128 x batch / wall time of the whole generation (prefill included). Each (variant, batch) cell runs in
its own process so its peak RSS is its own (`peak_rss_mb`: VmHWM, the peak since the cell's exec).

    textgen-bench engine                 # textgen fp32, int8, int8-dynamic, int4, and the roofline
    textgen-bench engine --anchors-dir DIR           # and the default peer cells in the same pass
    textgen-bench engine --anchors-dir DIR --anchors "ortgenai B-llama fp32"   # chosen peer cells
    textgen-bench engine --cell BUNDLE --batch 1 [--no-spinning]   # one cell of any bundle, as JSON

A cell's ONNX Runtime threads spin between operators, as GenAI's do by default (and as `textgen-serve`'s
do within a step); `--no-spinning` lets them sleep, as `textgen-serve --no-spinning` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.bundles import bench_a
from bench.proc import CpuMeter, peak_rss_mib
from bench.report import RESULTS, write_json
from bench.servers import ROOT

if TYPE_CHECKING:  # a cell must not import torch (through export): its peak RSS would count it
    from export.pipeline import PrecisionKind

PROMPT_LEN, NEW_TOKENS, SEED, VOCAB = 32, 128, 1234, 8192
BATCHES = (1, 4, 16)
CHECKED_TOKENS = 16  # the greedy tokens of row 0 a cell reports, compared across stacks
PARAMS_BENCH_A = 29.94e6
DEFAULT_ANCHOR_CELLS = (
    "torch A-gpt2",
    "optimum A-gpt2 fp32",
    "optimum A-gpt2 int8-dyn",
    "ortgenai B-llama fp32",
    "ortgenai B-llama int8",
)


def prompt_rows(batch: int) -> np.ndarray:
    """The anchors' prompts (common.prompt_ids): row i is the same for every tool and batch size."""
    rng = np.random.default_rng(SEED)
    return rng.integers(3, VOCAB, size=(max(16, batch), PROMPT_LEN), dtype=np.int64)[:batch]


def run_cell(bundle: Path, batch: int, threads: int, repeats: int, spinning: bool = True) -> dict[str, Any]:
    from serve.bundle import load_bundle
    from serve.engine.engine import Engine
    from serve.engine.sampling import SamplingParams
    from serve.engine.types import EngineSettings, NewSequence, SessionConfig

    settings = EngineSettings(
        max_batch_size=batch,
        capacity=PROMPT_LEN + NEW_TOKENS,
        session=SessionConfig(threads=threads, spinning=spinning),
    )
    t_load = time.perf_counter()
    engine = Engine.from_bundle(load_bundle(bundle), settings)
    load_seconds = time.perf_counter() - t_load
    rows = prompt_rows(batch)

    def once() -> tuple[float, float, list[int]]:
        seqs = [NewSequence(str(i), rows[i].tolist(), SamplingParams()) for i in range(batch)]
        start = time.perf_counter()
        first = [engine.prefill(seqs)[0].token_id]
        ttft = time.perf_counter() - start
        for _ in range(NEW_TOKENS - 1):
            outs = engine.decode()
            if len(first) < CHECKED_TOKENS:  # row 0's, as the peers record theirs
                first.append(next(o.token_id for o in outs if o.seq_id == "0"))
        wall = time.perf_counter() - start
        engine.release(s.seq_id for s in seqs)
        return wall, ttft, first

    once()  # warm-up
    with CpuMeter([os.getpid()]) as meter:
        runs = [once() for _ in range(repeats)]
    return rates(batch, [r[0] for r in runs], [r[1] for r in runs]) | {
        "peak_rss_mb": peak_rss_mib(),
        "load_s": load_seconds,
        "providers": engine.providers,
        "first_row_tokens": runs[-1][2],
        "other_load": meter.other_load,
    }


def rates(batch: int, walls: list[float], ttfts: list[float]) -> dict[str, Any]:
    """A cell's figures from its timed runs: tok/s of the median wall (NEW_TOKENS x batch each), the decode
    rate after the first token, the median TTFT."""
    median, ttft = statistics.median(walls), statistics.median(ttfts)
    return {
        "batch": batch,
        "walls": walls,
        "tok_s": NEW_TOKENS * batch / median,
        "decode_tok_s": (NEW_TOKENS - 1) * batch / (median - ttft),
        "ttft_s": ttft,
    }


def machine_roofline(threads: int) -> dict[str, float]:
    """fp32 GEMM GFLOP/s (numpy's BLAS, 1024^3) and memory read GB/s (sum over 256 MB, on one thread and
    on `threads`), best of 5."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    gemm = []
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        gemm.append(2 * 1024**3 / (time.perf_counter() - t) / 1e9)
    big = np.ones(64 * 2**20, np.float32)
    return {
        "gemm_gflops": max(gemm),
        "read_gbps": read_gbps(big, 1),
        "read_gbps_threads": read_gbps(big, threads),  # as ONNX Runtime reads weights: every thread
    }


def read_gbps(big: np.ndarray, threads: int) -> float:
    """Best of 5 sums of `big`, split over `threads` threads (numpy lets go of the GIL while it sums)."""
    parts = np.array_split(big, threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = max(best, big.nbytes / (time.perf_counter() - t) / 1e9)
    return best


# Variant -> its precision (textgen-export's flag without the dashes; fp32: no flag).
VARIANTS: dict[str, PrecisionKind] = {
    "textgen fp32": "fp32",
    "textgen int8": "int8",
    "textgen int8-dynamic": "int8-dynamic",
    "textgen int4": "int4",
}


def cell_in_subprocess(bundle: Path, batch: int, threads: int, repeats: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.scenarios.engine", "--cell", str(bundle), "--batch", str(batch)]
    cmd += ["--threads", str(threads), "--repeats", str(repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def prepared_anchors() -> Path:
    """The folder where the peer stacks' venv, models and artifacts were prepared (`$ANCHOR_WORK`)."""
    return Path(os.environ.get("ANCHOR_WORK", "/tmp/textgen-anchors"))


def run_anchors(anchors: Path, cells: list[str], pass_no: int, env: dict[str, str] | None = None) -> Path:
    """One pass of the peer stacks' cells (their own venv and models, in the folder `anchors`, whose run.sh
    runs them); `env` adds to or overrides the variables run.sh gets.

    `cells` are the anchors' cell labels without the batch, e.g. "optimum A-gpt2 int8-dyn".
    """
    tools = sorted({cell.split()[0] for cell in cells})
    work = Path((env or {}).get("ANCHOR_WORK", prepared_anchors()))
    # llama.cpp's compile is the long part of the peers' setup: skipped unless a llama.cpp cell is asked for
    skip_llama = "0" if "llamacpp" in tools else "1"
    env = {**os.environ, "ANCHOR_WORK": str(work), "ANCHOR_SKIP_LLAMA": skip_llama, **(env or {})}
    cmd = [
        "bash",
        str(anchors / "run.sh"),
        "--tools",
        ",".join(tools),
        "--pass",
        str(pass_no),
        "--skip-prepare",
    ]
    for cell in cells:
        cmd += ["--only", cell + " "]
    subprocess.run(cmd, check=True, env=env)
    return Path(env.get("ANCHOR_RESULTS", work / "results")) / f"pass{pass_no}"


def anchor_rows(result_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(result_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("status") == "ok":
            rows.append(data)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument(
        "--no-spinning", action="store_true", help="a cell's ONNX Runtime threads sleep (serve --no-spinning)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bundles", type=Path, default=ROOT / "models" / "bench")
    p.add_argument(
        "--anchors",
        default=",".join(DEFAULT_ANCHOR_CELLS),
        help="the peer cells to run in the same pass, with --anchors-dir (comma-separated; empty: none)",
    )
    p.add_argument(
        "--anchors-dir",
        type=Path,
        default=None,
        help="the peer stacks' folder (its run.sh runs a cell); without it, textgen's cells alone",
    )
    p.add_argument("--output", type=Path, default=RESULTS / "engine.json")
    args = p.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(args.cell, args.batch, args.threads, args.repeats, not args.no_spinning)))
        return 0

    variants = {name: bench_a(kind, args.bundles / f"bench-a-{kind}") for name, kind in VARIANTS.items()}
    record: dict[str, Any] = {"machine": machine_roofline(args.threads), "cells": {}}
    cells: dict[str, dict[str, Any]] = record["cells"]
    for name, bundle in variants.items():
        for batch in BATCHES:
            cell = cell_in_subprocess(bundle, batch, args.threads, args.repeats)
            cells[f"{name} b{batch}"] = cell
            print(
                f"{name:20s} b{batch:<3d} {cell['tok_s']:8.0f} tok/s  ttft {1000 * cell['ttft_s']:.1f} ms  "
                f"peak {cell['peak_rss_mb']:.0f} MB",
                flush=True,
            )
    if args.anchors and args.anchors_dir is not None:
        record["anchors"] = anchor_rows(run_anchors(args.anchors_dir, args.anchors.split(","), 1))
        for row in record["anchors"]:
            ttft = 1000 * (row.get("ttft_s_median") or float("nan"))
            print(
                f"{row['tool']} {row['variant']} {row['model']} b{row['batch']}: "
                f"{row['tok_per_s']:.0f} tok/s  "
                f"ttft {ttft:.1f} ms  peak {row['peak_rss_mb']:.0f} MB"
            )
    machine = record["machine"]
    for cell in cells.values():
        flops = cell["tok_s"] * 2 * PARAMS_BENCH_A / 1e9
        cell["gemm_fraction"] = flops / machine["gemm_gflops"]
    write_json(args.output, record)
    print(f"machine: {machine}; wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

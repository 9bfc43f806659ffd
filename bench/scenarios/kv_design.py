"""Why the engine serves the in-place graph: the two KV-cache designs side by side on one bundle.

A: the standard (traced) graph, left-padded batch, the graph concatenates past and new K/V every step
   (TGI's padded causal LM; export.generation.greedy drives it).
B: the serving graph, GroupQueryAttention writing into preallocated slots in place (serve.engine.engine).
Same bundle, same prompts (32 tokens), greedy, 2 threads; tok/s of the whole generation, median of 3.

    textgen-bench kv-design --bundle models/bench/bench-a-fp32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.scenarios.engine import PROMPT_LEN, prompt_rows
from export.generation import Shape, greedy, session_step
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.runtime import create_session
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig


def median_tok_s(run: Callable[[], None], tokens: int, repeats: int) -> float:
    run()  # warm-up
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        walls.append(time.perf_counter() - start)
    return tokens / statistics.median(walls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cases", default="1:128,16:128,16:512", help="batch:new_tokens pairs")
    args = p.parse_args(argv)

    bundle = load_bundle(args.bundle)
    arch = bundle.manifest.architecture
    shape = Shape(arch.n_layers, arch.n_heads, arch.head_dim)
    session = SessionConfig(threads=args.threads)
    standard = session_step(create_session(bundle.standard_graph, session))
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    capacity = PROMPT_LEN + max(n for _, n in cases)
    engine = Engine.from_bundle(bundle, EngineSettings(max_batch_size=16, capacity=capacity, session=session))
    print(f"{'case':>12} {'A concat tok/s':>15} {'B in-place tok/s':>17} {'B/A':>6}")
    for batch, new in cases:
        rows = prompt_rows(batch)
        prompts = [r.tolist() for r in rows]

        def run_a(prompts: list[list[int]] = prompts, new: int = new) -> None:
            greedy(standard, prompts, bundle.manifest.pad_token_id, shape, steps=new - 1)

        def run_b(prompts: list[list[int]] = prompts, new: int = new) -> None:
            seqs = [NewSequence(str(i), pr, SamplingParams()) for i, pr in enumerate(prompts)]
            engine.prefill(seqs)
            for _ in range(new - 1):
                engine.decode()
            engine.release(s.seq_id for s in seqs)

        a = median_tok_s(run_a, batch * new, args.repeats)
        b = median_tok_s(run_b, batch * new, args.repeats)
        print(f"{f'b{batch}/{new}':>12} {a:15.0f} {b:17.0f} {b / a:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

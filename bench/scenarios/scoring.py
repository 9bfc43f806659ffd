"""What prompt logprobs cost: scoring a prompt beside prefilling it, on one engine, alternated.

`Engine.score_prompt` runs the bundle's standard graph over the prompt (every position's logits) while
a prefill runs the serving graph (the head on the last position only), so a request that asks for prompt
logprobs pays about one more prefill, plus the head over every position. Prints the median of each for
prompts of a few lengths and their ratio (scoring ÷ prefill); the first scoring call (the session's
creation) is timed apart.
Run: `.venv/bin/textgen-bench scoring [--bundle models/bench/bench-a-fp32] [--lengths 32 128 512]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from bench.bundles import bench_a
from bench.report import table_head, table_row
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, NewSequence, SessionConfig
from serve.scheduling.offline import GREEDY


def prefill_seconds(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.prefill([NewSequence("p", prompt, GREEDY)])
    seconds = time.perf_counter() - start
    engine.release(["p"])
    return seconds


def scoring_seconds(engine: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.score_prompt(prompt)
    return time.perf_counter() - start


def measure(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    """Prefill and scoring seconds (medians) by prompt length; the table printed as it goes."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="default: bench-a fp32, exported on first use")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    args.bundle = args.bundle or bench_a()
    settings = EngineSettings(max_batch_size=1, session=SessionConfig(threads=args.threads))
    engine = Engine.from_bundle(load_bundle(args.bundle), settings)
    rng = np.random.default_rng(0)
    first = scoring_seconds(engine, rng.integers(3, engine.vocab_size, 8).tolist())
    print(f"bundle {args.bundle}, {args.threads} threads; first call (makes the session): {first:.2f} s")
    print("\n".join(table_head(["prompt tokens", "prefill ms", "prompt logprobs ms", "scoring ÷ prefill"])))
    results: dict[int, dict[str, float]] = {}
    for length in args.lengths:
        prompt = rng.integers(3, engine.vocab_size, length).tolist()
        prefill_seconds(engine, prompt)  # warm-up of this shape
        scoring_seconds(engine, prompt)
        prefill, scoring = [], []
        for _ in range(args.repeats):  # alternated: the machine's noise falls on both
            prefill.append(prefill_seconds(engine, prompt))
            scoring.append(scoring_seconds(engine, prompt))
        p, s = statistics.median(prefill), statistics.median(scoring)
        results[length] = {"prefill_s": p, "scoring_s": s}
        print(table_row([str(length), f"{1e3 * p:.1f}", f"{1e3 * s:.1f}", f"{s / p:.2f}"]))
    return results


def main(argv: list[str] | None = None) -> int:
    measure(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

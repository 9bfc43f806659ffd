"""Micro-benchmark of `SamplingBatch.sample`: per-step cost for a batch of 16 rows over a vocabulary of 8192.

Not a test: prints the best of several repeats for greedy decoding and for top-p sampling, on
model-like (peaked) logits and on flat logits (the worst case for top-p, whose nucleus is then wide).
Run: `.venv/bin/textgen-bench sampling [--rows 16] [--vocab 8192] [--steps 200]`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from serve.engine.sampling import SamplingBatch, SamplingParams

CASES = {
    "greedy": SamplingParams(),
    "top-p 0.9, T 0.8": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50, T 0.8": SamplingParams(temperature=0.8, top_k=50),
    "greedy + rep. penalty 1.2": SamplingParams(repetition_penalty=1.2),
    "min-p 0.05, T 0.8": SamplingParams(temperature=0.8, min_p=0.05),
    "greedy + frequency 0.5, presence 0.5": SamplingParams(frequency_penalty=0.5, presence_penalty=0.5),
}


def logits_like(kind: str, rows: int, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Peaked: a few dozen likely tokens over a low floor, as a trained model gives; flat: unit normal."""
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    if kind == "peaked":
        logits *= 2.0
        logits[:, :64] += 8.0
    return logits


# Greedy rows that ask for their logprob, and for that many most likely tokens too (0: the logprob only).
REPORTED = {"greedy + logprobs": 0, "greedy + top-20 logprobs": 20}


def per_step_ms(
    params: SamplingParams, logits: np.ndarray, steps: int, repeats: int, top_logprobs: int | None = None
) -> tuple[float, float]:
    """Best wall-clock and best thread-CPU milliseconds per step over `repeats` runs of `steps` steps; with
    `top_logprobs` (not None) every row reports its logprob and that many alternatives.

    CPU time is printed too because on a shared machine the wall clock also counts time spent waiting for a
    core; the CPU figure is what a step costs when it has one.
    """
    reported = top_logprobs is not None
    batch = SamplingBatch()
    for _ in range(logits.shape[0]):
        batch.append(params, list(range(32)), logprobs=reported, top_logprobs=top_logprobs or 0)
    batch.sample(logits)  # warm-up: scratch buffers, first-step growth of the penalty masks
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            batch.sample(logits)
        wall.append((time.perf_counter() - wall_start) / steps * 1e3)
        cpu.append((time.thread_time() - cpu_start) / steps * 1e3)
    return min(wall), min(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(
        f"SamplingBatch.sample, n={args.rows}, vocab={args.vocab}: "
        f"best of {args.repeats} x {args.steps} steps"
    )
    print(f"  {'logits':6} {'params':36} {'wall ms':>8} {'cpu ms':>8}")
    for kind in ("peaked", "flat"):
        logits = logits_like(kind, args.rows, args.vocab, rng)
        for name, params in CASES.items():
            wall, cpu = per_step_ms(params, logits, args.steps, args.repeats)
            print(f"  {kind:6} {name:36} {wall:8.3f} {cpu:8.3f}")
        for name, top in REPORTED.items():
            wall, cpu = per_step_ms(SamplingParams(), logits, args.steps, args.repeats, top_logprobs=top)
            print(f"  {kind:6} {name:36} {wall:8.3f} {cpu:8.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

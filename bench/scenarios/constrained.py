"""What structured output costs: offline tok/s of constrained ÷ unconstrained generation, and the masks' cost.

Workload: `--rows` (16) rows of `--prompt-tokens` (32) fixed random prompt ids, exactly `--new-tokens` (128)
new tokens, greedy. Unconstrained rows ignore EOS; constrained rows follow a JSON schema that cannot finish
within the budget (an array of at least 1000 non-empty strings), so both produce rows x new tokens and every
constrained step computes, applies and consumes a mask for every row. One untimed warm-up of each, then
`--rounds` rounds that alternate which one runs first; tok/s = rows x new tokens / wall time of the whole
generation (prefill included), median over rounds. The ratio is the median of each round's ratio; the
CPU-time ratio is the same with this process's CPU seconds instead of wall time (steadier on a shared
machine).

Mask costs, from the engine's counters over the constrained rounds: `fill` is the time llguidance's parallel
fill took on the masks' thread, per row-token (it runs beside ONNX Runtime's step); `exposed` is how long
the engine thread then still waited for it, per step (the part of the fill the step's run did not hide);
`consume` is advancing the matchers by the sampled tokens, per row-token.

    textgen-bench constrained                    # the demo model and bench-a, under $TEXTGEN_HOME
    textgen-bench constrained --bundle models/bench/bench-a-fp32 --rounds 5 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bundles import bench_a, demo_bundle
from bench.report import write_json
from bench.rounds import in_turn, median_ratio
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.types import Constraint, EngineSettings, SessionConfig
from serve.scheduling.offline import generate

SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "minItems": 1000}
SEED = 1234


def prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(SEED)
    return rng.integers(3, vocab, size=(rows, length)).tolist()


def _run(engine: Engine, rows: list[list[int]], new_tokens: int, constrained: bool) -> tuple[float, float]:
    """Wall and CPU seconds (this process's, every thread's) of one whole generation."""
    constraint = Constraint.json_schema(SCHEMA) if constrained else None
    start, cpu = time.perf_counter(), time.process_time()
    outs = generate(engine, rows, max_new_tokens=new_tokens, ignore_eos=True, constraint=constraint)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    for out in outs:
        assert len(out.token_ids) == new_tokens and out.finish_reason == "length", out.finish_reason
        assert out.finish is not None and out.finish.constraint_incomplete == constrained
    if constrained:
        assert outs[0].text.startswith('["'), outs[0].text[:40]
    return seconds, cpu


def bench(
    bundle_dir: Path, rows: int, prompt_tokens: int, new_tokens: int, rounds: int, threads: int
) -> dict[str, Any]:
    bundle = load_bundle(bundle_dir)
    settings = EngineSettings(
        max_batch_size=rows,
        capacity=prompt_tokens + new_tokens,
        session=SessionConfig(threads=threads, spinning=False),
    )
    engine = Engine.from_bundle(bundle, settings)
    batch = prompts(rows, prompt_tokens, engine.vocab_size)
    for constrained in (False, True):  # warm-up; the constraint is compiled here, then served from the cache
        _run(engine, batch, new_tokens, constrained)
    stats = engine.mask_stats
    before = stats.as_dict()
    seconds: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for constrained in in_turn((False, True), round_):
            wall, used = _run(engine, batch, new_tokens, constrained)
            seconds[constrained].append(wall)
            cpu[constrained].append(used)
    after = stats.as_dict()
    delta = {key: after[key] - before[key] for key in after}
    tokens = rows * new_tokens
    plain = [tokens / s for s in seconds[False]]
    masked = [tokens / s for s in seconds[True]]
    return {
        "bundle": str(bundle_dir),
        "model": bundle.manifest.model_name,
        "vocab": engine.vocab_size,
        "rows": rows,
        "new_tokens": new_tokens,
        "threads": threads,
        "rounds": rounds,
        "plain_tok_s": statistics.median(plain),
        "constrained_tok_s": statistics.median(masked),
        "ratio": median_ratio(masked, plain),
        "ratios": [round(m / p, 3) for m, p in zip(masked, plain, strict=True)],
        # CPU seconds per token, unconstrained / constrained: what the masks cost in work, whatever else
        # the machine runs (on 2 cores the fill takes CPU the step's run would have used anyway)
        "cpu_ratio": median_ratio(cpu[False], cpu[True]),
        "fill_us_per_row_token": 1e6 * delta["fill_seconds"] / max(delta["rows"], 1),
        "exposed_us_per_step": 1e6 * delta["wait_seconds"] / max(delta["fills"], 1),
        "consume_us_per_row_token": 1e6 * delta["consume_seconds"] / max(delta["rows"], 1),
        "step_ms_plain": 1e3 * statistics.median(seconds[False]) / new_tokens,
        "step_ms_constrained": 1e3 * statistics.median(seconds[True]) / new_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, action="append", help="bundle(s); default: demo and bench-a")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    bundles = args.bundle or [demo_bundle(), bench_a()]
    results: list[dict[str, Any]] = []
    for bundle in bundles:
        result = bench(bundle, args.rows, args.prompt_tokens, args.new_tokens, args.rounds, args.threads)
        results.append(result)
        print(
            f"{result['model']} (vocab {result['vocab']}), {args.rows} rows x {args.new_tokens} tokens, "
            f"{args.threads} threads: plain {result['plain_tok_s']:.0f} tok/s, "
            f"constrained {result['constrained_tok_s']:.0f} tok/s, ratio {result['ratio']:.3f} "
            f"(rounds {result['ratios']}), CPU-time ratio {result['cpu_ratio']:.3f}; "
            f"step {result['step_ms_plain']:.2f} -> "
            f"{result['step_ms_constrained']:.2f} ms; mask fill {result['fill_us_per_row_token']:.1f} us "
            f"per row-token beside the run, exposed {result['exposed_us_per_step']:.1f} us per step, "
            f"consume {result['consume_us_per_row_token']:.1f} us per row-token",
            flush=True,
        )
    if args.json is not None:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

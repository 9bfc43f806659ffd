"""`--kv-cache-dtype fp16` against the float32 cache on one float32 bundle: KV memory, decode step speed and
accuracy, both engines in one process.

Memory: the KV bytes of `--rows` rows of `--capacity` positions each way (the engine's own count).
Speed: for each case (rows, context) both engines are filled to `context` positions (one prompt of the
standard library's source, the other rows forks of it: the same cache contents for one prompt's compute),
then `--rounds` rounds time `--steps` decode steps of each engine in turn (alternating which goes first), so
both see the same load on a shared machine; ms a step, fastest and median round, and fp16 / fp32.
Accuracy: `--prompts` prompts of 32 tokens of the standard library's source, run as one batch, `--tokens`
greedy tokens each way: tokens the two caches agree on position by position, prompts whose tokens all agree,
and the largest logit difference over the steps both ran on the same tokens (up to and at the first token
they part at), also as a fraction of the largest logit.

    textgen-bench kv-dtype --bundle BUNDLE [--cases 1:128,16:128,1:1920,16:1920] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import stdlib_texts
from bench.report import write_json
from bench.rounds import in_turn
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, KvCacheDtype, NewSequence, SessionConfig

DTYPES: tuple[KvCacheDtype, ...] = ("fp32", "fp16")
GREEDY = SamplingParams()


def source_tokens(engine: Engine, count: int) -> list[int]:
    """`count` tokens of the standard library's source (texts joined until there are enough)."""
    tokens: list[int] = []
    for text in stdlib_texts():
        tokens += engine.tokenizer.encode(text).ids
        if len(tokens) >= count:
            return tokens[:count]
    raise RuntimeError(f"the standard library's sources give fewer than {count} tokens")


def fill(engine: Engine, prompt: list[int], rows: int) -> None:
    """`rows` rows holding `prompt`: the first one prefilled, the others forks of it."""
    first = NewSequence("0", prompt, GREEDY)
    engine.prefill([first, *(NewSequence(str(i), prompt, GREEDY, fork_of="0") for i in range(1, rows))])


def step_ms(engine: Engine, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.decode()
    return (time.perf_counter() - start) * 1e3 / steps


def speed(engines: dict[str, Engine], rows: int, context: int, rounds: int, steps: int) -> dict[str, Any]:
    prompt = source_tokens(engines["fp32"], context)
    for engine in engines.values():
        fill(engine, prompt, rows)
        engine.decode()  # a first step at this shape, untimed
    times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for round_no in range(rounds):
        for dtype in in_turn(DTYPES, round_no):
            times[dtype].append(step_ms(engines[dtype], steps))
    for engine in engines.values():
        engine.release(engine.running_ids)
    fastest = {dtype: min(t) for dtype, t in times.items()}
    median = {dtype: statistics.median(t) for dtype, t in times.items()}
    return {
        "rows": rows,
        "context": context,
        "step_ms": times,
        "fastest_ms": fastest,
        "median_ms": median,
        "fp16_over_fp32_fastest": fastest["fp16"] / fastest["fp32"],
        "fp16_over_fp32_median": median["fp16"] / median["fp32"],
    }


def greedy_batch(engine: Engine, prompts: list[list[int]], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt's greedy tokens [prompts, tokens] and the logits each was picked from."""
    outs = [engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(prompts)])]
    logits = [engine.last_logits.copy()]
    while len(outs) < tokens:
        outs.append(engine.decode())
        logits.append(engine.last_logits.copy())
    engine.release(engine.running_ids)
    ids = np.array([[out.token_id for out in step] for step in outs]).T
    return ids, np.stack(logits, axis=1)


def accuracy(engines: dict[str, Engine], prompts: int, tokens: int) -> dict[str, Any]:
    source = source_tokens(engines["fp32"], 32 * prompts)
    batch = [source[i : i + 32] for i in range(0, 32 * prompts, 32)]
    (want, want_logits), (got, got_logits) = (greedy_batch(engines[d], batch, tokens) for d in DTYPES)
    differ = want != got
    parts = [int(np.argmax(row)) if row.any() else tokens for row in differ]
    shared = max(
        float(np.abs(got_logits[i, : part + 1] - want_logits[i, : part + 1]).max())
        for i, part in enumerate(parts)
    )
    return {
        "prompts": prompts,
        "tokens": tokens,
        "agreed_tokens": int((~differ).sum()),
        "agreed_fraction": float((~differ).mean()),
        "prompts_all_agreed": sum(part == tokens for part in parts),
        "first_parts": parts,
        "max_logit_diff": shared,
        "max_logit_diff_relative": shared / float(np.abs(want_logits).max()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, help="a float32 bundle")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=16, help="KV rows of each engine")
    p.add_argument("--capacity", type=int, default=2048, help="positions of each KV row")
    p.add_argument("--cases", default="1:128,16:128,1:1920,16:1920", help="rows:context pairs")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--output", type=Path, help="write the figures here as JSON")
    args = p.parse_args(argv)

    bundle = load_bundle(args.bundle)
    # The server's defaults: spinning within a step, not between steps (two engines share the cores here).
    session = SessionConfig(threads=args.threads, spin_between_runs=False)
    settings = EngineSettings(max_batch_size=args.rows, capacity=args.capacity, session=session)
    engines: dict[str, Engine] = {
        dtype: Engine.from_bundle(bundle, replace(settings, kv_cache_dtype=dtype)) for dtype in DTYPES
    }
    for engine in engines.values():
        engine.warm_up()
    result: dict[str, Any] = {
        "bundle": str(args.bundle),
        "kv_bytes": {dtype: engine.kv_bytes for dtype, engine in engines.items()},
        "kv_rows": args.rows,
        "kv_capacity": args.capacity,
    }
    mib = {dtype: b / 2**20 for dtype, b in result["kv_bytes"].items()}
    print(
        f"KV cache, {args.rows} rows x {args.capacity}: "
        f"fp32 {mib['fp32']:.0f} MiB, fp16 {mib['fp16']:.0f} MiB"
    )
    result["accuracy"] = accuracy(engines, args.prompts, args.tokens)
    print("accuracy:", json.dumps({k: v for k, v in result["accuracy"].items() if k != "first_parts"}))
    result["speed"] = []
    print(f"{'rows':>5} {'context':>8} {'fp32 ms':>16} {'fp16 ms':>16} {'fp16/fp32':>16}  (fastest / median)")
    for case in args.cases.split(","):
        rows, context = (int(x) for x in case.split(":"))
        cell = speed(engines, rows, context, args.rounds, args.steps)
        result["speed"].append(cell)
        f, m = cell["fastest_ms"], cell["median_ms"]
        print(
            f"{rows:>5} {context:>8} {f['fp32']:>7.1f} / {m['fp32']:>6.1f} "
            f"{f['fp16']:>7.1f} / {m['fp16']:>6.1f} "
            f"{cell['fp16_over_fp32_fastest']:>7.2f} / {cell['fp16_over_fp32_median']:>6.2f}",
            flush=True,
        )
    if args.output is not None:
        write_json(args.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prefix cache: what reusing a kept prefix saves, and what keeping rows costs when nothing is reused.

Two engines on one bundle in one process, one with `--rows` prefix-cache rows and one without, alternated
round by round (this machine is shared and noisy: compare the two within a round, not across runs):

- **chat follow-up**: a conversation's next turn, prompt = the previous prompt (`--history` tokens) + its
  answer (64 tokens) + a new message (32 tokens); time to first token of the next turn.
- **shared system prompt**: 16 requests at once, each a `--system`-token system prompt + its own 32-token
  question, 16 new tokens each, after one earlier request with the same system prompt, and cold (the burst
  is the first to send it); time to first token (median over the 16) and wall time of the burst.
- **no reuse**: the engine issue's bench-a workload (16 random 32-token prompts, 128 new tokens each, all at
  once): tokens/s. The cache only costs here: each leaving row is copied into a kept row.
- **release**: what that copy costs, directly: `Engine.release` of each of 16 rows holding 32 + 128 tokens
  (median ms; the engine without a cache still moves the last row into the freed one).
- **lookup**: what admission pays to learn that a waiting prompt shares nothing with 16 running rows and the
  kept ones (`Engine.cached_tokens`, µs a call).

Every prompt is fresh random token ids (a round never finds the previous round's answers kept). Greedy;
both engines must produce the same tokens (checked). Everything runs through the offline API (the
scheduler's admission and steps). Results print as a table and go to `--json`.
Run: `.venv/bin/textgen-bench prefix [--bundle models/bench/bench-a-fp32] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.bundles import bench_a
from bench.report import RESULTS, table_head, table_row, write_json
from bench.rounds import in_turn
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, NewSequence, SessionConfig
from serve.scheduling.offline import GREEDY, generate
from serve.scheduling.request import Completion

ANSWER, MESSAGE, QUESTION, BURST = 64, 32, 32, 16

# A measurement: (its figures by name, the tokens of every completion, to check both engines agree).
Measure = Callable[[Engine, np.random.Generator], tuple[dict[str, float], list[list[int]]]]


def ttft(completion: Completion) -> float:
    assert completion.finish is not None
    return completion.finish.ttft_seconds


def cached(completion: Completion) -> int:
    assert completion.finish is not None
    return completion.finish.cached_prompt_tokens


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def chat_follow_up(history: int) -> Measure:
    def measure(engine: Engine, rng: np.random.Generator) -> tuple[dict[str, float], list[list[int]]]:
        prompt = random_ids(rng, history, engine.vocab_size)
        (first,) = generate(engine, [prompt], max_new_tokens=ANSWER, ignore_eos=True)
        follow_up = [*prompt, *first.token_ids, *random_ids(rng, MESSAGE, engine.vocab_size)]
        (second,) = generate(engine, [follow_up], max_new_tokens=4, ignore_eos=True)
        figures = {"TTFT s": ttft(second), "cached prompt tokens": cached(second)}
        return figures, [first.token_ids, second.token_ids]

    return measure


def shared_system_prompt(system_len: int, warm: bool) -> Measure:
    """`warm`: one request with the same system prompt ran before the burst (its row is kept); cold: the
    burst's first request is the first to see it (the others can start from its row while it runs)."""

    def measure(engine: Engine, rng: np.random.Generator) -> tuple[dict[str, float], list[list[int]]]:
        vocab = engine.vocab_size
        system = random_ids(rng, system_len, vocab)
        if warm:
            before = [*system, *random_ids(rng, QUESTION, vocab)]
            generate(engine, [before], max_new_tokens=4, ignore_eos=True)
        prompts = [[*system, *random_ids(rng, QUESTION, vocab)] for _ in range(BURST)]
        start = time.perf_counter()
        done = generate(engine, prompts, max_new_tokens=16, ignore_eos=True)
        wall = time.perf_counter() - start
        figures = {
            "median TTFT s": statistics.median(ttft(c) for c in done),
            "wall s": wall,
            "cached prompt tokens": sum(cached(c) for c in done),
        }
        return figures, [c.token_ids for c in done]

    return measure


def no_reuse(engine: Engine, rng: np.random.Generator) -> tuple[dict[str, float], list[list[int]]]:
    prompts = [random_ids(rng, 32, engine.vocab_size) for _ in range(BURST)]
    start = time.perf_counter()
    done = generate(engine, prompts, max_new_tokens=128, ignore_eos=True)
    seconds = time.perf_counter() - start
    return {"tok/s": BURST * 128 / seconds}, [c.token_ids for c in done]


def running_burst(engine: Engine, rng: np.random.Generator) -> tuple[list[NewSequence], list[list[int]]]:
    """BURST sequences of 32 random prompt tokens decoded to 160 tokens (less on a short context)."""
    seqs = [NewSequence(str(i), random_ids(rng, 32, engine.vocab_size), GREEDY) for i in range(BURST)]
    tokens = [[t.token_id] for t in engine.prefill(seqs)]
    for _ in range(min(127, engine.capacity - 33)):
        for t in engine.decode():
            tokens[int(t.seq_id)].append(t.token_id)
    return seqs, tokens


def release_cost(engine: Engine, rng: np.random.Generator) -> tuple[dict[str, float], list[list[int]]]:
    seqs, tokens = running_burst(engine, rng)
    seconds = []
    for seq in seqs:
        start = time.perf_counter()
        engine.release([seq.seq_id])
        seconds.append(time.perf_counter() - start)
    return {"median ms": 1e3 * statistics.median(seconds)}, tokens


def miss_lookup_cost(engine: Engine, rng: np.random.Generator) -> tuple[dict[str, float], list[list[int]]]:
    """`cached_tokens` of a prompt that shares nothing, beside BURST running rows (and the rows a previous
    release kept): what admission pays for every waiting prompt it considers."""
    seqs, tokens = running_burst(engine, rng)
    prompt, calls = random_ids(rng, 32, engine.vocab_size), 1000
    start = time.perf_counter()
    for _ in range(calls):
        assert engine.cached_tokens(prompt) == 0
    seconds = time.perf_counter() - start
    engine.release([seq.seq_id for seq in seqs])
    return {"µs": 1e6 * seconds / calls}, tokens


def compare(
    engines: dict[str, Engine], measure: Measure, rounds: int, seed: int
) -> dict[str, dict[str, list[float]]]:
    """Each round runs both engines on the same fresh prompts, in alternating order.
    Returns figure name -> engine name -> one value a round."""
    figures: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        tokens: dict[str, list[list[int]]] = {}
        for name in in_turn(list(engines), r):
            values, tokens[name] = measure(engines[name], np.random.default_rng(seed + r))
            for figure, value in values.items():
                figures.setdefault(figure, {e: [] for e in engines})[name].append(value)
        first, *others = tokens.values()
        assert all(t == first for t in others), f"round {r}: the engines disagree"
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path, help="default: bench-a fp32, exported on first use")
    parser.add_argument("--rows", type=int, default=4, help="prefix cache rows of the engine that has one")
    parser.add_argument("--history", type=int, default=512, help="chat: tokens of the previous prompt")
    parser.add_argument("--system", type=int, default=256, help="tokens of the shared system prompt")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "prefix.json")
    args = parser.parse_args(argv)
    args.bundle = args.bundle or bench_a()
    # Each engine goes first in half the rounds: with an odd count, one of them is first once more, and an
    # order effect (demo model: the first run of a round up to 15% slower) lands in its median.
    args.rounds += args.rounds % 2
    bundle = load_bundle(args.bundle)
    session = SessionConfig(threads=args.threads)
    engines = {
        f"{rows} rows": Engine.from_bundle(bundle, EngineSettings(session=session, prefix_cache_rows=rows))
        for rows in (args.rows, 0)
    }
    cases: dict[str, Measure] = {
        f"chat follow-up ({args.history}+{ANSWER}+{MESSAGE} tokens)": chat_follow_up(args.history),
        f"{BURST} x ({args.system} system + {QUESTION}), 16 new tokens, after one": shared_system_prompt(
            args.system, warm=True
        ),
        f"{BURST} x ({args.system} system + {QUESTION}), 16 new tokens, cold": shared_system_prompt(
            args.system, warm=False
        ),
        f"no reuse: {BURST} x 32 prompt, 128 new tokens": no_reuse,
        f"release of one of {BURST} rows holding 32 + 128 tokens": release_cost,
        f"a prompt that shares nothing, looked up beside {BURST} running rows": miss_lookup_cost,
    }
    generate(engines[f"{args.rows} rows"], [[5] * 8], max_new_tokens=4)  # warm-up, both engines
    generate(engines["0 rows"], [[5] * 8], max_new_tokens=4)
    results: dict[str, object] = {}
    print(f"bundle {args.bundle}, {args.threads} threads, {args.rounds} alternated rounds, medians")
    print("\n".join(table_head(["case", "figure", f"{args.rows} rows", "0 rows", "with ÷ without"])))
    for seed, (case, measure) in enumerate(cases.items()):
        results[case] = figures = compare(engines, measure, args.rounds, seed * 1000)
        for figure, by_engine in figures.items():
            with_cache, without = (statistics.median(v) for v in by_engine.values())
            ratio = f"{with_cache / without:.3f}" if without else "-"
            print(table_row([case, figure, f"{with_cache:.4g}", f"{without:.4g}", ratio]))
    summary = {"bundle": str(args.bundle), "rows": args.rows, "rounds": args.rounds, "cases": results}
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

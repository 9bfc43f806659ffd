"""Prefill between decode steps against beside them, on the engine alone (no server), alternated by round.

    .venv/bin/textgen-bench beside --bundle models/bench/bench-a-fp32 --threads 2 --steps 120

`--rows` sequences decode; every `--every` steps the oldest leaves and a `--prompt`-token prompt arrives,
which is prefilled either between two decode steps (`Engine.prefill`) or beside them (`Engine.begin_prefill`,
joined by `end_prefill` at the first step after its run is over). Prints tokens/s and the gaps between a
sequence's consecutive tokens (p50, p99 and their ratio: what inter-token latency sees), each way, each round.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from serve.bundle import load_bundle
from serve.engine.engine import Engine, open_engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig, TokenOut


class _Run:
    def __init__(self, engine: Engine, rng: np.random.Generator, prompt: int) -> None:
        self.engine = engine
        self.rng = rng
        self.prompt = prompt
        self.count = 0
        self.last: dict[str, float] = {}  # when each sequence's latest token came
        self.gaps: list[float] = []
        self.tokens = 0

    def new(self) -> NewSequence:
        self.count += 1
        ids = self.rng.integers(10, self.engine.vocab_size, self.prompt).tolist()
        return NewSequence(f"s{self.count}", ids, SamplingParams())

    def take(self, outs: list[TokenOut]) -> None:
        now = time.perf_counter()
        for out in outs:
            if out.seq_id in self.last:
                self.gaps.append(now - self.last[out.seq_id])
            self.last[out.seq_id] = now
        self.tokens += len(outs)

    def leave(self, seq_id: str) -> None:
        self.engine.release([seq_id])
        self.last.pop(seq_id, None)


def run(engine: Engine, beside: bool, args: argparse.Namespace, seed: int) -> tuple[float, float, float]:
    """tokens/s, gap p50 and p99 (ms) of one run."""
    state = _Run(engine, np.random.default_rng(seed), args.prompt)
    engine.prefill([state.new() for _ in range(args.rows)])
    start = time.perf_counter()
    for step in range(args.steps):
        if step % args.every == args.every - 1:
            state.leave(min(engine.running_ids, key=lambda s: int(s[1:])))
            if beside:
                if engine.background_ids:  # one group at a time, as the scheduler runs them: wait for it
                    state.take(engine.end_prefill()[0])
                engine.begin_prefill([state.new()])
            else:
                state.take(engine.prefill([state.new()]))
        state.take(engine.decode())
        if engine.background_done:
            state.take(engine.end_prefill()[0])
        for seq_id, length in engine.lengths().items():  # a sequence about to fill its slot leaves early
            if length >= engine.capacity - 2:
                state.leave(seq_id)
    wall = time.perf_counter() - start
    if engine.background_ids:
        engine.end_prefill()
    engine.release(engine.running_ids)
    gaps = np.array(state.gaps) * 1e3
    return state.tokens / wall, float(np.median(gaps)), float(np.percentile(gaps, 99))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True, help="model bundle")
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    p.add_argument("--rows", type=int, default=16, help="sequences decoding")
    p.add_argument("--prompt", type=int, default=32, help="tokens of each arriving prompt")
    p.add_argument("--every", type=int, default=8, help="decode steps between arrivals")
    p.add_argument("--steps", type=int, default=120, help="decode steps a run")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs both ways")
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle)
    settings = EngineSettings(
        max_batch_size=args.rows + 1, session=SessionConfig(threads=args.threads, spinning=False)
    )
    engine = open_engine(bundle, settings)
    for round_ in range(1, args.rounds + 1):
        cells = []
        for beside in (False, True):
            rate, p50, p99 = run(engine, beside, args, seed=round_)
            name = "beside" if beside else "between"
            cells.append(f"{name} {rate:.0f} tok/s, gap p50 {p50:.1f} p99 {p99:.1f} ms ({p99 / p50:.2f})")
        print(f"round {round_}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

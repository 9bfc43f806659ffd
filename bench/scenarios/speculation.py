"""Speculation at one sequence, engine level: its speed-up and the arithmetic behind it.

Two engines of one bundle, one plain and one with `--speculative ngram`'s settings, decode the same prompts
alone, alternating prompt by prompt (this machine's speed drifts), greedy, exactly `--new-tokens` each. For
each dataset it prints the decode tok/s of both and their ratio, and why: the acceptance rate (proposed tokens
sampling picked), the tokens a speculating step emits, the share of steps that speculated (a step with no
n-gram match, or in backoff, is a plain decode step), and a speculating step's time over a plain step's. The
speed-up is about (tokens per step) / (step cost) over the steps that speculate.

    .venv/bin/textgen-bench speculation --bundle models/demo/bundle --prompts 8 --new-tokens 128

Datasets: `corpus`, windows of the Python standard library's sources (code repeats its own names), and
`synthetic`, uniform random token ids (nothing to look up). The tokens of both engines are compared: a
difference is reported (speculation must not change them). `--draft-bundle DIR` proposes with a draft
model instead of prompt lookup; a speculating step then includes the draft's runs.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.loadgen import corpus_window, cut_to_tokens, stdlib_texts, synthetic_ids
from bench.rounds import in_turn
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig, SpeculationSettings

CHARS_PER_TOKEN = 4


@dataclass
class Tally:
    """One engine's decode over a dataset."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    spec_steps: int = 0
    spec_seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def decode(engine: Engine, prompt: list[int], new_tokens: int, tally: Tally) -> None:
    """Prefill (not timed), then decode steps until `new_tokens` tokens, timed step by step."""
    outs = engine.prefill([NewSequence("bench", prompt, SamplingParams())])
    tokens = [o.token_id for o in outs]
    while len(tokens) < new_tokens:
        start = time.perf_counter()
        step = engine.decode()
        seconds = time.perf_counter() - start
        tally.steps += 1
        tally.seconds += seconds
        tally.tokens += len(step)
        if step[0].proposed:
            tally.spec_steps += 1
            tally.spec_seconds += seconds
            tally.proposed += step[0].proposed
            tally.accepted += step[0].accepted
        tokens += [o.token_id for o in step]
    engine.release(["bench"])
    tally.outputs.append(tokens[:new_tokens])


def prompts_of(dataset: str, engine: Engine, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if dataset == "synthetic":
        return [
            list(synthetic_ids(length, engine.vocab_size, engine.eos_token_id, rng)) for _ in range(count)
        ]
    texts = stdlib_texts()

    def count_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text).ids)

    windows = [corpus_window(texts, length * CHARS_PER_TOKEN, rng) for _ in range(count)]
    return [engine.tokenizer.encode(cut_to_tokens(w, length, count_tokens)).ids for w in windows]


def report(dataset: str, plain: Tally, spec: Tally) -> None:
    same = sum(a == b for a, b in zip(plain.outputs, spec.outputs, strict=True))
    plain_step = plain.seconds / plain.steps
    spec_step = spec.spec_seconds / spec.spec_steps if spec.spec_steps else float("nan")
    emitted = (spec.accepted + spec.spec_steps) / spec.spec_steps if spec.spec_steps else float("nan")
    acceptance = spec.accepted / spec.proposed if spec.proposed else float("nan")
    print(
        f"{dataset:9s}  plain {plain.rate:7.1f} tok/s  speculating {spec.rate:7.1f} tok/s  "
        f"ratio {spec.rate / plain.rate:.2f}  |  acceptance {acceptance:.2f} "
        f"({spec.accepted}/{spec.proposed})  tokens/speculating step {emitted:.2f}  "
        f"speculating steps {spec.spec_steps}/{spec.steps}  step cost {spec_step / plain_step:.2f}x "
        f"({spec_step * 1e3:.1f} against {plain_step * 1e3:.1f} ms)  same tokens {same}/{len(plain.outputs)}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--datasets", default="corpus,synthetic")
    p.add_argument("--prompts", type=int, default=8, help="prompts per dataset")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--draft-bundle", default=None, help="propose with this draft model instead of lookups")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its choice)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bundle = load_bundle(args.bundle)
    base = EngineSettings(max_batch_size=1, session=SessionConfig(threads=args.threads))
    speculation = SpeculationSettings(
        args.num_speculative_tokens, args.prompt_lookup_min, args.prompt_lookup_max, args.draft_bundle
    )
    plain = Engine.from_bundle(bundle, base)
    spec = Engine.from_bundle(bundle, replace(base, speculation=speculation))
    proposer = f"draft {args.draft_bundle}" if args.draft_bundle else "prompt lookup"
    print(
        f"{args.bundle}, {proposer}: {args.prompts} prompts of {args.input_len} tokens, "
        f"{args.new_tokens} new, greedy"
    )
    for dataset in args.datasets.split(","):
        prompts = prompts_of(dataset, plain, args.prompts, args.input_len, args.seed)
        decode(plain, prompts[0], 8, Tally())  # warm-up: both sessions' first runs of these shapes
        decode(spec, prompts[0], 8, Tally())
        tallies = Tally(), Tally()
        for i, prompt in enumerate(prompts):
            for which in in_turn((0, 1), i):
                decode((plain, spec)[which], prompt, args.new_tokens, tallies[which])
        report(dataset, *tallies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

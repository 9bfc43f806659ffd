"""Preemption in the engine: a sequence swapped out to host memory and back resumes exactly where it stopped.

The expectations come from the same sequences run without a pause, so any drift (keys and values, the
pending token, the RNG, the penalties, the constraint's matcher) shows as a different token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint, EngineSettings, NewSequence, SessionConfig

STEPS = 24
PAUSE_AT = 6  # decode steps before the pause
# Greedy with a repetition penalty, seeded sampling with OpenAI's penalties, and seeded sampling under a
# constraint whose matcher is mid-way at the pause (a fresh one would ask for "a b c ..." again): each
# carries state.
SAMPLING = {
    "greedy": SamplingParams(repetition_penalty=1.3),
    "seeded": SamplingParams(
        temperature=1.1, top_p=0.95, seed=7, frequency_penalty=0.5, presence_penalty=0.3
    ),
    "constrained": SamplingParams(temperature=1.0, seed=3),
}
PROMPTS = ["Once upon a time", "The little dog ran to", "She said"]
ALPHABET = Constraint.regex("a b c d e f g h i j k l m n o p[a-z ]*")


@pytest.fixture(scope="module")
def engine(demo_bundle: Path) -> Engine:
    settings = EngineSettings(max_batch_size=3, session=SessionConfig(threads=2, spinning=False))
    return Engine.from_bundle(load_bundle(demo_bundle), settings)


def sequences(engine: Engine, prefix: str = "") -> list[NewSequence]:
    alphabet = engine.constraint_compiler.compile(ALPHABET)
    return [
        NewSequence(
            prefix + name,
            engine.tokenizer.encode(prompt).ids,
            params,
            constraint=alphabet if name == "constrained" else None,
        )
        for (name, params), prompt in zip(SAMPLING.items(), PROMPTS, strict=True)
    ]


def decode(engine: Engine, steps: int, into: dict[str, list[int]]) -> None:
    for _ in range(steps):
        for out in engine.decode():
            into.setdefault(out.seq_id, []).append(out.token_id)


def unpaused(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for out in engine.prefill(sequences(engine)):
        tokens[out.seq_id] = [out.token_id]
    decode(engine, STEPS, tokens)
    engine.release(list(tokens))
    return tokens


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_swapped_out_sequence_resumes_with_the_tokens_it_would_have_given(
    engine: Engine, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if path == "device":  # the copy graph through host arrays, as on a GPU
        monkeypatch.setattr(engine._kv, "_host_views", None)
    expected = unpaused(engine)
    tokens = {out.seq_id: [out.token_id] for out in engine.prefill(sequences(engine))}
    decode(engine, PAUSE_AT, tokens)
    lengths = engine.lengths()
    foreseen = sum(engine.swap_bytes(seq_id) for seq_id in SAMPLING)  # what the scheduler caps
    engine.swap_out(list(SAMPLING))
    assert engine.batch_size == 0
    spec = engine.spec
    per_token = 2 * spec.n_layers * spec.kv_heads * spec.head_dim * 4 + 8  # fp32 K and V, and the token id
    assert engine.swapped_bytes == per_token * sum(lengths.values()) == foreseen
    # Others take their rows meanwhile and write over them.
    others: dict[str, list[int]] = {}
    engine.prefill(sequences(engine, "other-"))
    decode(engine, 5, others)
    engine.release([f"other-{name}" for name in SAMPLING])
    engine.swap_in(list(reversed(SAMPLING)))  # in other rows than they left
    assert engine.lengths() == lengths and engine.swapped_bytes == 0
    decode(engine, STEPS - PAUSE_AT, tokens)
    engine.release(list(tokens))
    assert tokens == expected


def test_a_preempted_sequence_released_before_it_resumes_frees_its_host_copy(engine: Engine) -> None:
    engine.prefill(sequences(engine))
    engine.swap_out(["seeded"])
    assert engine.swapped_bytes > 0
    engine.release(list(SAMPLING))
    assert engine.swapped_bytes == 0 and engine.batch_size == 0
    with pytest.raises(ValueError, match="not preempted"):
        engine.swap_in(["seeded"])
    with pytest.raises(ValueError, match="not running"):
        engine.swap_out(["greedy"])
    with pytest.raises(ValueError, match="not running"):
        engine.swap_bytes("greedy")

"""n choices of one prompt: the engine prefills the prompt once and forks its row (KV and first-step logits)
into the others' (`NewSequence.fork_of`); the planner admits a fork with its parent at no prefill cost. The
tokens are those each choice gets prefilled on its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence

PROMPT = [5, 17, 42, 9, 33, 2, 71, 8]


@pytest.fixture
def engine(tiny_bundle: Path) -> Engine:
    return Engine.from_bundle(load_bundle(tiny_bundle), EngineSettings(max_batch_size=4))


def choices(fork: bool) -> list[NewSequence]:
    return [
        NewSequence(f"c{i}", PROMPT, SamplingParams(temperature=1.0, seed=100 + i), logprobs=True,
                    fork_of="c0" if fork and i else None)
        for i in range(3)
    ]  # fmt: skip


def run(engine: Engine, new: list[NewSequence], steps: int = 6) -> dict[str, list[int]]:
    tokens = {out.seq_id: [out.token_id] for out in engine.prefill(new)}
    for _ in range(steps):
        for out in engine.decode():
            tokens[out.seq_id].append(out.token_id)
    return tokens


def test_forked_choices_get_the_tokens_they_would_prefilled_alone(tiny_bundle: Path) -> None:
    settings = EngineSettings(max_batch_size=4)
    forked_engine = Engine.from_bundle(load_bundle(tiny_bundle), settings)
    forked = run(forked_engine, choices(fork=True))
    keys = [forked_engine.kv_host(0, "key")[r, :, : len(PROMPT)] for r in range(3)]
    plain = run(Engine.from_bundle(load_bundle(tiny_bundle), settings), choices(fork=False))
    assert forked == plain
    assert len({tuple(t) for t in forked.values()}) > 1  # their own seeds: different choices
    assert np.allclose(keys[0], keys[1]) and np.allclose(keys[0], keys[2])


def test_a_fork_whose_parent_is_elsewhere_is_prefilled_as_any_other(engine: Engine) -> None:
    lone = NewSequence("c1", PROMPT, SamplingParams(), fork_of="gone")
    other_prompt = NewSequence("c2", [*PROMPT, 1], SamplingParams(), fork_of="c0")
    parent = NewSequence("c0", PROMPT, SamplingParams())
    assert {out.seq_id for out in engine.prefill([parent, lone, other_prompt])} == {"c0", "c1", "c2"}
    greedy = {out.seq_id: out.token_id for out in engine.decode()}
    assert greedy["c0"] == greedy["c1"]  # same prompt, greedy: the same tokens whichever way


def test_forks_are_not_prefilled_beside_decode_steps(engine: Engine) -> None:
    engine.prefill([NewSequence("running", PROMPT, SamplingParams())])
    with pytest.raises(ValueError, match="forked sequences"):
        engine.begin_prefill(choices(fork=True))

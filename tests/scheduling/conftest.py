"""The scheduler tests' fixtures: the letter tokenizer, the tiny bundle's real engine beside the fake one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from scheduler_fakes import Instrumented, fake, letter_tokenizer
from scheduler_runs import EngineFactory, Reference, real_engine
from tokenizers import Tokenizer

from serve.bundle import Bundle, load_bundle
from serve.scheduling.offline import generate


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return letter_tokenizer()


@pytest.fixture(scope="module")
def real_bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle)


@pytest.fixture(scope="module")
def alone(real_bundle: Bundle) -> Reference:
    """Greedy tokens of one prompt run alone, on an engine of its own."""
    engine = real_engine(real_bundle, 1)

    def reference(prompt: Sequence[int], n: int) -> list[int]:
        return generate(engine, [list(prompt)], max_new_tokens=n, ignore_eos=True)[0].token_ids

    return reference


@pytest.fixture(params=["fake", "real"])
def make_engine(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> EngineFactory:
    """Builds the fake engine, or the real one on the tiny bundle, with the same test controls."""
    if request.param == "fake":
        return lambda max_batch_size=4, step_seconds=0.0, prefix_cache=False: fake(
            tokenizer, step_seconds, max_batch_size=max_batch_size, keeps_prefixes=prefix_cache
        )
    bundle = request.getfixturevalue("real_bundle")
    reference = request.getfixturevalue("alone")
    return lambda max_batch_size=4, step_seconds=0.0, prefix_cache=False: Instrumented(
        real_engine(bundle, max_batch_size, 2 if prefix_cache else 0), reference, step_seconds
    )

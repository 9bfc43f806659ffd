"""The KV cache dtype benchmark's figures, on the demo model: both caches timed on the same rows, the
accuracy counted over the steps both ran on the same tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.scenarios import kv_dtype
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, SessionConfig


@pytest.fixture(scope="module")
def engines(demo_bundle: Path) -> dict[str, Engine]:
    bundle = load_bundle(demo_bundle)
    settings = EngineSettings(
        max_batch_size=4, capacity=128, session=SessionConfig(threads=2, spinning=False)
    )
    return {d: Engine.from_bundle(bundle, replace(settings, kv_cache_dtype=d)) for d in kv_dtype.DTYPES}


def test_both_caches_step_over_the_same_rows(engines: dict[str, Engine]) -> None:
    cell = kv_dtype.speed(engines, rows=4, context=48, rounds=3, steps=2)
    assert all(len(times) == 3 for times in cell["step_ms"].values())
    assert cell["fp16_over_fp32_fastest"] > 0
    assert all(engine.batch_size == 0 for engine in engines.values())  # every row released


def test_accuracy_counts_tokens_and_the_logits_of_shared_steps(engines: dict[str, Engine]) -> None:
    figures = kv_dtype.accuracy(engines, prompts=3, tokens=8)
    assert figures["agreed_tokens"] <= 3 * 8 and len(figures["first_parts"]) == 3
    assert 0 < figures["max_logit_diff_relative"] < 0.01  # the float16 cache is in use, and close

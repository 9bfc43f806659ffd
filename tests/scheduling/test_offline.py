"""Offline generate(): the scheduler's batching and stopping, driven without a thread or event loop."""

from __future__ import annotations

import pytest
from scheduler_fakes import fake, letter_tokenizer
from tokenizers import Tokenizer

from serve.engine.sampling import SamplingParams
from serve.errors import EngineFailure, InvalidRequest
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.offline import generate


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return letter_tokenizer()


def test_more_prompts_than_rows_all_complete_in_order(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, max_batch_size=3)
    prompts = [[40 + i] * (2 + 3 * i) for i in range(7)]
    completions = generate(engine, prompts, max_new_tokens=5, include_logprobs=True)
    assert [c.request_id for c in completions] == [f"offline-{i}" for i in range(7)]
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == engine.expected(prompt, 5)
        assert completion.text == tokenizer.decode(completion.token_ids)
        assert completion.logprobs == [-0.5] * 5
        assert completion.finish_reason == "length"
    assert max(len(rows) for _, rows in engine.calls) == 3
    assert engine.batch_size == 0


def test_text_prompts_and_per_prompt_sampling(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer)
    prompts = ["the quick", "brown fox jumps"]
    completions = generate(engine, prompts, [SamplingParams(), SamplingParams(seed=3)], max_new_tokens=4)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == engine.expected(tokenizer.encode(prompt).ids, 4)
    with pytest.raises(InvalidRequest, match="2 sampling parameter sets for 1 prompts"):
        generate(engine, ["x"], [SamplingParams(), SamplingParams()])


def test_generation_stops_at_the_context_limit(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, capacity=16)
    (completion,) = generate(engine, [[40] * 10], max_new_tokens=50)
    assert completion.finish_reason == "context"
    assert len(completion.token_ids) == 16 - 10
    with pytest.raises(InvalidRequest, match="at most 15 leave room"):
        generate(engine, [[40] * 16])
    # A KV budget below the engine's slot length is the limit instead.
    (budgeted,) = generate(
        engine, [[40] * 10], max_new_tokens=50, limits=SchedulerLimits(max_batch_tokens=12)
    )
    assert len(budgeted.token_ids) == 2


def test_an_engine_failure_raises_and_frees_every_row(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, max_batch_size=2)
    engine.fail_next.add("decode")
    with pytest.raises(EngineFailure, match="during decode"):
        generate(engine, [[40, 41], [42, 43], [44]], max_new_tokens=4)
    assert engine.batch_size == 0
    assert len(generate(engine, [[40, 41]], max_new_tokens=4)[0].token_ids) == 4

"""Scheduler: what ends a request (stop strings and tokens, EOS, min_new_tokens) and what is refused before
queueing."""

from __future__ import annotations

from typing import Any

import pytest
from scheduler_fakes import EOS_ID, FakeEngine, fake
from scheduler_runs import collect, prompt_of, request, run, started
from tokenizers import Tokenizer

from serve.engine.sampling import SamplingParams
from serve.engine.types import NewSequence
from serve.errors import InvalidRequest
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, GenerationRequest, RequestTracker
from serve.scheduling.request_checks import validate_request
from serve.scheduling.scheduler import Scheduler


def test_stop_eos_and_logprobs(tokenizer: Tokenizer) -> None:
    plain = FakeEngine(tokenizer).expected(prompt_of(5), 10)
    text = tokenizer.decode(plain)
    stop = text[4:7]  # spans several one-letter tokens
    eos_engine = fake(tokenizer, eos_after=4)

    async def main() -> tuple[Completion, Completion]:
        scheduler = await started(fake(tokenizer))
        stopped = await collect(scheduler.submit(request("s", prompt_of(5), 10, stop=(stop,))))
        await scheduler.drain(1.0)
        scheduler = await started(eos_engine)
        eos = await collect(
            scheduler.submit(request("e", prompt_of(5), 10, include_logprobs=True, ignore_eos=False))
        )
        await scheduler.drain(1.0)
        return stopped, eos

    stopped, eos = run(main)
    assert stopped.finish_reason == "stop" and stopped.finish is not None
    assert stopped.text == text[: text.index(stop)] and stopped.finish.stop_string == stop
    assert eos.finish_reason == "eos"
    assert eos.token_ids == plain[:3] and eos.finish is not None and eos.finish.completion_tokens == 3
    assert eos.logprobs == [-0.5] * 3


def test_a_stop_token_ends_the_request_and_is_not_returned(tokenizer: Tokenizer) -> None:
    plain = FakeEngine(tokenizer).expected(prompt_of(3), 10)
    stop_at = next(i for i in range(2, 10) if plain[i] not in plain[:i])

    async def main() -> Completion:
        scheduler = await started(fake(tokenizer))
        done = await collect(
            scheduler.submit(request("t", prompt_of(3), 10, stop_token_ids=(plain[stop_at],)))
        )
        await scheduler.drain(1.0)
        return done

    done = run(main)
    assert done.finish_reason == "stop" and done.token_ids == plain[:stop_at]
    assert done.text == tokenizer.decode(plain[:stop_at])
    assert done.finish is not None and done.finish.completion_tokens == stop_at
    assert done.finish.stop_string is None  # a token, not a string


def test_the_engine_is_told_to_ban_eos_and_stop_tokens_until_min_new_tokens(tokenizer: Tokenizer) -> None:
    def sequence(**kw: Any) -> NewSequence:
        tracker = RequestTracker(request("m", prompt_of(3), 8, **kw), tokenizer, EOS_ID, 100, 0.0)
        return tracker.new_sequence()

    banned = sequence(ignore_eos=False, min_new_tokens=3, stop_token_ids=(7, 9))
    assert banned.banned == (EOS_ID, 7, 9) and banned.banned_for == 3
    assert sequence(ignore_eos=True, min_new_tokens=3, stop_token_ids=(7,)).banned == (7,)
    assert sequence(ignore_eos=False, stop_token_ids=(7,)).banned_for == 0
    with pytest.raises(InvalidRequest, match=r"min_new_tokens is 9; allowed 0\.\.8"):
        validate_request(request("m", prompt_of(3), 8, min_new_tokens=9), 100, 100)
    with pytest.raises(InvalidRequest, match=r"top_logprobs is 21; allowed 0\.\.20"):
        validate_request(request("m", prompt_of(3), 8, include_logprobs=True, top_logprobs=21), 100, 100)
    with pytest.raises(InvalidRequest, match="top_logprobs needs include_logprobs"):
        validate_request(request("m", prompt_of(3), 8, top_logprobs=2), 100, 100)
    biased = GenerationRequest("m", prompt_of(3), SamplingParams(logit_bias=((100, 1.0),)), 8)
    with pytest.raises(InvalidRequest, match=r"logit_bias token ids must be in \[0, 99\]"):
        validate_request(biased, 100, 100)
    with pytest.raises(InvalidRequest, match=r"stop_token_ids must be in \[0, 99\]"):
        validate_request(request("m", prompt_of(3), 8, stop_token_ids=(100,)), 100, 100)


def test_invalid_requests_are_refused_before_queueing(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, capacity=32)

    async def main() -> None:
        scheduler = await started(engine)
        with pytest.raises(InvalidRequest, match="exceeds the limit of 32"):
            scheduler.submit(request("big", prompt_of(30), max_new=3))
        with pytest.raises(InvalidRequest, match="empty"):
            scheduler.submit(request("empty", [], max_new=3))
        with pytest.raises(InvalidRequest, match=r"\[0, "):
            scheduler.submit(request("oov", [engine.vocab_size], max_new=3))
        handle = scheduler.submit(request("dup", prompt_of(3), max_new=20))
        with pytest.raises(InvalidRequest, match="already in use"):
            scheduler.submit(request("dup", prompt_of(3), max_new=3))
        await collect(handle)
        assert scheduler.snapshot().waiting == 0
        await scheduler.drain(1.0)

    run(main)
    with pytest.raises(ValueError, match="exceeds the engine's 4 KV slots"):
        Scheduler(engine, SchedulerLimits(max_batch_size=5))

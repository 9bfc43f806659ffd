"""Scheduler: scheduling logic on a deterministic fake engine, then the real engine on a tiny bundle."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from scheduler_fakes import EOS_ID, FakeEngine, Instrumented, fake, letter_tokenizer
from tokenizers import Tokenizer

from serve.api.metrics import Metrics, new_registry
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence
from serve.errors import Cancelled, DeadlineExceeded, Draining, EngineFailure, InvalidRequest, QueueFull
from serve.scheduling.handles import RequestHandle
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.offline import generate
from serve.scheduling.request import (
    Completion,
    FinishEvent,
    GenerationRequest,
    RequestState,
    RequestTracker,
    TokenEvent,
    validate_request,
)
from serve.scheduling.runner import StepRecord
from serve.scheduling.scheduler import Scheduler

T = TypeVar("T")
Reference = Callable[[Sequence[int], int], list[int]]
# One intra-op thread: the test's event loop needs the other core.
SESSION = SessionConfig(threads=1, spinning=False)


class EngineFactory(Protocol):
    def __call__(
        self, max_batch_size: int = 4, step_seconds: float = 0.0, prefix_cache: bool = False
    ) -> Instrumented: ...


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return letter_tokenizer()


@pytest.fixture(scope="module")
def real_bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle)


def real_engine(bundle: Bundle, max_batch_size: int, prefix_cache_rows: int = 0) -> Engine:
    settings = EngineSettings(
        max_batch_size=max_batch_size,
        session=SESSION,
        prefix_cache_rows=prefix_cache_rows,
        prefix_cache_min_tokens=4,
    )
    return Engine.from_bundle(bundle, settings)


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


def request(rid: str, prompt: list[int], max_new: int = 8, **kw: Any) -> GenerationRequest:
    # EOS is ignored unless a test asks for it: a random model may sample it at any step.
    kw.setdefault("ignore_eos", True)
    return GenerationRequest(rid, prompt, SamplingParams(), max_new, **kw)


def prompt_of(length: int, start: int = 40) -> list[int]:
    return [start + (i % 50) for i in range(length)]


def run(main: Callable[[], Coroutine[Any, Any, T]], timeout: float = 20.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(main(), timeout)

    return asyncio.run(bounded())


async def collect(handle: RequestHandle) -> Completion:
    completion = Completion(handle.request_id)
    async for event in handle:
        completion.add(event)
    return completion


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


async def started(engine: Instrumented, limits: SchedulerLimits | None = None, **kw: Any) -> Scheduler:
    scheduler = Scheduler(engine, limits or SchedulerLimits(max_wait_seconds=0.0), **kw)
    await scheduler.start()
    return scheduler


def test_tokens_match_the_engine_alone_and_events_are_well_formed(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=3)
    prompts = [prompt_of(n, start) for n, start in ((3, 40), (9, 41), (5, 42), (12, 43), (7, 44))]

    async def main() -> list[Completion]:
        scheduler = await started(engine)
        handles = [scheduler.submit(request(f"r{i}", p, max_new=6 + i)) for i, p in enumerate(prompts)]
        done = await asyncio.gather(*(collect(h) for h in handles))
        await scheduler.drain(1.0)
        return done

    completions = run(main)
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        assert completion.token_ids == engine.expected(prompt, 6 + i)
        if isinstance(engine.inner, FakeEngine):  # letters only: the text is their plain decoding
            assert completion.text == engine.tokenizer.decode(completion.token_ids)
        assert completion.finish is not None and completion.finish.finish_reason == "length"
        assert completion.finish.completion_tokens == 6 + i
        assert completion.finish.prompt_tokens == len(prompt)
        assert 0 <= completion.finish.queue_seconds <= completion.finish.ttft_seconds
        assert completion.finish.ttft_seconds <= completion.finish.total_seconds
        assert completion.logprobs == []
    assert max(len(rows) for _, rows in engine.calls) <= 3
    assert engine.batch_size == 0


def test_continuous_batching_joins_between_decode_steps_and_leaves_at_once(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_batch_size=4, step_seconds=0.002)

    async def main() -> Scheduler:
        scheduler = await started(engine)
        long = scheduler.submit(request("long", prompt_of(4), max_new=40))
        first = await long.__anext__()
        assert isinstance(first, TokenEvent) and first.token_ids
        short = scheduler.submit(request("short", prompt_of(20), max_new=3))
        await collect(short)
        rest = await collect(long)
        assert len(rest.token_ids) == 39
        await scheduler.drain(1.0)
        return scheduler

    scheduler = run(main)
    rows = [rows for phase, rows in engine.calls if phase == "decode"]
    joined = next(i for i, r in enumerate(rows) if "short" in r)
    left = max(i for i, r in enumerate(rows) if "short" in r)
    assert joined > 0, "the short request joined a batch that was already decoding"
    assert rows[left + 1] == ["long"], "the batch shrank as soon as the short request finished"
    # Padding per decode step is reported: two rows of different contexts carry padding.
    steps = scheduler.steps()
    assert {s.phase for s in steps} == {"prefill", "decode"}
    assert any(s.rows == 2 and s.padding_ratio > 0 for s in steps if s.phase == "decode")
    assert all(s.padded_tokens >= s.real_tokens for s in steps)


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
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.index(stop)]
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


def test_queue_full_is_refused_immediately(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=1)
    engine.gate.clear()

    async def main() -> None:
        scheduler = await started(engine, SchedulerLimits(max_queue=2))
        running = scheduler.submit(request("a", prompt_of(3)))
        await until(lambda: len(engine.calls) == 1)  # "a" is in the engine, held on the gate
        queued = [scheduler.submit(request(r, prompt_of(3))) for r in ("b", "c")]
        start = time.monotonic()
        with pytest.raises(QueueFull, match="queue is full"):
            scheduler.submit(request("d", prompt_of(3)))
        assert time.monotonic() - start < 0.05
        snapshot = scheduler.snapshot()
        assert (snapshot.waiting, snapshot.outcomes["rejected"]) == (2, 1)
        engine.gate.set()
        for handle in (running, *queued):
            assert (await collect(handle)).finish_reason == "length"
        await scheduler.drain(1.0)

    run(main)


def test_max_batch_tokens_holds_in_every_step_and_a_long_prompt_is_served(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=4, step_seconds=0.001)
    limits = SchedulerLimits(max_batch_tokens=96, max_wait_seconds=0.0)

    async def main() -> tuple[Scheduler, list[str]]:
        scheduler = await started(engine, limits)
        admitted: list[str] = []

        async def client(rid: str, prompt: list[int], max_new: int, delay: float) -> None:
            await asyncio.sleep(delay)
            handle = scheduler.submit(request(rid, prompt, max_new))
            admitted.append(rid)
            assert (await collect(handle)).finish_reason == "length"

        shorts = [client(f"s{i}", prompt_of(4 + i % 5), 6, 0.002 * i) for i in range(24)]
        await asyncio.gather(*shorts, client("long", prompt_of(40), 20, 0.01))
        await scheduler.drain(1.0)
        return scheduler, admitted

    scheduler, submitted = run(main)
    steps = scheduler.steps()
    assert steps and all(s.padded_tokens <= 96 for s in steps)
    # FCFS: every prefill before the long one's was headed by an older request (younger requests of similar
    # length may share an older head's prefill, but none heads a group while the long one waits).
    groups = [rows for phase, rows in engine.calls if phase == "prefill"]
    before = groups[: next(i for i, g in enumerate(groups) if "long" in g)]
    older = set(submitted[: submitted.index("long")])
    assert all(group[0] in older for group in before)
    assert scheduler.snapshot().outcomes["finished"] == 25


def test_prefill_groups_bucket_similar_lengths_and_respect_the_prefill_budget(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_batch_size=8)
    engine.gate.clear()
    limits = SchedulerLimits(max_prefill_tokens=48, max_padding_ratio=0.2, max_wait_seconds=0.0)
    lengths = {"w": 3, "a": 10, "b": 20, "c": 11, "d": 18, "e": 12, "f": 9, "g": 10}

    async def main() -> Scheduler:
        scheduler = await started(engine, limits)
        handles = [scheduler.submit(request("w", prompt_of(3), max_new=2))]
        await until(lambda: len(engine.calls) == 1)  # hold the engine so the rest queue up together
        handles += [
            scheduler.submit(request(r, prompt_of(n), max_new=2)) for r, n in lengths.items() if r != "w"
        ]
        engine.gate.set()
        await asyncio.gather(*(collect(h) for h in handles))
        await scheduler.drain(1.0)
        return scheduler

    scheduler = run(main)
    groups = [rows for phase, rows in engine.calls if phase == "prefill"]
    assert groups[0] == ["w"]
    assert groups[1] == ["a", "c", "e", "f"]  # FCFS head "a" plus similar lengths within 48 padded tokens
    assert groups[2] == ["b", "d"]  # "g" would exceed the 48-token budget
    assert groups[3] == ["g"]
    prefills = [s for s in scheduler.steps() if s.phase == "prefill"]
    assert all(s.padded_tokens <= 48 and s.padding_ratio <= 0.2 for s in prefills)


def test_a_partial_group_waits_up_to_max_wait_while_others_decode(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, max_batch_size=4, step_seconds=0.004)

    async def main() -> Completion:
        scheduler = await started(engine, SchedulerLimits(max_wait_seconds=0.1))
        running = scheduler.submit(request("running", prompt_of(3), max_new=60))
        await running.__anext__()
        pair = [scheduler.submit(request("b", prompt_of(4), max_new=3))]
        await asyncio.sleep(0.02)
        pair += [scheduler.submit(request(r, prompt_of(4), max_new=3)) for r in ("c", "d")]  # fills the rows
        await asyncio.gather(*(collect(h) for h in pair))
        alone = await collect(scheduler.submit(request("e", prompt_of(4), max_new=3)))
        await collect(running)
        await scheduler.drain(1.0)
        return alone

    alone = run(main)
    groups = [rows for phase, rows in engine.calls if phase == "prefill"]
    assert groups[1] == ["b", "c", "d"]  # "b" waited for company instead of stalling the decoder alone
    assert groups[2] == ["e"]
    assert alone.finish is not None and alone.finish.queue_seconds >= 0.1


def test_cancel_frees_the_slot_within_one_step(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2, step_seconds=0.002)

    async def main() -> tuple[Scheduler, int]:
        scheduler = await started(engine)
        victim = scheduler.submit(request("victim", prompt_of(4), max_new=50))
        other = scheduler.submit(request("other", prompt_of(5), max_new=30))
        for _ in range(3):
            await victim.__anext__()
        calls_at_cancel = len(engine.calls)
        victim.cancel()
        victim.cancel()  # idempotent
        with pytest.raises(Cancelled):
            await victim.__anext__()
        await until(lambda: scheduler.snapshot().outcomes.get("cancelled") == 1)
        assert (await collect(other)).finish_reason == "length"
        queued = scheduler.submit(request("queued", prompt_of(4), max_new=5))
        queued.cancel()
        with pytest.raises(Cancelled):
            await collect(queued)
        await until(lambda: scheduler.snapshot().outcomes.get("cancelled") == 2)
        await scheduler.drain(1.0)
        return scheduler, calls_at_cancel

    scheduler, calls_at_cancel = run(main)
    with_victim = [i for i, (_, rows) in enumerate(engine.calls) if "victim" in rows]
    assert max(with_victim) <= calls_at_cancel  # at most the step already in flight
    assert not any("queued" in rows for _, rows in engine.calls)
    assert scheduler.snapshot().outcomes["cancelled"] == 2


def test_deadlines_expire_queued_and_running_requests(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=1, step_seconds=0.005)

    async def main() -> Scheduler:
        scheduler = await started(engine)
        soon = time.monotonic() + 0.1
        running = scheduler.submit(request("running", prompt_of(4), max_new=60, deadline=soon))
        queued = scheduler.submit(request("queued", prompt_of(4), max_new=5, deadline=soon))
        with pytest.raises(DeadlineExceeded, match="while generating"):
            await collect(running)
        expired_at = len(engine.calls)
        with pytest.raises(DeadlineExceeded, match="while queued"):
            await collect(queued)
        later = await collect(scheduler.submit(request("later", prompt_of(4), max_new=3)))
        assert later.finish_reason == "length"
        assert not any("running" in rows for _, rows in engine.calls[expired_at:])
        await scheduler.drain(1.0)
        return scheduler

    scheduler = run(main)
    assert scheduler.snapshot().outcomes["expired"] == 2
    assert not any("queued" in rows for _, rows in engine.calls)


def test_a_failed_prefill_fails_only_its_group(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=4, step_seconds=0.002)

    async def main() -> None:
        scheduler = await started(engine)
        bystander = scheduler.submit(request("bystander", prompt_of(3), max_new=30))
        await bystander.__anext__()
        engine.fail_next.add("prefill")
        victim = scheduler.submit(request("victim", prompt_of(6), max_new=5))
        with pytest.raises(EngineFailure, match="request victim: the engine failed during prefill"):
            await collect(victim)
        assert len((await collect(bystander)).token_ids) == 29
        await expect_later_requests_succeed(scheduler, engine)

    run(main)


def test_a_failed_decode_fails_its_rows_and_serving_goes_on(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=4, step_seconds=0.002)

    async def main() -> None:
        scheduler = await started(engine)
        handles = [scheduler.submit(request(r, prompt_of(3 + i), max_new=30)) for i, r in enumerate("ab")]
        for handle in handles:
            await handle.__anext__()
        engine.fail_next.add("decode")
        for handle in handles:
            with pytest.raises(EngineFailure, match=f"request {handle.request_id}: .* during decode"):
                await collect(handle)
        assert scheduler.snapshot().outcomes["failed"] == 2
        await expect_later_requests_succeed(scheduler, engine)

    run(main)


def test_an_undecodable_token_fails_only_its_request(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, max_batch_size=4, step_seconds=0.002)
    engine.poisoned.add("victim")

    async def main() -> None:
        scheduler = await started(engine)
        bystander = scheduler.submit(request("bystander", prompt_of(3), max_new=10))
        victim = scheduler.submit(request("victim", prompt_of(3), max_new=10))
        with pytest.raises(EngineFailure, match="request victim: its output could not be processed"):
            await collect(victim)
        assert len((await collect(bystander)).token_ids) == 10
        await expect_later_requests_succeed(scheduler, engine)

    run(main)


def test_a_scheduler_error_fails_what_is_in_flight_and_serving_goes_on(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, max_batch_size=4, step_seconds=0.002)

    async def main() -> None:
        scheduler = await started(engine)
        engine.stray_decode = True  # an output the scheduler cannot place: a bug, not an engine failure
        running = scheduler.submit(request("running", prompt_of(3), max_new=20))
        ending = scheduler.submit(request("ending", prompt_of(4), max_new=2))  # ends in that decode
        with pytest.raises(EngineFailure, match="request running: internal scheduler error"):
            await collect(running)
        # Outcomes decided in the failed step before the error are still delivered.
        assert (await collect(ending)).finish_reason == "length"
        await expect_later_requests_succeed(scheduler, engine)

    run(main)


async def expect_later_requests_succeed(scheduler: Scheduler, engine: Instrumented) -> None:
    after = await collect(scheduler.submit(request("after", prompt_of(4), max_new=4)))
    assert after.token_ids == engine.expected(prompt_of(4), 4)
    await until(lambda: engine.batch_size == 0)
    await scheduler.drain(1.0)


def test_drain_finishes_running_fails_queued_and_refuses_new(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=1, step_seconds=0.002)

    async def main() -> None:
        scheduler = await started(engine)
        running = scheduler.submit(request("running", prompt_of(4), max_new=10))
        await running.__anext__()
        queued = scheduler.submit(request("queued", prompt_of(4), max_new=10))
        results = asyncio.gather(collect(running), collect(queued), return_exceptions=True)
        await scheduler.drain(5.0)
        done, refused = await results
        assert isinstance(done, Completion) and len(done.token_ids) == 9
        assert isinstance(refused, Draining)
        with pytest.raises(Draining):
            scheduler.submit(request("late", prompt_of(4)))

        scheduler = await started(make_engine(step_seconds=0.002))
        endless = scheduler.submit(request("endless", prompt_of(4), max_new=50))
        await endless.__anext__()
        await scheduler.drain(0.0)
        with pytest.raises(Draining):
            await collect(endless)

    run(main)


def test_metrics_hooks_and_load_snapshot(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=4)
    metrics = Metrics(new_registry())

    async def main() -> Scheduler:
        scheduler = await started(engine, metrics=metrics)
        handles = [scheduler.submit(request(f"r{i}", prompt_of(3 + i), max_new=5)) for i in range(3)]
        await asyncio.gather(*(collect(h) for h in handles))
        await until(lambda: scheduler.snapshot().running == 0)
        await scheduler.drain(1.0)
        return scheduler

    scheduler = run(main)
    sample = metrics.registry.get_sample_value
    assert sample("textgen_time_to_first_token_seconds_count") == 3
    assert sample("textgen_inter_token_latency_seconds_count") == 3 * 4
    assert sample("textgen_requests_finished_total", {"reason": "length"}) == 3
    assert sample("textgen_generation_tokens_total") == 15
    assert sample("textgen_requests_running") == 0
    snapshot = scheduler.snapshot()
    assert (snapshot.running, snapshot.waiting) == (0, 0)
    assert (snapshot.kv_slots_used, snapshot.kv_slots_capacity) == (0, 4)
    assert snapshot.kv_shape == engine.kv_shape() and snapshot.kv_shape[0] == 0


def test_illegal_state_transitions_are_refused(tokenizer: Tokenizer) -> None:
    from serve.scheduling.request import RequestTracker

    tracker = RequestTracker(request("x", prompt_of(3)), tokenizer, 0, 64, arrival=0.0)
    with pytest.raises(RuntimeError, match="illegal transition queued -> finished"):
        tracker.end(RequestState.FINISHED, 1.0)
    tracker.end(RequestState.CANCELLED, 1.0)
    with pytest.raises(RuntimeError, match="cancelled -> prefilling"):
        tracker.admit(2.0)


# -- the real engine only ------------------------------------------------------------------------------------


def test_batch_invariance_through_the_scheduler(real_bundle: Bundle, alone: Reference) -> None:
    """16 concurrent greedy requests of different lengths and arrival times get the tokens each gets alone."""
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 320) for _ in range(rng.randint(2, 24))] for _ in range(16)]
    budgets = [rng.randint(6, 30) for _ in range(16)]
    delays = [rng.uniform(0.0, 0.05) for _ in range(16)]
    expected = [alone(p, n) for p, n in zip(prompts, budgets, strict=True)]
    engine = Instrumented(real_engine(real_bundle, 16), alone, step_seconds=0.001)

    async def main() -> list[Completion]:
        scheduler = await started(engine, SchedulerLimits(max_wait_seconds=0.005))

        async def client(i: int) -> Completion:
            await asyncio.sleep(delays[i])
            return await collect(scheduler.submit(request(f"r{i}", prompts[i], budgets[i])))

        done = await asyncio.gather(*(client(i) for i in range(16)))
        await scheduler.drain(1.0)
        return done

    assert [c.token_ids for c in run(main)] == expected
    # The batch was really shared, and requests joined while others were decoding.
    assert max(len(rows) for phase, rows in engine.calls if phase == "decode") >= 4
    joined_running = [
        shape[0] > len(rows)
        for (phase, rows), shape in zip(engine.calls, engine.shapes, strict=True)
        if phase == "prefill"
    ]
    assert any(joined_running)


def test_join_and_leave_change_the_engines_batch_and_kv_view(real_bundle: Bundle, alone: Reference) -> None:
    engine = Instrumented(real_engine(real_bundle, 4), alone, step_seconds=0.002)

    async def main() -> tuple[Completion, Completion]:
        scheduler = await started(engine)
        long = scheduler.submit(request("long", prompt_of(5), 30))
        first = await long.__anext__()
        short = await collect(scheduler.submit(request("short", prompt_of(9), 5)))
        rest = await collect(long)
        assert isinstance(first, TokenEvent)
        rest.token_ids[:0] = first.token_ids
        await scheduler.drain(1.0)
        return rest, short

    long, short = run(main)
    assert long.token_ids == alone(prompt_of(5), 30)
    assert short.token_ids == alone(prompt_of(9), 5)
    rows = [shape[0] for shape in engine.shapes]
    assert [n for i, n in enumerate(rows) if i == 0 or rows[i - 1] != n] == [1, 2, 1]
    assert {shape[1:] for shape in engine.shapes} == {engine.kv_shape()[1:]}
    assert engine.kv_shape()[0] == 0 and engine.batch_size == 0


def test_a_failing_session_run_fails_that_step_and_the_engine_recovers(
    real_bundle: Bundle, alone: Reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = real_engine(real_bundle, 4)
    run_graph = engine.session.run_with_iobinding
    runs = 0

    def flaky(*args: Any, **kwargs: Any) -> Any:
        nonlocal runs
        runs += 1
        if runs == 3:  # prefill, decode, then this decode fails
            raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : injected")
        return run_graph(*args, **kwargs)

    monkeypatch.setattr(engine.session, "run_with_iobinding", flaky)
    instrumented = Instrumented(engine, alone)

    async def main() -> Completion:
        scheduler = await started(instrumented)
        with pytest.raises(EngineFailure, match=r"request a: the engine failed during decode: .*injected"):
            await collect(scheduler.submit(request("a", prompt_of(4), 10)))
        after = await collect(scheduler.submit(request("b", prompt_of(6), 10)))
        await scheduler.drain(1.0)
        return after

    assert run(main).token_ids == alone(prompt_of(6), 10)
    assert engine.batch_size == 0


LETTERS_TEXT = "abcd"


def tracker_of(tokenizer: Tokenizer, max_new: int = 8) -> RequestTracker:
    return RequestTracker(request("p", prompt_of(3), max_new=max_new), tokenizer, 0, 64, arrival=0.0)


def test_pace_hands_over_the_first_token_at_once_then_at_most_once_per_interval(tokenizer: Tokenizer) -> None:
    tracker = tracker_of(tokenizer)
    a, b, c, d = (TokenEvent([i], LETTERS_TEXT[i], [float(-i)]) for i in range(4))
    assert tracker.pace(a, now=1.0, interval=0.5, flush=False) == a
    assert tracker.pace(b, now=1.2, interval=0.5, flush=False) is None
    assert tracker.pace(None, now=1.3, interval=0.5, flush=False) is None  # a step that produced no text
    assert tracker.pace(c, now=1.5, interval=0.5, flush=False) == TokenEvent([1, 2], "bc", [-1.0, -2.0])
    assert tracker.pace(d, now=1.6, interval=0.5, flush=True) == d  # the request ends: nothing is held back
    assert tracker.pace(None, now=9.0, interval=0.5, flush=True) is None
    unpaced = tracker_of(tokenizer)
    assert [unpaced.pace(e, now=1.0, interval=0.0, flush=False) for e in (a, b)] == [a, b]


def test_a_request_that_does_not_stream_is_handed_over_once_at_the_end(tokenizer: Tokenizer) -> None:
    tracker = RequestTracker(request("u", prompt_of(3), stream=False), tokenizer, 0, 64, arrival=0.0)
    a, b, c = (TokenEvent([i], LETTERS_TEXT[i], []) for i in range(3))
    assert tracker.pace(a, now=1.0, interval=0.0, flush=False) is None  # not even the first token
    assert tracker.pace(b, now=5.0, interval=0.0, flush=False) is None
    assert tracker.pace(c, now=9.0, interval=0.0, flush=True) == TokenEvent([0, 1, 2], "abc", [])


def test_a_request_that_does_not_stream_gets_the_same_text_decoded_once(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("é a😀b").ids  # characters of several byte tokens (none is in the letters)

    decodes: list[list[int]] = []

    class Counting:
        def get_vocab_size(self) -> int:
            return tokenizer.get_vocab_size()

        def decode(self, window: list[int]) -> str:
            decodes.append(list(window))
            return tokenizer.decode(window)

    def text_of(stream: bool) -> tuple[str, str]:
        new = request("t", prompt_of(3), max_new=len(ids), stream=stream)
        tracker = RequestTracker(new, Counting(), 0, 64, 0.0)  # type: ignore[arg-type]
        tracker.admit(0.0)
        completion = Completion("t")
        for step, token in enumerate(ids):
            event, finish = tracker.accept(token, 0.0, now=float(step))
            for item in (tracker.pace(event, float(step), 0.0, flush=finish is not None), finish):
                if item is not None:
                    completion.add(item)
        return completion.text, completion.finish_reason

    assert text_of(stream=False) == ("é a😀b", "length")
    assert decodes == [ids]  # once, at the end
    assert text_of(stream=True) == ("é a😀b", "length") and len(decodes) > len(ids) > 4


def test_a_stream_that_falls_behind_takes_what_is_ready_in_one_go(tokenizer: Tokenizer) -> None:
    async def main() -> None:
        tracker = tracker_of(tokenizer)
        handle = RequestHandle(tracker.request_id, asyncio.get_running_loop(), lambda: None)
        events = [TokenEvent([i], "x", []) for i in range(3)]
        finish = FinishEvent("length", 3, 3, 0, 0.0, 0.0, 0.0)
        for item in (*events, finish):
            handle._push(item)
        coalesced = handle.coalesced()
        assert await anext(coalesced) == TokenEvent.join(events)  # the finish stays for the next read
        assert await anext(coalesced) == finish
        with pytest.raises(StopAsyncIteration):
            await anext(coalesced)

    run(main)


def test_stream_interval_through_the_scheduler_keeps_every_token(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2)

    async def main() -> list[list[TokenEvent | FinishEvent]]:
        scheduler = await started(engine, SchedulerLimits(stream_interval_ms=10_000))
        handles = [scheduler.submit(request(f"r{i}", prompt_of(4 + i), max_new=10)) for i in range(2)]

        async def events(handle: RequestHandle) -> list[TokenEvent | FinishEvent]:
            return [event async for event in handle]

        done = await asyncio.gather(*(events(h) for h in handles))
        await scheduler.drain(1.0)
        return done

    for i, events in enumerate(run(main)):
        *tokens, finish = events
        assert isinstance(finish, FinishEvent) and finish.completion_tokens == 10
        assert [len(e.token_ids) for e in tokens if isinstance(e, TokenEvent)] == [1, 9]
        assert [t for e in tokens if isinstance(e, TokenEvent) for t in e.token_ids] == engine.expected(
            prompt_of(4 + i), 10
        )


def test_unary_requests_get_one_event_beside_streams_that_get_every_step(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2)

    async def main() -> list[list[TokenEvent | FinishEvent]]:
        scheduler = await started(engine)
        handles = [
            scheduler.submit(request("unary", prompt_of(5), max_new=12, stream=False)),
            scheduler.submit(request("stream", prompt_of(6), max_new=12)),
        ]

        async def events(handle: RequestHandle) -> list[TokenEvent | FinishEvent]:
            return [event async for event in handle]

        done = await asyncio.gather(*(events(h) for h in handles))
        await scheduler.drain(1.0)
        return done

    unary, stream = run(main)
    assert len(unary) == 2 and isinstance(unary[1], FinishEvent)
    assert isinstance(unary[0], TokenEvent) and unary[0].token_ids == engine.expected(prompt_of(5), 12)
    assert isinstance(stream[-1], FinishEvent) and len(stream) > 2
    tokens = [t for e in stream if isinstance(e, TokenEvent) for t in e.token_ids]
    assert tokens == engine.expected(prompt_of(6), 12)


def test_a_prompt_continuing_a_finished_one_is_prefilled_from_the_prefix_cache(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_batch_size=2, prefix_cache=True)
    first = prompt_of(10)

    async def main() -> tuple[Completion, Completion, list[int], list[StepRecord]]:
        scheduler = await started(engine)
        a = await collect(scheduler.submit(request("a", first, max_new=6)))
        follow_up = [*first, *a.token_ids, *prompt_of(5, 70)]  # a chat's next turn
        b = await collect(scheduler.submit(request("b", follow_up, max_new=6)))
        await scheduler.drain(1.0)
        return a, b, follow_up, scheduler.steps()

    a, b, follow_up, steps = run(main)
    kept = len(first) + 6 - 1  # a's prompt and answer, but for the last token (never fed back)
    assert a.finish is not None and a.finish.cached_prompt_tokens == 0
    assert b.finish is not None and b.finish.cached_prompt_tokens == kept
    assert b.token_ids == engine.expected(follow_up, 6)
    # The step records count what the engine computed: only the part of the prompt not kept.
    assert [s.real_tokens for s in steps if s.phase == "prefill"] == [len(first), len(follow_up) - kept]


def test_admission_counts_only_what_the_prefix_cache_lacks(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=4, prefix_cache=True)
    first = prompt_of(10)
    limits = SchedulerLimits(max_wait_seconds=0.0, max_prefill_tokens=12)

    async def main() -> tuple[list[Completion], list[StepRecord]]:
        scheduler = await started(engine, limits)
        a = await collect(scheduler.submit(request("a", first, max_new=4)))
        kept = [*first, *a.token_ids[:-1]]  # 13 tokens
        # Two follow-ups of 16 tokens, 3 of them new, around an unrelated 8-token prompt.
        prompts = [[*kept, 60, 61, 62], prompt_of(8, 20), [*kept, 63, 64, 65]]
        handles = [scheduler.submit(request(f"r{i}", p, max_new=3)) for i, p in enumerate(prompts)]
        done = await asyncio.gather(*(collect(h) for h in handles))
        await scheduler.drain(1.0)
        return done, scheduler.steps()

    done, steps = run(main)
    assert [c.finish.cached_prompt_tokens for c in done if c.finish] == [13, 0, 13]
    prefills = [(s.rows, s.padded_tokens, s.real_tokens) for s in steps if s.phase == "prefill"]
    # The first follow-up (3 tokens to compute) and the 8-token prompt fit 12 together; whole prompts would
    # not (2 x 16). The second follow-up waits a step: hits run alone, one a step.
    assert prefills == [(1, 10, 10), (2, 11, 11), (1, 3, 3)]


def test_a_long_lone_prompt_is_prefilled_in_pieces_between_decode_steps(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=3, step_seconds=0.005)  # the first two outlive the late one's pieces
    limits = SchedulerLimits(prefill_chunk_tokens=4)

    async def main() -> tuple[list[Completion], list[StepRecord]]:
        scheduler = await started(engine, limits)
        first = [scheduler.submit(request(f"r{i}", prompt_of(3 + i), max_new=50)) for i in range(2)]
        for handle in first:
            await handle.__anext__()  # both decoding
        late = scheduler.submit(request("late", prompt_of(14, 45), max_new=5))
        done = await asyncio.gather(*(collect(h) for h in [*first, late]))
        await scheduler.drain(1.0)
        return done, scheduler.steps()

    (*_, late), steps = run(main)
    assert late.token_ids == engine.expected(prompt_of(14, 45), 5)
    # The records count each piece's own tokens: 14 = 4 + 4 + 4 + 2 (r0 and r1 were prefilled before).
    assert [(s.rows, s.real_tokens) for s in steps if s.phase == "prefill"][-4:] == [(1, 4)] * 3 + [(1, 2)]
    phases = [phase for phase, _ in engine.calls]
    start = next(i for i, (phase, rows) in enumerate(engine.calls) if rows == ["late"])
    # 14 tokens in pieces of 4: the first piece, then three more, each after a decode step of the others.
    assert phases[start : start + 8] == ["prefill", "decode"] * 4
    assert all("late" not in rows for phase, rows in engine.calls[start : start + 6] if phase == "decode")
    assert any(sorted(rows) == ["late", "r0", "r1"] for _, rows in engine.calls)  # then it decodes


def test_arrivals_while_others_decode_are_split_to_fit_the_chunk(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=8, step_seconds=0.005)
    limits = SchedulerLimits(prefill_chunk_tokens=8)
    prompts = [prompt_of(6, 10 * i) for i in range(5)]

    async def main() -> tuple[list[Completion], list[StepRecord]]:
        scheduler = await started(engine, limits)
        # Idle: no stall to bound, so two arrivals of 6 go together (12 tokens, above the chunk).
        first = [scheduler.submit(request(f"r{i}", prompts[i], max_new=40)) for i in range(2)]
        for handle in first:
            await handle.__anext__()
        # While r0 and r1 decode, three more arrive at once: 6 tokens each, one per prefill step.
        late = [scheduler.submit(request(f"late{i}", prompts[2 + i], max_new=3)) for i in range(3)]
        done = await asyncio.gather(*(collect(h) for h in [*first, *late]))
        await scheduler.drain(1.0)
        return done, scheduler.steps()

    done, steps = run(main)
    for completion, prompt in zip(done[2:], prompts[2:], strict=True):
        assert completion.token_ids == engine.expected(prompt, 3)
    prefills = [(s.rows, s.padded_tokens) for s in steps if s.phase == "prefill"]
    assert prefills == [(2, 12), (1, 6), (1, 6), (1, 6)]
    starts = [i for i, (phase, rows) in enumerate(engine.calls) if phase == "prefill"]
    # Each of the late ones stalls the running streams once, with a decode step before the next one.
    assert all(engine.calls[i + 1][0] == "decode" for i in starts[1:-1])


def test_a_chunked_prefill_that_is_cancelled_frees_its_row(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=2, step_seconds=0.01)

    async def main() -> None:
        scheduler = await started(engine, SchedulerLimits(prefill_chunk_tokens=2))
        running = scheduler.submit(request("r", prompt_of(3), max_new=40))
        await running.__anext__()
        late = scheduler.submit(request("late", prompt_of(30), max_new=5))
        await until(lambda: any(rows == ["late"] for _, rows in engine.calls))
        late.cancel()
        with pytest.raises(Cancelled):
            await collect(late)
        after = scheduler.submit(request("after", prompt_of(5), max_new=3))
        assert len((await collect(after)).token_ids) == 3
        await collect(running)
        await scheduler.drain(1.0)

    run(main)
    assert engine.batch_size == 0


@pytest.mark.parametrize("beside", [True, False])
def test_an_arrival_prefills_beside_the_decode_steps_or_between_them(
    tokenizer: Tokenizer, beside: bool
) -> None:
    engine = fake(tokenizer, 0.002, max_batch_size=4)
    assert isinstance(engine.inner, FakeEngine)
    engine.inner.background_steps = 2  # its run outlasts two decode steps of the running row
    prompt = prompt_of(7, 41)

    async def main() -> tuple[Completion, list[StepRecord]]:
        scheduler = await started(engine, SchedulerLimits(prefill_beside_decode=beside))
        long = scheduler.submit(request("long", prompt_of(4), max_new=30))
        await long.__anext__()
        new = scheduler.submit(request("new", prompt, max_new=5))
        got = await collect(new)
        await collect(long)
        await scheduler.drain(1.0)
        return got, scheduler.steps()

    got, steps = run(main)
    assert got.token_ids == engine.expected(prompt, 5)
    start = engine.calls.index(("prefill", ["new"]))
    after = [rows for _, rows in engine.calls[start + 1 : start + 4]]
    if beside:  # the running row decodes while the arrival prefills, which then joins
        assert after == [["long"], ["long"], ["long", "new"]]
    else:  # the running row waited for the prefill
        assert after[0] == ["long", "new"]
    assert [(s.rows, s.real_tokens) for s in steps if s.phase == "prefill"] == [(1, 4), (1, 7)]


def test_prompts_with_a_prefix_cache_hit_or_to_be_chunked_prefill_between_decode_steps(
    tokenizer: Tokenizer,
) -> None:
    engine = fake(tokenizer, 0.002, max_batch_size=4, keeps_prefixes=True)
    assert isinstance(engine.inner, FakeEngine)
    engine.inner.background_steps = 1

    async def main() -> None:
        limits = SchedulerLimits(prefill_chunk_tokens=8, prefill_beside_decode=True)
        scheduler = await started(engine, limits)
        long = scheduler.submit(request("long", prompt_of(4, 10), max_new=60))
        await long.__anext__()
        await collect(scheduler.submit(request("first", prompt_of(6), max_new=2)))  # beside; kept
        await collect(scheduler.submit(request("again", prompt_of(7), max_new=2)))  # hits "first"
        await collect(scheduler.submit(request("chunked", prompt_of(20, 30), max_new=2)))
        await collect(long)
        await scheduler.drain(1.0)

    run(main)
    after = {
        rows[0]: engine.calls[i + 1][1]
        for i, (phase, rows) in enumerate(engine.calls)
        if rows and phase == "prefill"
    }
    assert after["first"] == ["long"]  # the running row decoded beside it
    assert "again" in after["again"]  # joined before the next decode step
    assert "chunked" not in engine.calls[engine.calls.index(("prefill", ["chunked"])) + 1][1]


def test_a_request_cancelled_while_it_prefills_beside_the_decode_steps_frees_its_row(
    tokenizer: Tokenizer,
) -> None:
    engine = fake(tokenizer, 0.002, max_batch_size=2)
    assert isinstance(engine.inner, FakeEngine)
    engine.inner.background_steps = 1000  # until nothing else decodes

    async def main() -> None:
        scheduler = await started(engine, SchedulerLimits(prefill_beside_decode=True))
        running = scheduler.submit(request("r", prompt_of(3), max_new=30))
        await running.__anext__()
        late = scheduler.submit(request("late", prompt_of(8), max_new=5))
        await until(lambda: ("prefill", ["late"]) in engine.calls)
        late.cancel()
        with pytest.raises(Cancelled):
            await collect(late)
        assert len((await collect(running)).token_ids) == 29  # and its first
        after = scheduler.submit(request("after", prompt_of(5), max_new=3))
        assert (await collect(after)).token_ids == engine.expected(prompt_of(5), 3)
        assert scheduler.snapshot().outcomes == {"cancelled": 1, "finished": 2}
        await scheduler.drain(1.0)

    run(main)
    assert not any("late" in rows for phase, rows in engine.calls if phase == "decode")
    assert engine.batch_size == 0


def test_a_prefill_that_fails_beside_the_decode_steps_fails_only_its_requests(tokenizer: Tokenizer) -> None:
    engine = fake(tokenizer, 0.002, max_batch_size=4)

    async def main() -> None:
        scheduler = await started(engine, SchedulerLimits(prefill_beside_decode=True))
        running = scheduler.submit(request("r", prompt_of(3), max_new=20))
        await running.__anext__()
        engine.fail_next.add("end_prefill")
        doomed = scheduler.submit(request("doomed", prompt_of(6), max_new=5))
        with pytest.raises(EngineFailure, match=r"during prefill.*injected end_prefill"):
            await collect(doomed)
        rest = await collect(running)
        assert [*rest.token_ids] == engine.expected(prompt_of(3), 20)[1:]
        after = scheduler.submit(request("after", prompt_of(5), max_new=3))
        assert (await collect(after)).token_ids == engine.expected(prompt_of(5), 3)
        await scheduler.drain(1.0)

    run(main)
    assert engine.batch_size == 0


def test_a_prefill_that_fails_to_start_beside_the_decode_steps_fails_only_its_requests(
    tokenizer: Tokenizer,
) -> None:
    engine = fake(tokenizer, 0.002, max_batch_size=4)

    async def main() -> Scheduler:
        scheduler = await started(engine, SchedulerLimits(prefill_beside_decode=True))
        running = scheduler.submit(request("r", prompt_of(3), max_new=20))
        await running.__anext__()
        engine.fail_next.add("prefill")  # begin_prefill raises: its run never starts
        doomed = scheduler.submit(request("doomed", prompt_of(6), max_new=5))
        with pytest.raises(EngineFailure, match=r"request doomed: the engine failed during prefill"):
            await collect(doomed)
        assert (await collect(running)).token_ids == engine.expected(prompt_of(3), 20)[1:]
        await expect_later_requests_succeed(scheduler, engine)
        return scheduler

    scheduler = run(main)
    assert ("prefill", ["doomed"]) in engine.calls
    assert not any("doomed" in rows for phase, rows in engine.calls if phase == "decode")
    # Nothing was joined for it: the prefill records are r's and the later request's.
    assert [(s.rows, s.real_tokens) for s in scheduler.steps() if s.phase == "prefill"] == [(1, 3), (1, 4)]
    assert scheduler.snapshot().outcomes == {"failed": 1, "finished": 2}

"""Scheduler: admission and continuous batching on a deterministic fake engine and on the real engine of a
tiny bundle (the `make_engine` fixture runs a test on both)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
from scheduler_fakes import FakeEngine, Instrumented, fake, hold_compiles
from scheduler_runs import (
    EngineFactory,
    Reference,
    collect,
    prompt_of,
    real_engine,
    request,
    run,
    started,
    until,
)
from tokenizers import Tokenizer

from serve.api.metrics import Metrics, new_registry
from serve.bundle import Bundle
from serve.engine.types import Constraint
from serve.errors import QueueFull
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, RequestState, RequestTracker, TokenEvent
from serve.scheduling.runner import BatchRunner
from serve.scheduling.scheduler import Scheduler


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


def test_the_priority_policy_serves_the_queue_by_priority_then_arrival(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=1)
    engine.gate.clear()
    order = [("b", 5), ("c", 1), ("d", 1), ("e", -3)]

    async def main() -> None:
        scheduler = await started(engine, SchedulerLimits(scheduling_policy="priority", max_queue=4))
        running = scheduler.submit(request("a", prompt_of(3), max_new=2, priority=9))
        await until(lambda: len(engine.calls) == 1)  # "a" is in the engine, held on the gate
        queued = [scheduler.submit(request(r, prompt_of(3), max_new=2, priority=p)) for r, p in order]
        # The queue limit counts every waiting request, whatever its priority.
        with pytest.raises(QueueFull, match="queue is full"):
            scheduler.submit(request("f", prompt_of(3), priority=-100))
        engine.gate.set()
        for handle in (running, *queued):
            assert (await collect(handle)).finish_reason == "length"
        await scheduler.drain(1.0)

    run(main)
    prefills = [rows for phase, rows in engine.calls if phase == "prefill"]
    assert prefills == [["a"], ["e"], ["c"], ["d"], ["b"]]


def test_requests_are_counted_by_priority_clamped_to_the_labels_bound(tokenizer: Tokenizer) -> None:
    engine, metrics = fake(tokenizer, max_batch_size=1), Metrics(new_registry())
    runner = BatchRunner(engine, SchedulerLimits(scheduling_policy="priority").resolve(engine), metrics)
    for rid, priority in (("a", 1000), ("b", -1), ("c", 12)):
        runner.enqueue(runner.track(request(rid, prompt_of(3), max_new=2, priority=priority)))

    def by_priority(kind: str) -> dict[str, float]:
        family = next(
            f for f in metrics.registry.collect() if f.name == f"textgen_requests_{kind}_by_priority"
        )
        return {s.labels["priority"]: s.value for s in family.samples if s.value}

    runner.step()  # admits "b" alone: one row
    assert (by_priority("waiting"), by_priority("running")) == ({"10": 2}, {"-1": 1})
    while not runner.idle:
        runner.step()
    assert by_priority("waiting") == by_priority("running") == {}


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


def test_the_queue_gauge_counts_arrivals_during_a_long_step_and_compiling_requests(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiles = threading.Event()
    hold_compiles(monkeypatch, compiles)
    engine = fake(tokenizer)
    engine.gate.clear()  # the first prefill holds the engine thread, as a long prompt's would
    metrics = Metrics(new_registry())

    def waiting() -> tuple[float | None, float | None]:
        sample = metrics.registry.get_sample_value
        return sample("textgen_requests_waiting"), sample("vllm:num_requests_waiting")

    async def main() -> None:
        scheduler = await started(engine, metrics=metrics)
        first = scheduler.submit(request("first", prompt_of(3), max_new=2))
        await until(lambda: bool(engine.calls))  # its prefill has begun
        plain = scheduler.submit(request("plain", prompt_of(4), max_new=2))
        regex = Constraint.regex("[a-c]+")
        constrained = scheduler.submit(request("constrained", prompt_of(5), max_new=2, constraint=regex))
        assert waiting() == (2, 2)  # no step has ended since they came
        engine.gate.set()
        await collect(plain)
        assert waiting() == (1, 1)  # still compiling, so still waiting
        compiles.set()
        await asyncio.gather(collect(first), collect(constrained))
        assert waiting() == (0, 0)
        await scheduler.drain(1.0)

    run(main)


def test_illegal_state_transitions_are_refused(tokenizer: Tokenizer) -> None:

    tracker = RequestTracker(request("x", prompt_of(3)), tokenizer, 0, 64, arrival=0.0)
    with pytest.raises(RuntimeError, match="illegal transition queued -> finished"):
        tracker.end(RequestState.FINISHED, 1.0)
    tracker.end(RequestState.CANCELLED, 1.0)
    with pytest.raises(RuntimeError, match="cancelled -> prefilling"):
        tracker.admit(2.0)


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

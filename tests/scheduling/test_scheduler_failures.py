"""Scheduler: cancels, deadlines, drain and failures, each confined to the requests it concerns while serving
goes on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from scheduler_fakes import Instrumented, fake
from scheduler_runs import (
    EngineFactory,
    Reference,
    collect,
    expect_later_requests_succeed,
    prompt_of,
    real_engine,
    request,
    run,
    started,
    until,
)
from tokenizers import Tokenizer

from serve.bundle import Bundle
from serve.errors import Cancelled, DeadlineExceeded, Draining, EngineFailure
from serve.scheduling.request import Completion
from serve.scheduling.scheduler import Scheduler


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


def test_a_request_that_fails_mid_step_drops_the_steps_later_tokens(tokenizer: Tokenizer) -> None:
    """A speculating step gives a sequence several tokens; one that ends it (undecodable) ends only it."""
    engine = fake(tokenizer, max_batch_size=4, step_seconds=0.002, speculation=(1, 1))  # two tokens a step

    async def main() -> None:
        scheduler = await started(engine)
        bystander = scheduler.submit(request("bystander", prompt_of(3), max_new=9))  # ends mid-step
        victim = scheduler.submit(request("victim", prompt_of(3), max_new=10))
        await victim.__anext__()  # its first token (the prefill's) is fine; its decode steps' are not
        engine.poisoned.add("victim")
        with pytest.raises(EngineFailure, match="request victim: its output could not be processed"):
            await collect(victim)
        assert len((await collect(bystander)).token_ids) == 9
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

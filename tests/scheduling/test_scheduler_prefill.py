"""Scheduler: prefill from the prefix cache, chunked prefill of long prompts and prefill beside the decode
steps."""

from __future__ import annotations

import asyncio

import pytest
from scheduler_fakes import FakeEngine, fake
from scheduler_runs import (
    EngineFactory,
    collect,
    expect_later_requests_succeed,
    prompt_of,
    request,
    run,
    started,
    until,
)
from tokenizers import Tokenizer

from serve.errors import Cancelled, EngineFailure
from serve.scheduling.intake import StepRecord
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion
from serve.scheduling.scheduler import Scheduler


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
    kept = len(first)  # a's prompt: its answer, computed by decode steps, is prefilled again
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
        assert a.finish is not None and a.finish.cached_prompt_tokens == 0
        # Two follow-ups of 13 tokens, 3 of them new, around an unrelated 8-token prompt.
        prompts = [[*first, 60, 61, 62], prompt_of(8, 20), [*first, 63, 64, 65]]
        handles = [scheduler.submit(request(f"r{i}", p, max_new=3)) for i, p in enumerate(prompts)]
        done = await asyncio.gather(*(collect(h) for h in handles))
        await scheduler.drain(1.0)
        return done, scheduler.steps()

    done, steps = run(main)
    assert [c.finish.cached_prompt_tokens for c in done if c.finish] == [10, 0, 10]
    prefills = [(s.rows, s.padded_tokens, s.real_tokens) for s in steps if s.phase == "prefill"]
    # The first follow-up (3 tokens to compute) and the 8-token prompt fit 12 together; whole prompts would
    # not (2 x 13). The second follow-up waits a step: hits run alone, one a step.
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

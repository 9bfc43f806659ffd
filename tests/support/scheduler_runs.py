"""What the scheduler tests share: requests and prompts, an engine factory's type, running a test's
coroutine with a bound, waiting for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

from scheduler_fakes import Instrumented

from serve.bundle import Bundle
from serve.engine.engine import Engine
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings
from serve.scheduling.handles import RequestHandle
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, GenerationRequest
from serve.scheduling.scheduler import Scheduler

T = TypeVar("T")
Reference = Callable[[Sequence[int], int], list[int]]
# One intra-op thread: the test's event loop needs the other core.
SESSION = SessionConfig(threads=1, spinning=False)


class EngineFactory(Protocol):
    def __call__(
        self, max_batch_size: int = 4, step_seconds: float = 0.0, prefix_cache: bool = False
    ) -> Instrumented: ...


def real_engine(bundle: Bundle, max_batch_size: int, prefix_cache_rows: int = 0) -> Engine:
    settings = EngineSettings(
        max_batch_size=max_batch_size,
        session=SESSION,
        prefix_cache_rows=prefix_cache_rows,
        prefix_cache_min_tokens=4,
    )
    return Engine.from_bundle(bundle, settings)


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


async def expect_later_requests_succeed(scheduler: Scheduler, engine: Instrumented) -> None:
    after = await collect(scheduler.submit(request("after", prompt_of(4), max_new=4)))
    assert after.token_ids == engine.expected(prompt_of(4), 4)
    await until(lambda: engine.batch_size == 0)
    await scheduler.drain(1.0)

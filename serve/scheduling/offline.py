"""Offline generation on an engine: no server, no asyncio, no thread.

All prompts go through the scheduler's `BatchRunner` (the same admission, batching and per-request stopping
as the server), driven in a plain loop on the calling thread. Benchmarks and tests use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint
from serve.errors import EngineFailure, InvalidRequest, TextgenError
from serve.scheduling.engine_protocol import BatchEngine
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import Completion, GenerationRequest, RequestTracker
from serve.scheduling.runner import BatchRunner

# Offline callers hand over all their work at once: nothing is gained by waiting for more arrivals.
OFFLINE_LIMITS = SchedulerLimits(max_wait_seconds=0.0)
GREEDY = SamplingParams()


def generate(
    engine: BatchEngine,
    prompts: Sequence[str | Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    *,
    max_new_tokens: int = 64,
    stop: tuple[str, ...] = (),
    ignore_eos: bool = False,
    include_logprobs: bool = False,
    min_new_tokens: int = 0,
    stop_token_ids: tuple[int, ...] = (),
    top_logprobs: int = 0,
    prompt_logprobs: bool = False,
    prompt_top_logprobs: int = 0,
    constraint: Constraint | Sequence[Constraint | None] | None = None,
    limits: SchedulerLimits = OFFLINE_LIMITS,
) -> list[Completion]:
    """Complete every prompt (text, or token ids) and return the completions in prompt order.

    A generation that reaches the engine's capacity ends with finish reason `context` instead of being
    refused. `constraint`: one for every prompt, or one each (None: unconstrained). Raises InvalidRequest for
    a bad prompt or constraint and EngineFailure if an engine step fails.
    """
    params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
    if len(params) != len(prompts):
        raise InvalidRequest(f"{len(params)} sampling parameter sets for {len(prompts)} prompts")
    if constraint is None or isinstance(constraint, Constraint):
        constraints: list[Constraint | None] = [constraint] * len(prompts)
    else:
        constraints = list(constraint)
    if len(constraints) != len(prompts):
        raise InvalidRequest(f"{len(constraints)} constraints for {len(prompts)} prompts")
    runner = BatchRunner(engine, limits.model_copy(update={"max_queue": len(prompts)}).resolve(engine))
    trackers = [
        runner.track(
            GenerationRequest(
                request_id=f"offline-{index}",
                prompt_ids=_token_ids(engine, prompt),
                sampling=params[index],
                max_new_tokens=max_new_tokens,
                stop=stop,
                ignore_eos=ignore_eos,
                include_logprobs=include_logprobs,
                stream=False,
                stop_token_ids=stop_token_ids,
                min_new_tokens=min_new_tokens,
                top_logprobs=top_logprobs,
                prompt_logprobs=prompt_logprobs,
                prompt_top_logprobs=prompt_top_logprobs,
                constraint=constraints[index],
            ),
            stop_at_context=True,
        )
        for index, prompt in enumerate(prompts)
    ]
    for tracker in trackers:
        runner.enqueue(tracker)
    return _run(runner, trackers)


def _run(runner: BatchRunner, trackers: list[RequestTracker]) -> list[Completion]:
    completions = {t.request_id: Completion(t.request_id) for t in trackers}
    try:
        while not runner.idle:
            runner.wait_for_work(lambda: False)  # only constraints compiling: until one is
            for tracker, item in runner.step():
                if isinstance(item, TextgenError):
                    raise item
                completions[tracker.request_id].add(item)
    except BaseException:
        runner.abort(_abandoned)  # free the engine's rows for whoever uses it next
        raise
    return list(completions.values())


def _token_ids(engine: BatchEngine, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(engine.tokenizer.encode(prompt).ids)
    return [int(token) for token in prompt]


def _abandoned(tracker: RequestTracker) -> TextgenError:
    return EngineFailure(f"request {tracker.request_id}: abandoned after another request failed")

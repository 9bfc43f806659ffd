"""Preemption under the priority policy, step by step: an urgent request takes a busy row at once, and the
requests it preempted finish with the very tokens they give when nobody preempts them (greedy and seeded),
on the fake engine and on the tiny bundle's real one; within --swap-space, and beside LoRA slots on a tiny
LoRA bundle's engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from scheduler_fakes import Instrumented
from scheduler_runs import EngineFactory, prompt_of

from serve.api.metrics import Metrics, new_registry
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings
from serve.errors import Draining, TextgenError
from serve.scheduling.engine_protocol import BatchEngine
from serve.scheduling.intake import draining_error
from serve.scheduling.limits import DEFAULT_SWAP_SPACE, SchedulerLimits
from serve.scheduling.request import Completion, FinishEvent, GenerationRequest
from serve.scheduling.runner import BatchRunner

# Greedy, and seeded sampling with a penalty: both carry state across the pause.
LOW = {
    "greedy": SamplingParams(repetition_penalty=1.2),
    "seeded": SamplingParams(temperature=1.0, seed=3, presence_penalty=0.5),
}
LOW_TOKENS, URGENT_TOKENS = 12, 3
PROMPT = tuple(prompt_of(5))


class Served:
    """What one run gave: each request's completion, the order they finished in, the preemptions counted."""

    def __init__(
        self,
        engine: BatchEngine,
        policy: str,
        stream_interval_ms: float = 0.0,
        swap_space: int = DEFAULT_SWAP_SPACE,
    ) -> None:
        self.metrics = Metrics(new_registry())
        limits = SchedulerLimits(
            scheduling_policy=policy,
            max_wait_seconds=0.0,
            stream_interval_ms=stream_interval_ms,
            swap_space=swap_space,
        ).resolve(engine)
        self.runner = BatchRunner(engine, limits, self.metrics)
        self.completions: dict[str, Completion] = {}
        self.finished: list[str] = []

    def submit(
        self,
        rid: str,
        params: SamplingParams,
        max_new: int,
        priority: int,
        stream: bool = True,
        adapter: str = "",
        prompt: Sequence[int] = PROMPT,
    ) -> None:
        request = GenerationRequest(
            rid,
            list(prompt),
            params,
            max_new,
            ignore_eos=True,
            priority=priority,
            stream=stream,
            adapter=adapter,
        )
        self.runner.enqueue(self.runner.track(request))
        self.completions[rid] = Completion(rid)

    def step(self) -> list[str]:
        """One step; the ids of the requests it gave tokens to."""
        given = []
        for tracker, item in self.runner.step():
            assert not isinstance(item, TextgenError), item
            self.completions[tracker.request_id].add(item)
            if isinstance(item, FinishEvent):
                self.finished.append(tracker.request_id)
            else:
                given.append(tracker.request_id)
        return given

    def sample(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)

    @property
    def preemptions(self) -> float | None:
        return self.sample("textgen_preemptions_total")

    def finish(self) -> None:
        while not self.runner.idle:
            self.step()


def serve(engine: Instrumented, policy: str, swap_space: int = DEFAULT_SWAP_SPACE) -> Served:
    """The two low-priority requests fill both rows; after a few steps an urgent one arrives."""
    served = Served(engine, policy, swap_space=swap_space)
    for rid, params in LOW.items():
        served.submit(rid, params, LOW_TOKENS, priority=5)
    for _ in range(4):  # their prefill and three decode steps
        served.step()
    served.submit("urgent", SamplingParams(), URGENT_TOKENS, priority=0)
    served.finish()
    return served


def test_an_urgent_request_preempts_and_the_preempted_finish_as_if_never_paused(
    make_engine: EngineFactory,
) -> None:
    unpaused = serve(make_engine(max_batch_size=2), "fcfs")
    assert unpaused.finished[-1] == "urgent" and unpaused.preemptions == 0  # fcfs: it waited for a row
    engine = make_engine(max_batch_size=2)
    paused = serve(engine, "priority")
    assert paused.finished[0] == "urgent" and paused.preemptions == 1
    swaps = [(phase, rows) for phase, rows in engine.calls if phase.startswith("swap")]
    assert swaps == [("swap_out", ["seeded"]), ("swap_in", ["seeded"])]  # the later arrival of the two
    for rid in LOW:
        completion = paused.completions[rid]
        assert completion.token_ids == unpaused.completions[rid].token_ids
        assert len(completion.token_ids) == LOW_TOKENS and completion.finish_reason == "length"
    assert paused.completions["urgent"].token_ids == unpaused.completions["urgent"].token_ids
    assert engine.swapped_bytes == 0 and paused.sample("textgen_preempted_kv_bytes") == 0


def test_past_swap_space_the_urgent_request_waits_for_a_row(make_engine: EngineFactory) -> None:
    unpaused = serve(make_engine(max_batch_size=2), "fcfs")
    engine = make_engine(max_batch_size=2)
    capped = serve(engine, "priority", swap_space=1)  # no row's host copy is that small
    assert capped.preemptions == 0 and not [phase for phase, _ in engine.calls if phase.startswith("swap")]
    assert capped.finished == unpaused.finished and capped.finished[-1] == "urgent"  # as under fcfs
    for rid, completion in capped.completions.items():  # nothing failed, nothing was lost
        assert (
            completion.token_ids == unpaused.completions[rid].token_ids
            and completion.finish_reason == "length"
        )


def test_a_preempted_request_cancelled_in_the_queue_leaves_nothing_behind(make_engine: EngineFactory) -> None:
    engine = make_engine(max_batch_size=1)
    served = Served(engine, "priority")
    served.submit("low", SamplingParams(), LOW_TOKENS, priority=1)
    served.step()
    served.step()
    served.submit("urgent", SamplingParams(), URGENT_TOKENS, priority=0)
    served.step()  # "low" is swapped out for it
    assert engine.swapped_bytes > 0 and served.sample("textgen_preempted_kv_bytes") == engine.swapped_bytes
    served.runner.request_cancel("low")
    cancelled = served.runner.step()
    assert [
        (t.request_id, type(item).__name__) for t, item in cancelled if isinstance(item, TextgenError)
    ] == [("low", "Cancelled")]
    assert engine.swapped_bytes == 0


def test_a_preempted_stream_gets_the_tokens_pacing_held_when_it_pauses(make_engine: EngineFactory) -> None:
    # Pacing holds every token after the first for 10 s; a pause must not hold them too.
    engine = make_engine(max_batch_size=2)
    served = Served(engine, "priority", stream_interval_ms=10_000)
    served.submit("streamed", SamplingParams(), LOW_TOKENS, priority=1)
    served.submit("whole", SamplingParams(), LOW_TOKENS, priority=1, stream=False)
    for _ in range(4):
        served.step()
    assert len(served.completions["streamed"].token_ids) == 1
    served.submit("urgent", SamplingParams(), URGENT_TOKENS, priority=0)
    served.submit("urgent2", SamplingParams(), URGENT_TOKENS, priority=0)
    given = served.step()  # both are preempted
    assert served.preemptions == 2
    assert "streamed" in given and len(served.completions["streamed"].token_ids) == 4
    assert "whole" not in given  # a request that does not stream still gets everything at the end
    while not served.runner.idle:
        served.step()
    assert [len(served.completions[r].token_ids) for r in ("streamed", "whole")] == [LOW_TOKENS] * 2


def test_draining_refuses_the_queued_requests_but_lets_a_preempted_one_finish(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(max_batch_size=1)
    served = Served(engine, "priority")
    served.submit("low", SamplingParams(), LOW_TOKENS, priority=1)
    served.step()
    served.step()  # past its prefill: no preemption right after one
    served.submit("urgent", SamplingParams(), URGENT_TOKENS, priority=0)
    served.step()  # "low" is swapped out for it
    assert served.preemptions == 1
    served.submit("queued", SamplingParams(), URGENT_TOKENS, priority=1)
    refused = served.runner.reject_waiting(draining_error)
    assert [(t.request_id, type(item)) for t, item in refused] == [("queued", Draining)]
    while not served.runner.idle:
        served.step()
    assert served.finished == ["urgent", "low"]
    assert len(served.completions["low"].token_ids) == LOW_TOKENS


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The tiny LoRA bundle with one slot, and its peft adapters (support/lora_adapters.py)."""
    from lora_adapters import lora_bundle

    return lora_bundle(tmp_path_factory.mktemp("one-slot"), slots=1)


def test_a_preempted_request_resumes_once_its_adapter_has_the_slot_again(
    one_slot: tuple[Path, dict[str, Path]],
) -> None:
    """1 slot, 2 rows: "low" (sql) is preempted for "urgent" (poet), whose adapter takes the slot; when the
    base model's "mid" finishes, a row frees but the slot is still poet's, so "low" resumes only after."""
    root, adapters = one_slot
    bundle = load_bundle(root)
    named = tuple((name, str(folder)) for name, folder in adapters.items())

    def served() -> Served:
        engine = Engine.from_bundle(bundle, EngineSettings(max_batch_size=2, adapters=named))
        return Served(engine, "priority")

    prompt = bundle.tokenizer.encode("def main():").ids

    def submit_low(run: Served) -> None:
        run.submit("low", LOW["seeded"], LOW_TOKENS, priority=5, adapter="sql", prompt=prompt)

    alone = served()
    submit_low(alone)
    alone.finish()
    run = served()
    submit_low(run)
    run.submit("mid", SamplingParams(), URGENT_TOKENS + 3, priority=1, prompt=prompt)
    for _ in range(4):  # their prefill and three decode steps
        run.step()
    run.submit("urgent", SamplingParams(), URGENT_TOKENS + 4, priority=0, adapter="poet", prompt=prompt)
    run.finish()  # no request fails (Served.step)
    assert run.preemptions == 1 and run.finished == ["mid", "urgent", "low"]
    assert run.completions["low"].token_ids == alone.completions["low"].token_ids
    assert len(run.completions["low"].token_ids) == LOW_TOKENS

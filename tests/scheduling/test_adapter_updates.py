"""Adapter updates on the runner: made by the engine thread at the start of a step, never beside one; an
unload refused while a queued request uses the adapter; a request for an adapter gone meanwhile cannot
queue; and the adapters' metric hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings
from serve.errors import Draining, InvalidRequest, NotFound
from serve.scheduling.adapters import LoadAdapter, UnloadAdapter, read_load
from serve.scheduling.engine_core import MetricRecorder
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import GenerationRequest
from serve.scheduling.runner import BatchRunner


def runner_of(bundle: Bundle, recorder: MetricRecorder | None = None) -> BatchRunner:
    engine = Engine.from_bundle(bundle, EngineSettings(max_batch_size=2))
    return BatchRunner(engine, SchedulerLimits().resolve(engine), recorder)


def request(rid: str, adapter: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(), 4, ignore_eos=True, adapter=adapter)


def load(bundle: Bundle, folder: Path, name: str) -> LoadAdapter:
    assert bundle.manifest.lora is not None
    return read_load(name, str(folder), bundle.manifest.lora)


def test_updates_wait_for_a_step_and_an_unload_spares_queued_requests(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    root, adapters = lora_bundle
    bundle = load_bundle(root)
    recorder = MetricRecorder()
    runner = runner_of(bundle, recorder)
    loaded = runner.request_update(load(bundle, adapters["poet"], "poet"))
    assert not loaded.done() and runner.ready  # the engine thread makes it, at its next step
    runner.step()
    assert loaded.result() == ("poet",)
    with pytest.raises(NotFound, match="adapter 'chef' is not loaded"):
        runner.enqueue(runner.track(request("early", "chef")))
    runner.enqueue(runner.track(request("queued", "poet")))
    unload = runner.request_update(UnloadAdapter("poet"))
    runner.step()  # the update comes first: the request is still queued
    with pytest.raises(InvalidRequest, match="in use by 1 running or queued requests"):
        unload.result()
    while not runner.idle:
        runner.step()
    calls = dict(recorder.take())
    assert calls["on_adapter_request"] == ("poet",)
    assert calls["on_adapter_slots"] == (1, 0)
    assert calls["set_lora_requests"] == (2, "", "")  # the latest: nothing running or waiting
    unload = runner.request_update(UnloadAdapter("poet"))
    runner.step()
    assert unload.result() == ()
    with pytest.raises(NotFound, match="adapter 'poet' is not loaded"):
        runner.enqueue(runner.track(request("late", "poet")))


def test_a_bundle_without_slots_takes_no_update(
    tiny_bundle: Path, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    root, adapters = lora_bundle
    runner = runner_of(load_bundle(tiny_bundle))
    update = runner.request_update(load(load_bundle(root), adapters["poet"], "poet"))
    runner.step()
    with pytest.raises(InvalidRequest, match="has no LoRA slots"):
        update.result()


def test_updates_not_made_when_the_engine_thread_stops_are_refused(tiny_bundle: Path) -> None:
    runner = runner_of(load_bundle(tiny_bundle))
    update = runner.request_update(UnloadAdapter("sql"))
    runner.drop_updates(Draining("the server is shutting down"))
    with pytest.raises(Draining):
        update.result(timeout=0)
    assert runner.idle

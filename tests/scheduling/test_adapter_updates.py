"""Adapter updates on the runner: made by the engine thread at the start of a step, never beside one; an
unload of an adapter that running or queued requests use deferred until they end, under steady traffic too;
a request for an adapter gone (or going) meanwhile cannot queue; and the adapters' metric hooks."""

from __future__ import annotations

from pathlib import Path

import pytest

from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings
from serve.errors import Draining, InvalidRequest, NotFound
from serve.scheduling.adapters import LoadAdapter, UnloadAdapter, UpdateResult, read_load
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
    assert loaded.result() == UpdateResult(("poet",))
    with pytest.raises(NotFound, match="adapter 'chef' is not loaded"):
        runner.enqueue(runner.track(request("early", "chef")))
    runner.enqueue(runner.track(request("queued", "poet")))
    unload = runner.request_update(UnloadAdapter("poet"))
    runner.step()  # the update comes first: the request is still queued, and runs with it all the same
    assert unload.result() == UpdateResult((), deferred=1)
    with pytest.raises(NotFound, match="adapter 'poet' is not loaded"):
        runner.enqueue(runner.track(request("late", "poet")))
    assert runner.engine.retiring_adapters == ("poet",)
    while not runner.idle:
        runner.step()
    assert runner.engine.retiring_adapters == () and runner.engine.adapter_names == ()
    calls = dict(recorder.take())
    assert calls["on_adapter_request"] == ("poet",)
    assert calls["on_adapter_slots"] == (1, 0)
    assert calls["set_lora_requests"] == (2, "", "")  # the latest: nothing running or waiting
    again = runner.request_update(load(bundle, adapters["poet"], "poet"))
    runner.step()
    assert again.result() == UpdateResult(("poet",))
    unload = runner.request_update(UnloadAdapter("poet"))
    runner.step()
    assert unload.result() == UpdateResult(())


def test_an_unload_under_steady_traffic_ends_once_the_adapters_requests_do(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    """Requests for the adapter keep arriving, running and queued: the unload is not refused; it refuses
    the new ones, and the adapter goes once its last accepted request ends, while base requests go on."""
    root, adapters = lora_bundle
    bundle = load_bundle(root)
    runner = runner_of(bundle)
    runner.request_update(load(bundle, adapters["poet"], "poet"))
    runner.step()
    for i in range(4):  # more than the 2 rows: some run, some wait
        runner.enqueue(runner.track(request(f"poet-{i}", "poet")))
    runner.step()  # two run, two wait
    unload = runner.request_update(UnloadAdapter("poet"))
    runner.step()
    assert unload.result() == UpdateResult((), deferred=4)
    refused, base = 0, 0
    while runner.engine.retiring_adapters:
        try:
            runner.enqueue(runner.track(request(f"poet-more-{refused}", "poet")))
        except NotFound:
            refused += 1
        runner.enqueue(runner.track(request(f"base-{base}", "")))
        base += 1
        runner.step()
        assert base < 200, "the unload never ended"
    assert refused == base > 0 and not runner.idle  # every later request for it refused; base traffic goes on
    assert "poet" not in runner.engine.adapter_names and runner.engine.retiring_adapters == ()


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

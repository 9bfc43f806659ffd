"""LoRA adapters loaded and unloaded while the server runs (--lora-runtime-updates): vLLM's routes behind the
bearer token, the adapter served as an adapter given at start is, refusals that change nothing, and the
metrics the inference gateway routes by; with the engine in its own process and in the server's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from engine_faults import InjectedFaults
from lora_adapters import MAX_RANK, SLOTS, completion, expected, save_adapter
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

TOKEN = "adapters-secret"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
INFO = "vllm:lora_requests_info"


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "in-process"])
def running(
    request: pytest.FixtureRequest, loop: LoopThread, lora_bundle: tuple[Path, dict[str, Path]]
) -> Iterator[RunningServer]:
    """A server with "sql" loaded at start and runtime updates on; requests "slow-..." decode slowly."""
    bundle, adapters = lora_bundle
    settings = loopback_settings(
        bundle,
        http_port=free_port(),
        lora=[("sql", adapters["sql"])],
        lora_runtime_updates=True,
        auth_token=TOKEN,
        engine_process=request.param,
    )
    server = RunningServer(loop, settings, InjectedFaults(slow_seconds=0.05))
    yield server
    loop.run(server.server.stop())


def client(running: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.http_base}/v1", api_key=TOKEN, max_retries=0, timeout=30)


def post(running: RunningServer, path: str, token: str | None = TOKEN, **body: Any) -> httpx.Response:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.post(running.http_base + path, json=body, headers=headers, timeout=30)


def refused(answer: httpx.Response, status: int, message: str) -> None:
    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]["message"], answer.text


def served(running: RunningServer) -> set[str]:
    """The adapters /v1/models lists, once GetModelInfo lists the same."""
    listed = {m.id for m in client(running).models.list().data} - {running.model.name}
    with grpc.insecure_channel(running.target) as channel:
        info = pb_grpc.TextGenerationStub(channel).GetModelInfo(
            pb.GetModelInfoRequest(), metadata=[("authorization", f"Bearer {TOKEN}")]
        )
    assert set(info.adapters) == listed
    return listed


def test_the_gateway_sees_the_slots_and_the_start_loads_before_any_request(running: RunningServer) -> None:
    idle = {"max_lora": str(SLOTS), "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert wait_for_metric(running, INFO, **idle) <= time.time()
    assert wait_for_metric(running, "textgen_lora_slot_loads_total") == 1  # "sql", into a free slot


def test_a_loaded_adapter_is_served_as_one_given_at_start_until_unloaded(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    bundle, adapters = lora_bundle
    loaded = post(running, LOAD, lora_name="poet", lora_path=str(adapters["poet"]))
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'poet' added successfully.")
    assert served(running) == {"sql", "poet"}
    texts = {name: completion(client(running), name) for name in ("poet", "sql", running.model.name)}
    assert texts["poet"] == expected(bundle, adapters, "poet")
    assert texts["sql"] == expected(bundle, adapters, "sql")
    assert texts[running.model.name] == expected(bundle, adapters, "")
    unloaded = post(running, UNLOAD, lora_name="poet")
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'poet' removed successfully.",
    )
    assert served(running) == {"sql"} and running.model.info.adapters == ("sql",)
    with pytest.raises(openai.NotFoundError):
        completion(client(running), "poet")
    refused(post(running, UNLOAD, lora_name="poet"), 404, "no adapter named 'poet' is loaded")


def test_more_adapters_than_slots_can_be_loaded(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    """Loaded adapters take turns in the slots as those given at start do."""
    bundle, adapters = lora_bundle
    for name in ("poet", "chef"):
        assert post(running, LOAD, lora_name=name, lora_path=str(adapters[name])).status_code == 200
    assert len(served(running)) == SLOTS + 1
    for name in ("chef", "poet", "sql", "chef"):
        assert completion(client(running), name) == expected(bundle, adapters, name)
    for name in ("poet", "chef"):
        assert post(running, UNLOAD, lora_name=name).status_code == 200


def test_what_cannot_be_loaded_is_refused_and_nothing_changes(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    bundle, adapters = lora_bundle
    too_wide = save_adapter(tmp_path / "wide", seed=9, rank=MAX_RANK * 2)
    cases = [
        ("sql", adapters["poet"], "an adapter named 'sql' is already loaded"),
        (running.model.name, adapters["poet"], "has the model's own name"),
        ("", adapters["poet"], "lora_name must not be empty"),
        ("gone", tmp_path / "missing", "not a directory"),
        ("wide", too_wide, f"has rank {MAX_RANK * 2}, above the bundle's --max-lora-rank {MAX_RANK}"),
    ]
    for name, folder, message in cases:
        refused(post(running, LOAD, lora_name=name, lora_path=str(folder)), 400, message)
    refused(post(running, UNLOAD, lora_name="nope"), 404, "no adapter named 'nope' is loaded")
    assert served(running) == {"sql"}
    assert completion(client(running), "sql") == expected(bundle, adapters, "sql")


def test_the_routes_need_the_token(running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]) -> None:
    _, adapters = lora_bundle
    assert (
        post(running, LOAD, token=None, lora_name="poet", lora_path=str(adapters["poet"])).status_code == 401
    )
    assert post(running, UNLOAD, token="wrong", lora_name="sql").status_code == 401
    assert served(running) == {"sql"}


def test_an_adapter_in_use_is_not_unloaded_and_the_gateway_sees_it_running(running: RunningServer) -> None:
    slow = client(running).with_options(timeout=60)
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            slow.completions.create,
            model="sql",
            prompt="x",
            max_tokens=40,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "slow-in-use"},
        )
        running.wait_for(lambda s: s.running == 1)
        refused(post(running, UNLOAD, lora_name="sql"), 400, "in use by 1 running or queued requests")
        busy = {"max_lora": str(SLOTS), "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
        wait_for_metric(running, INFO, **busy)
        assert answer.result().choices[0].finish_reason == "length"
    running.wait_idle()
    idle = {"max_lora": str(SLOTS), "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert wait_for_metric(running, INFO, **idle) <= time.time()
    assert running.metric(INFO, **busy) == 0  # one series: the gateway reads the latest
    assert served(running) == {"sql"}


def test_adapters_are_counted(running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]) -> None:
    _, adapters = lora_bundle
    before = running.metric("textgen_lora_requests_total", adapter="sql")
    loads = running.metric("textgen_lora_slot_loads_total")
    completion(client(running), "sql")
    assert post(running, LOAD, lora_name="poet", lora_path=str(adapters["poet"])).status_code == 200
    assert post(running, UNLOAD, lora_name="poet").status_code == 200
    running.wait_idle()
    assert wait_for_metric(running, "textgen_lora_requests_total", before + 1, adapter="sql") == before + 1
    assert wait_for_metric(running, "textgen_lora_slot_loads_total", loads + 1) >= loads + 1


def wait_for_metric(running: RunningServer, name: str, at_least: float = 1e-9, **labels: str) -> float:
    """The sample once it reaches `at_least`: an engine process's metric calls come after its steps."""
    deadline = time.monotonic() + 10
    while (sample := running.metric(name, **labels)) < at_least:
        assert time.monotonic() < deadline, f"{name}{labels} stayed at {sample}"
        time.sleep(0.01)
    return sample

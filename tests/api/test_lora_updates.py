"""LoRA adapters loaded and unloaded while the server runs (--lora-runtime-updates): vLLM's routes behind the
bearer token and --lora-root, the adapter served as an adapter given at start is, refusals that change
nothing and name no path outside the root, the --max-cpu-loras limit, an unload deferred while requests use
the adapter, and the metrics the inference gateway routes by; with the engine in its own process and in the
server's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openai
import pytest
from engine_faults import InjectedFaults
from lora_adapters import MAX_RANK, SLOTS, completion, copied, expected, save_adapter
from running_server import RunningServer, loopback_settings
from safetensors.numpy import load_file
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ConfigError, load_settings
from serve.engine.lora import WEIGHTS_FILE

TOKEN = "adapters-secret"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
INFO = "vllm:lora_requests_info"
MAX_LOADED = SLOTS + 1


@pytest.fixture
def in_root(lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path) -> Path:
    """A folder of this test's own under the server's --lora-root."""
    folder = lora_bundle[1]["sql"].parent / f"test-{tmp_path.name}"
    folder.mkdir()
    return folder


@pytest.fixture(scope="module", params=[True, False], ids=["engine-process", "in-process"])
def running(
    request: pytest.FixtureRequest, loop: LoopThread, lora_bundle: tuple[Path, dict[str, Path]]
) -> Iterator[RunningServer]:
    """A server with "sql" loaded at start, runtime updates on from the adapters' folder, at most
    MAX_LOADED adapters; requests "slow-..." decode slowly."""
    bundle, adapters = lora_bundle
    settings = loopback_settings(
        bundle,
        http_port=free_port(),
        lora=[("sql", adapters["sql"])],
        lora_runtime_updates=True,
        lora_root=adapters["sql"].parent,
        max_cpu_loras=MAX_LOADED,
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


def test_runtime_updates_need_the_token_and_a_root_at_start(tmp_path: Path) -> None:
    """Loads read the server's disk: refused at start without --auth-token (unless allowed explicitly) or
    without a --lora-root folder to read from."""
    on = ["--bundle", str(tmp_path), "--lora-runtime-updates"]
    root = ["--lora-root", str(tmp_path)]
    with pytest.raises(ConfigError, match="from the server's disk: give auth_token"):
        load_settings([*on, *root])
    with pytest.raises(ConfigError, match="lora_runtime_updates needs lora_root"):
        load_settings([*on, "--auth-token", TOKEN])
    with pytest.raises(ConfigError, match="is not a directory"):
        load_settings([*on, "--auth-token", TOKEN, "--lora-root", str(tmp_path / "missing")])
    assert load_settings([*on, *root, "--auth-token", TOKEN]).lora_root == tmp_path
    assert load_settings([*on, *root, "--allow-unauthenticated-lora-updates"]).auth_token is None


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
    assert len(served(running)) == SLOTS + 1 == MAX_LOADED
    refused(
        post(running, LOAD, lora_name="more", lora_path=str(adapters["poet"])),
        400,
        f"{MAX_LOADED} adapters are loaded, as many as --max-cpu-loras allows: unload one first",
    )
    for name in ("chef", "poet", "sql", "chef"):
        assert completion(client(running), name) == expected(bundle, adapters, name)
    for name in ("poet", "chef"):
        assert post(running, UNLOAD, lora_name=name).status_code == 200


def test_what_cannot_be_loaded_is_refused_and_nothing_changes(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]], in_root: Path
) -> None:
    bundle, adapters = lora_bundle
    too_wide = save_adapter(in_root / "wide", seed=9, rank=MAX_RANK * 2)
    tensors = load_file(str(adapters["poet"] / WEIGHTS_FILE))
    broken = sorted(tensors)[0]
    tensors[broken][0, 0] = np.nan
    nan = copied(adapters["poet"], in_root / "nan", tensors)
    loud = copied(adapters["poet"], in_root / "loud", lora_alpha=1e40)
    cases = [
        ("sql", adapters["poet"], "an adapter named 'sql' is already loaded"),
        (running.model.name, adapters["poet"], "has a name the model is served by"),
        ("", adapters["poet"], "an adapter's name must not be empty"),
        ("gone", in_root / "missing", f"adapter 'gone': {in_root.name}/missing: not a directory"),
        ("wide", too_wide, f"has rank {MAX_RANK * 2}, above the bundle's --max-lora-rank {MAX_RANK}"),
        ("nan", nan, f"{broken} holds 1 NaN or infinite values"),
        ("loud", loud, "times its scale 2.5e+39 (lora_alpha 1e+40) is past float32's range"),
    ]
    cases += [(bad, adapters["poet"], "is not allowed") for bad in ("a,b", "two words", 'q"uote', "x" * 129)]
    for name, folder, message in cases:
        answer = post(running, LOAD, lora_name=name, lora_path=str(folder))
        refused(answer, 400, message)
        assert str(adapters["sql"].parent) not in answer.text  # a path under the root is named relative to it
    refused(post(running, UNLOAD, lora_name="nope"), 404, "no adapter named 'nope' is loaded")
    assert served(running) == {"sql"}
    assert completion(client(running), "sql") == expected(bundle, adapters, "sql")


def test_folders_outside_the_root_are_refused_alike_whether_they_exist_or_not(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]], in_root: Path, tmp_path: Path
) -> None:
    """Through a symlink too, to the folder or to a file in it; the answer says nothing of what is there."""
    _, adapters = lora_bundle
    outside = copied(adapters["poet"], tmp_path / "outside")
    (in_root / "link").symlink_to(outside)
    files = copied(adapters["poet"], in_root / "files")
    (files / WEIGHTS_FILE).unlink()
    (files / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    answers = [
        post(running, LOAD, lora_name="x", lora_path=str(path))
        for path in (outside, tmp_path / "missing", "/etc", "../../..", in_root / "link", files)
    ]
    for answer in answers:
        refused(answer, 400, "is not a folder under the server's --lora-root")
    texts = {a.json()["error"]["message"].split("'", 2)[2] for a in answers}  # but for the path given
    assert len(texts) == 1, texts
    assert served(running) == {"sql"}


def test_the_routes_need_the_token(running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]) -> None:
    _, adapters = lora_bundle
    assert (
        post(running, LOAD, token=None, lora_name="poet", lora_path=str(adapters["poet"])).status_code == 401
    )
    assert post(running, UNLOAD, token="wrong", lora_name="sql").status_code == 401
    assert served(running) == {"sql"}


def test_an_adapter_in_use_is_unloaded_once_its_requests_end(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    """The unload answers at once: new requests for the adapter are refused (404) and /v1/models no longer
    lists it, its running request finishes with it, and the gateway sees it running until then."""
    bundle, adapters = lora_bundle
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
        unloaded = post(running, UNLOAD, lora_name="sql")
        assert (unloaded.status_code, unloaded.text) == (
            200,
            "Success: LoRA adapter 'sql' will be removed once the 1 running or queued requests using it "
            "finish; new requests for it are refused.",
        )
        assert served(running) == set()
        with pytest.raises(openai.NotFoundError):
            completion(client(running), "sql")
        busy = {"max_lora": str(SLOTS), "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
        wait_for_metric(running, INFO, **busy)
        assert answer.result().choices[0].finish_reason == "length"
    running.wait_idle()
    idle = {"max_lora": str(SLOTS), "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert wait_for_metric(running, INFO, **idle) <= time.time()
    assert running.metric(INFO, **busy) == 0  # one series: the gateway reads the latest
    loaded = post(running, LOAD, lora_name="sql", lora_path="sql")  # gone: its name is free again
    assert loaded.status_code == 200, loaded.text
    assert served(running) == {"sql"}
    assert completion(client(running), "sql") == expected(bundle, adapters, "sql")


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

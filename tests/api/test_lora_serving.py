"""A server started with --lora: the OpenAI `model` field and gRPC's `adapter` pick an adapter, /v1/models
and GetModelInfo list them, unknown names are 404 / NOT_FOUND, and bad flags fail at start."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from lora_adapters import NEW_TOKENS, PROMPT, completion, expected
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ConfigError, load_settings
from serve.api.loading import load_model
from serve.bundle import load_bundle
from serve.errors import BundleError


@pytest.fixture(scope="module")
def running(loop: LoopThread, lora_bundle: tuple[Path, dict[str, Path]]) -> Iterator[RunningServer]:
    bundle, adapters = lora_bundle
    # Served by a published name and an alias (--served-model-name): the adapters work beside them.
    names = ["textgen-lora", "alias"]
    settings = loopback_settings(
        bundle, http_port=free_port(), lora=list(adapters.items()), served_model_name=names
    )
    server = RunningServer(loop, settings)
    yield server
    loop.run(server.server.stop())


def test_models_lists_the_adapters_with_their_parent(running: RunningServer) -> None:
    cards = {m.id: m.model_dump() for m in running.openai_client().models.list().data}
    base = running.model.name
    assert list(cards)[:2] == [base, "alias"] == ["textgen-lora", "alias"]  # each served name, first first
    assert set(cards) == {base, "alias", "sql", "poet", "chef"}
    assert cards[base]["parent"] is cards["alias"]["parent"] is None
    assert cards["sql"]["parent"] == cards["poet"]["parent"] == base


def test_the_model_field_picks_the_adapter(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    """Requests over three adapters (two slots) and the base at once: each gets what the engine gives it
    alone; the adapters take turns in the slots, and none waits forever."""
    bundle, adapters = lora_bundle
    client = running.openai_client()
    names = [*adapters, running.model.name, "alias"] * 3
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda name: (name, completion(client, name)), names))
    base = expected(bundle, adapters, "")
    want = {name: expected(bundle, adapters, name) for name in adapters} | {
        running.model.name: base,
        "alias": base,
    }
    assert all(text == want[name] for name, text in got)
    assert len(set(want.values())) == 4  # each adapter changes the model


def test_an_unknown_model_is_a_404_naming_the_adapters(running: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        completion(running.openai_client(), "nope")
    assert "sql" in caught.value.message and caught.value.code == "model_not_found"


def test_prompt_logprobs_with_an_adapter_are_refused(running: RunningServer) -> None:
    with pytest.raises(openai.BadRequestError, match="prompt logprobs are scored by the base model"):
        running.openai_client().completions.create(
            model="sql", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1
        )


def test_grpc_names_the_adapter_and_lists_them(
    running: RunningServer, lora_bundle: tuple[Path, dict[str, Path]]
) -> None:
    bundle, adapters = lora_bundle
    stopping = pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (list(info.adapters), info.lora_slots) == (["sql", "poet", "chef"], 2)
        answer = stub.Generate(pb.GenerateRequest(text=PROMPT, stopping=stopping, adapter="poet"))
        assert answer.text == expected(bundle, adapters, "poet")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(pb.GenerateRequest(text=PROMPT, stopping=stopping, adapter="nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope' is not loaded" in (caught.value.details() or "")


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("sql", "is not NAME=DIR"),
        ("a=/x,a=/y", "adapter names must differ"),
        ("=/x", "is not NAME=DIR"),
        ("two words=/x", "adapter name 'two words' is not allowed: at most 128 letters, digits and ._:/-"),
        ("a;b=/x", "adapter name 'a;b' is not allowed"),
        ("_a=/x", "adapter name '_a' is not allowed"),
        ("a=/x,b=/y,c=/z", r"lora gives 3 adapters, more than max_cpu_loras \(2\)"),
    ],
)
def test_bad_lora_flags_fail_at_start(flag: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(["--bundle", str(tmp_path), "--max-cpu-loras", "2", "--lora", flag])


def test_adapters_that_cannot_be_served_fail_at_start(
    lora_bundle: tuple[Path, dict[str, Path]], tiny_bundle: Path, tmp_path: Path
) -> None:
    bundle, adapters = lora_bundle
    cases = [
        (tiny_bundle, [("sql", adapters["sql"])], "has no LoRA slots"),
        (
            bundle,
            [(load_bundle(bundle).manifest.model_name, adapters["sql"])],
            "a name the model is served by",
        ),
        (bundle, [("gone", tmp_path / "missing")], "not a directory"),
    ]
    for path, lora, message in cases:
        with pytest.raises(BundleError, match=message):  # what start-up raises before serving anything
            asyncio.run(load_model(loopback_settings(path, lora=lora, engine_process=False), None))
    # With --served-model-name, no adapter may take any of those names (the bundle's is free then).
    names = {"served_model_name": ["pub", "alias"], "engine_process": False}
    with pytest.raises(
        BundleError, match=r"adapter 'alias' has a name the model is served by \(pub, alias\)"
    ):
        asyncio.run(load_model(loopback_settings(bundle, lora=[("alias", adapters["sql"])], **names), None))


def test_runtime_updates_are_404_without_their_flag(running: RunningServer) -> None:
    """As vLLM's routes are without VLLM_ALLOW_RUNTIME_LORA_UPDATING: nothing changes the adapters."""
    for path, body in [
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/tmp"}),
        ("/v1/unload_lora_adapter", {"lora_name": "sql"}),
    ]:
        assert httpx.post(running.http_base + path, json=body).status_code == 404
    assert "sql" in running.model.info.adapters

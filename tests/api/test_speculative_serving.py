"""A server started with --speculative ngram: the flags, the per-request field over gRPC and HTTP, what
GetModelInfo says, and the spec-decode metrics (counted in the engine's process, replayed here)."""

from __future__ import annotations

import inspect
import json.encoder
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ConfigError, load_settings
from serve.api.loading import engine_settings

NEW_TOKENS = 60


@pytest.fixture(scope="module")
def running(loop: LoopThread, demo_bundle: Path) -> Iterator[RunningServer]:
    settings = loopback_settings(demo_bundle, http_port=free_port(), speculative="ngram")
    server = RunningServer(loop, settings)
    yield server
    loop.run(server.server.stop())


def code_prompt() -> str:
    return inspect.getsource(json.encoder)[:400]  # code repeats its names: lookups find them


def complete(running: RunningServer, **fields: object) -> httpx.Response:
    body = {"prompt": code_prompt(), "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{running.http_base}/v1/completions", json=body, timeout=60)


def spec_counts(running: RunningServer) -> dict[str, float]:
    names = ("drafts", "draft_tokens", "accepted_tokens", "emitted_tokens")
    counts = {name: running.metric(f"textgen_spec_decode_{name}_total") for name in names}
    counts["requests"] = running.metric("textgen_spec_decode_acceptance_rate_count")
    return counts


def test_model_info_says_what_is_on(running: RunningServer) -> None:
    with grpc.insecure_channel(running.target) as channel:
        info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    assert (info.speculative, info.num_speculative_tokens) == ("ngram", 5)
    assert info.batch_invariant  # a verification run computes what decode steps do (test_speculation.py)


def test_a_speculated_completion_is_the_plain_one_and_is_counted(running: RunningServer) -> None:
    before = spec_counts(running)
    plain = complete(running, num_speculative_tokens=0)
    assert spec_counts(running) == before  # a request that asks for none proposes none
    speculated = complete(running)
    assert plain.status_code == speculated.status_code == 200, plain.text
    assert speculated.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    after = spec_counts(running)
    delta = {name: after[name] - before[name] for name in after}
    assert delta["draft_tokens"] >= delta["drafts"] > 0
    assert 0 < delta["accepted_tokens"] <= delta["draft_tokens"]
    assert delta["emitted_tokens"] == delta["accepted_tokens"] + delta["drafts"]
    assert delta["requests"] == 1


def test_grpc_takes_the_per_request_number(running: RunningServer) -> None:
    request = pb.GenerateRequest(
        text=code_prompt(), stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        before = spec_counts(running)
        request.num_speculative_tokens = 0
        plain = stub.Generate(request)
        assert spec_counts(running) == before
        request.num_speculative_tokens = 2
        two = stub.Generate(request)
    assert two.text == plain.text
    delta = {name: spec_counts(running)[name] - before[name] for name in before}
    assert 0 < delta["draft_tokens"] <= 2 * delta["drafts"]


def test_a_negative_number_is_a_400(running: RunningServer) -> None:
    answer = complete(running, num_speculative_tokens=-1)
    assert answer.status_code == 400 and "num_speculative_tokens" in answer.json()["error"]["message"]


def test_the_flags_become_the_engines_speculation(tmp_path: Path) -> None:
    flags = ["--bundle", str(tmp_path), "--speculative", "ngram", "--num-speculative-tokens", "3"]
    speculation = engine_settings(load_settings([*flags, "--prompt-lookup-min", "1"])).speculation
    assert (speculation.num_tokens, speculation.ngram_min, speculation.ngram_max) == (3, 1, 4)
    assert not engine_settings(load_settings(["--bundle", str(tmp_path)])).speculation.enabled
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        load_settings([*flags, "--prompt-lookup-min", "5", "--prompt-lookup-max", "3"])


def test_a_draft_model_needs_its_bundle_and_only_it_needs_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--draft-bundle"):
        load_settings(["--bundle", str(tmp_path), "--speculative", "draft"])
    with pytest.raises(ConfigError, match="--draft-bundle"):
        load_settings(["--bundle", str(tmp_path), "--draft-bundle", str(tmp_path)])
    flags = ["--bundle", str(tmp_path), "--speculative", "draft", "--draft-bundle", str(tmp_path / "d")]
    speculation = engine_settings(load_settings(flags)).speculation
    assert (speculation.method, speculation.draft_bundle) == ("draft", str(tmp_path / "d"))

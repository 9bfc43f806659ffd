"""--served-model-name (vLLM's): the names a request's `model` may give, on every HTTP route, and the first
one as the name the server reports (/v1/models lists each, an answer echoes the one asked for), in
GetModelInfo and in the model's metric; the bundle's own name is then unknown. The flag takes its names as
separate words (vLLM's way), comma-separated, or from TEXTGEN_SERVED_MODEL_NAME."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import grpc
import httpx
import openai
import pytest
from chat_templates import COMPACT_TOOLS
from running_server import RunningServer
from server_tools import LoopThread
from test_http_tools import USER, serve_with_template

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ConfigError, load_settings

NAMES = ["org/published", "alias"]


@pytest.fixture(scope="module")
def server(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    where = tmp_path_factory.mktemp("names")
    running = serve_with_template(
        loop, tiny_bundle, where, COMPACT_TOOLS, engine_process=False, served_model_name=NAMES
    )
    yield running
    running.stop()


def test_models_lists_each_served_name_and_grpc_and_metrics_report_the_first(server: RunningServer) -> None:
    client = server.openai_client()
    assert [card.id for card in client.models.list().data] == NAMES
    with grpc.insecure_channel(server.target) as channel:
        info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_name == NAMES[0] != server.model.bundle.manifest.model_name
    (info_line,) = [
        line for line in server.server.metrics.exposition().splitlines() if "textgen_model_info{" in line
    ]
    assert f'model="{NAMES[0]}"' in info_line


@pytest.mark.parametrize("name", NAMES)
def test_every_route_takes_each_name_and_answers_with_it(server: RunningServer, name: str) -> None:
    client = server.openai_client()
    completion = client.completions.create(model=name, prompt="x", max_tokens=2)
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=2)  # type: ignore[arg-type]
    response = client.responses.create(model=name, input="x", max_output_tokens=2)
    messages = anthropic.Anthropic(base_url=server.http_base, api_key="unused", max_retries=0)
    message = messages.messages.create(model=name, max_tokens=2, messages=USER)  # type: ignore[arg-type]
    count = messages.messages.count_tokens(model=name, messages=USER)  # type: ignore[arg-type]
    assert [completion.model, chat.model, response.model, message.model] == [name] * 4 and count.input_tokens
    tokenized = httpx.post(f"{server.http_base}/tokenize", json={"model": name, "prompt": "x"})
    assert tokenized.status_code == 200, tokenized.text


def test_without_a_model_the_first_name_answers(server: RunningServer) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    answer = httpx.post(f"{server.http_base}/v1/completions", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == NAMES[0]


def test_the_bundles_own_name_is_unknown_then(server: RunningServer) -> None:
    bundle_name = server.model.bundle.manifest.model_name
    with pytest.raises(openai.NotFoundError) as caught:
        server.openai_client().completions.create(model=bundle_name, prompt="x", max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert "this server serves 'org/published', 'alias'" in caught.value.message


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--served-model-name", "a", "b", "--port", "1"], None, ["a", "b"]),  # vLLM's separate words
        (["--served-model-name", "a,b"], None, ["a", "b"]),
        (["--served-model-name=a"], None, ["a"]),
        ([], "a b", ["a", "b"]),
        ([], None, None),  # the bundle's own name
    ],
)
def test_the_flag_and_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], env: str | None, names: list[str] | None
) -> None:
    if env is not None:
        monkeypatch.setenv("TEXTGEN_SERVED_MODEL_NAME", env)
    assert load_settings(["--bundle", str(tmp_path), *argv]).served_model_name == names


@pytest.mark.parametrize(
    ("value", "message"), [("a a", "served model names must differ"), (" , ", "at least one name")]
)
def test_bad_names_fail_at_start(tmp_path: Path, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(["--bundle", str(tmp_path), "--served-model-name", value])

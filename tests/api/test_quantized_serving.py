"""Quantized bundles served end to end: INT8 and INT4 (MatMulNBits; INT4's odd row counts padded) of the tiny
model load, report what they are over GetModelInfo, and give a request the same greedy tokens alone as in a
batch with others."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from quantized_bundles import quantized_graphs, tiny_model
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread

from export.pipeline import ExportOptions, Precision, write_verified_bundle
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.bundle import load_bundle

# Prompts of different lengths, so the batch is padded and its rows differ.
PROMPTS = ("x", "def f(a, b):\n    return", "import os\nimport sys\n\nclass Parser:\n    def __init__(self")
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_bundle(
    request: pytest.FixtureRequest, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    precision = Precision(request.param)
    options = ExportOptions(model_name=f"tiny-{request.param}", precision=precision, progress=False)
    out = tmp_path_factory.mktemp("quantized") / request.param
    tokenizer = load_bundle(tiny_bundle).tokenizer
    graphs = quantized_graphs(tiny_bundle, precision)
    return write_verified_bundle(tiny_model(), tokenizer, graphs, out, options).root


Served = tuple[RunningServer, pb_grpc.TextGenerationStub]


@pytest.fixture(scope="module")
def served(loop: LoopThread, quantized_bundle: Path) -> Iterator[Served]:
    # A partial prefill group waits for company, so the concurrent requests really share steps.
    running = RunningServer(
        loop, loopback_settings(quantized_bundle, engine_process=False, max_wait_seconds=0.2)
    )
    try:
        with grpc.insecure_channel(running.target) as channel:
            yield running, pb_grpc.TextGenerationStub(channel)
    finally:
        running.stop()


def greedy(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=text, stopping=pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    )


def test_model_info_says_what_the_bundle_is(served: Served) -> None:
    server, stub = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    manifest = server.model.bundle.manifest
    assert info.quantization == manifest.quantization in ("int8", "int4")
    assert info.batch_invariant and manifest.batch_invariant
    assert list(info.execution_providers) == ["CPUExecutionProvider"]


def test_greedy_tokens_alone_equal_those_in_a_batch(served: Served) -> None:
    server, stub = served
    alone = [list(stub.Generate(greedy(p)).token_ids) for p in PROMPTS]
    steps_before = len(server.model.scheduler.steps())
    futures = [stub.Generate.future(greedy(p)) for p in PROMPTS for _ in range(2)]
    together = [list(f.result().token_ids) for f in futures]
    assert together == [tokens for tokens in alone for _ in range(2)]
    assert max(step.rows for step in server.model.scheduler.steps()[steps_before:]) > 1  # really batched

"""KV cache sizing: --max-model-len and --kv-cache-memory decide the rows the server allocates; a budget that
holds no row refuses to start, saying what a row takes; GetModelInfo reports the choice."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread

from export.bundle_writer import SharedWeights
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api import cli
from serve.api.config import ConfigError, load_settings
from serve.api.lifecycle import TextgenServer
from serve.api.loading import draft_cost
from serve.api.sizing import (
    DEFAULT_MAX_MODEL_LEN,
    FIXED_BYTES,
    SESSION_BYTES,
    WEIGHT_FACTORS,
    DraftCost,
    ServedFeatures,
    pod_memory,
    scoring_bytes_per_position,
    size_kv_cache,
)
from serve.bundle import Graphs, GraphSpec, graph_weight_bytes, load_bundle, serving_weight_bytes
from serve.memory import parse_memory

KIB, MIB, GIB = 2**10, 2**20, 2**30


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TEXTGEN_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MIB),
        ("2GiB", 2 * GIB),
        ("1.5G", int(1.5 * GIB)),
        ("768", 768 * MIB),
        ("64kb", 64 * KIB),
        ("4096B", 4096),
    ],
)
def test_memory_amounts(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


def test_memory_flag_and_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = load_settings(["--bundle", str(tmp_path), "--kv-cache-memory", "2GiB", "--max-model-len", "512"])
    assert (flags.kv_cache_memory, flags.max_model_len) == (2 * GIB, 512)
    monkeypatch.setenv("TEXTGEN_KV_CACHE_MEMORY", "300MiB")
    assert load_settings(["--bundle", str(tmp_path)]).kv_cache_memory == 300 * MIB
    with pytest.raises(ConfigError, match=r"kv_cache_memory: .*not an amount of memory"):
        load_settings(["--bundle", str(tmp_path), "--kv-cache-memory", "lots"])


def test_rows_from_the_budget(tiny_bundle: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest  # 2 layers x K,V x 2 heads x 16 x 4 bytes = 512 B a token
    row = 512 * 128
    unlimited = size_kv_cache(manifest, None, None, 16, 4)
    assert (unlimited.max_model_len, unlimited.max_batch_size, unlimited.prefix_cache_rows) == (128, 16, 4)
    assert unlimited.row_bytes == row and unlimited.total_bytes == 20 * row
    tight = size_kv_cache(manifest, None, 10 * row + 1, 16, 4)  # running rows first, then the prefix cache's
    assert (tight.max_batch_size, tight.prefix_cache_rows) == (10, 0)
    roomy = size_kv_cache(manifest, None, 18 * row, 16, 4)
    assert (roomy.max_batch_size, roomy.prefix_cache_rows) == (16, 2)
    short = size_kv_cache(manifest, 32, 10 * row, 16, 4)  # shorter rows: more of them
    assert (short.max_model_len, short.max_batch_size, short.prefix_cache_rows) == (32, 16, 4)
    assert "max_model_len 32 (of the model's 128" in short.describe()
    with pytest.raises(ConfigError, match=r"holds no KV row: one row of 128 tokens takes 0\.1 MiB"):
        size_kv_cache(manifest, None, row - 1, 16, 4)
    with pytest.raises(ConfigError, match="max_model_len 256 exceeds the model's context length 128"):
        size_kv_cache(manifest, 256, None, 16, 4)


def test_a_draft_model_is_paid_from_the_budget_first(tiny_bundle: Path, tmp_path: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest
    row = 512 * 128
    draft = DraftCost(weight_bytes=3 * row, kv_bytes_per_token=512)  # its weights and its own row: 4 rows
    sizing = size_kv_cache(manifest, None, 10 * row, 16, 4, draft)
    assert (sizing.max_batch_size, sizing.prefix_cache_rows, sizing.draft_bytes) == (6, 0, 4 * row)
    assert "after 0.2 MiB for the draft model's weights and KV row" in sizing.describe()
    with pytest.raises(ConfigError, match=r"holds no KV row after the draft model's 0\.2 MiB"):
        size_kv_cache(manifest, None, 4 * row, 16, 4, draft)
    # The server's own reckoning: the draft bundle's serving graph as stored (the graph and the weights it
    # reads in the data file), and its KV row.
    flags = ["--bundle", str(tiny_bundle), "--speculative", "draft", "--draft-bundle", str(tiny_bundle)]
    cost = draft_cost(load_settings(flags))
    assert cost is not None and cost.kv_bytes_per_token == 512
    spec = manifest.graphs.inplace
    assert spec is not None and len(spec.files()) > 1
    assert cost.weight_bytes == graph_weight_bytes(tiny_bundle, spec)
    assert draft_cost(load_settings(["--bundle", str(tmp_path)])) is None


def test_a_long_context_is_capped_by_default(tiny_bundle: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest
    arch = manifest.architecture.model_copy(update={"context_length": 32768})
    long = manifest.model_copy(update={"architecture": arch})
    assert size_kv_cache(long, None, None, 16, 4).max_model_len == DEFAULT_MAX_MODEL_LEN
    assert size_kv_cache(long, 32768, None, 16, 4).max_model_len == 32768


@pytest.fixture(scope="module")
def sized(loop: LoopThread, tiny_bundle: Path) -> Iterator[pb_grpc.TextGenerationStub]:
    settings = loopback_settings(
        tiny_bundle, max_model_len=64, kv_cache_memory=f"{5 * 512 * 64}B", engine_process=False
    )
    running = RunningServer(loop, settings)
    try:
        with grpc.insecure_channel(running.target) as channel:
            yield pb_grpc.TextGenerationStub(channel)
    finally:
        running.stop()


def test_the_server_sizes_its_rows_and_reports_them(sized: pb_grpc.TextGenerationStub) -> None:
    info = sized.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_model_len, info.context_length) == (64, 128)
    assert (info.max_batch_size, info.prefix_cache_rows) == (5, 0)
    assert info.kv_cache_bytes == 5 * 512 * 64
    assert info.max_new_tokens_limit == 63
    too_long = pb.GenerateRequest(text="x" * 10, stopping=pb.StoppingCriteria(max_new_tokens=60))
    with pytest.raises(grpc.RpcError) as error:
        sized.Generate(too_long)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "64" in str(error.value.details())


def test_a_budget_without_room_for_one_row_refuses_to_start(loop: LoopThread, tiny_bundle: Path) -> None:
    server = TextgenServer(loopback_settings(tiny_bundle, kv_cache_memory="32KiB", engine_process=False))
    try:
        with pytest.raises(ConfigError, match=r"holds no KV row.*raise --kv-cache-memory or lower"):
            loop.run(server.start())
    finally:
        loop.run(server.stop())


def test_the_choice_is_logged(loop: LoopThread, tiny_bundle: Path, caplog: pytest.LogCaptureFixture) -> None:
    settings = loopback_settings(tiny_bundle, kv_cache_memory="80KiB", max_model_len=32, engine_process=False)
    with caplog.at_level(logging.INFO, logger="textgen.server"):
        running = RunningServer(loop, settings)
        running.stop()
    messages = [r.getMessage() for r in caplog.records if r.name == "textgen.server"]
    assert any("KV cache: max_model_len 32" in m and "5 running + 0 prefix-cache rows" in m for m in messages)
    assert any("max_batch_size 16 -> 5" in m for m in messages)


def test_an_fp16_cache_fits_twice_the_rows_in_a_budget(
    loop: LoopThread, tiny_bundle: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = load_bundle(tiny_bundle).manifest  # float32: 512 B a token, 256 B in float16
    assert size_kv_cache(manifest, None, None, 16, 4, kv_cache_dtype="fp16").row_bytes == 256 * 128
    budget = 5 * 512 * 64  # five float32 rows of 64 tokens
    assert load_settings(["--bundle", str(tiny_bundle), "--kv-cache-dtype", "fp16"]).kv_cache_dtype == "fp16"
    settings = loopback_settings(
        tiny_bundle,
        max_model_len=64,
        kv_cache_memory=f"{budget}B",
        kv_cache_dtype="fp16",
        engine_process=False,
    )
    with caplog.at_level(logging.INFO, logger="textgen.engine"):
        running = RunningServer(loop, settings)
    try:
        with grpc.insecure_channel(running.target) as channel:
            info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    finally:
        running.stop()
    assert (info.max_batch_size, info.prefix_cache_rows, info.kv_cache_bytes) == (10, 0, budget)
    assert any("MiB of float16 on cpu" in r.getMessage() for r in caplog.records)


def test_a_pods_memory_is_weights_times_a_factor_plus_kv_plus_the_fixed_part(tiny_bundle: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest
    rows = size_kv_cache(manifest, 128, None, 4, 1)
    pod = pod_memory(tiny_bundle, manifest, rows)
    factor = WEIGHT_FACTORS[manifest.quantization]
    weights = serving_weight_bytes(tiny_bundle, manifest)
    assert pod.kv_bytes == 5 * 128 * manifest.architecture.kv_bytes_per_token(4)
    for mib, times in ((pod.request_mib, factor.steady), (pod.limit_mib, factor.peak)):
        exact = weights * times + pod.kv_bytes + FIXED_BYTES
        assert mib * MIB >= exact > (mib - 1) * MIB  # rounded up to whole MiB
    assert pod.request_mib <= pod.limit_mib
    assert f"requests.memory: {pod.request_mib}Mi" in pod.describe()


def _graph(weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A graph that hands its weights out as they are: only its initializers matter here."""
    nodes = [helper.make_node("Identity", [name], [f"{name}.out"]) for name in weights]
    outputs = [
        helper.make_tensor_value_info(f"{n}.out", TensorProto.FLOAT, list(w.shape))
        for n, w in weights.items()
    ]
    inits = [numpy_helper.from_array(w, name) for name, w in weights.items()]
    return helper.make_model(helper.make_graph(nodes, "g", [], outputs, inits))


def test_a_graph_counts_the_weights_it_reads_of_a_shared_data_file(tiny_bundle: Path, tmp_path: Path) -> None:
    """Two graphs over one data file, each tensor stored once, as a quantized mixture of experts has them
    (its experts laid out one way for the serving graph, another for the standard graph): a graph's weights
    are its file and the tensors it references there, not the whole data file; the tensors both read count
    for each. The pod's weights are the serving graph's, its prompt-logprobs session the standard graph's."""
    rng = np.random.default_rng(0)
    sizes = (3000, 50000, 700)  # floats: each past the writer's smallest external tensor
    both, standard_only, serving_only = (rng.standard_normal(n).astype(np.float32) for n in sizes)
    data = SharedWeights(tmp_path / "weights.data")
    graphs = {
        "model.onnx": _graph({"both": both, "standard_only": standard_only}),
        "model_inplace.onnx": _graph({"both": both, "serving_only": serving_only}),
    }
    for name, graph in graphs.items():
        data.externalize(graph)
        (tmp_path / name).write_bytes(graph.SerializeToString())
    data.close()
    specs = {
        name: GraphSpec(file=name, external_data="weights.data", inputs=["x"], outputs=["y"], opset=21)
        for name in graphs
    }
    tiny = load_bundle(tiny_bundle).manifest
    manifest = tiny.model_copy(
        update={"graphs": Graphs(standard=specs["model.onnx"], inplace=specs["model_inplace.onnx"])}
    )
    serving = (tmp_path / "model_inplace.onnx").stat().st_size + both.nbytes + serving_only.nbytes
    standard = (tmp_path / "model.onnx").stat().st_size + both.nbytes + standard_only.nbytes
    assert serving_weight_bytes(tmp_path, manifest) == serving
    assert graph_weight_bytes(tmp_path, specs["model.onnx"]) == standard
    whole = (tmp_path / "weights.data").stat().st_size
    assert whole >= both.nbytes + standard_only.nbytes + serving_only.nbytes > serving
    kv = size_kv_cache(manifest, 128, None, 4, 0)
    pod = pod_memory(tmp_path, manifest, kv, ServedFeatures(prompt_logprobs=True))
    factor = WEIGHT_FACTORS[manifest.quantization]
    (scoring,) = pod.parts
    scored = kv.max_model_len * scoring_bytes_per_position(manifest.architecture, kv.max_model_len)
    assert pod.weight_bytes == serving
    assert scoring.bytes == int(standard * factor.steady) + SESSION_BYTES + scored
    # A reference without a length runs to its file's end: the whole file is counted.
    graph = graphs["model_inplace.onnx"]
    tensor = next(t for t in graph.graph.initializer if t.name == "serving_only")
    kept = [e for e in tensor.external_data if e.key != "length"]
    del tensor.external_data[:]
    tensor.external_data.extend(kept)
    (tmp_path / "model_inplace.onnx").write_bytes(graph.SerializeToString())
    size = (tmp_path / "model_inplace.onnx").stat().st_size
    assert serving_weight_bytes(tmp_path, manifest) == size + whole


def test_a_draft_model_counts_with_the_kv_cache(tiny_bundle: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest
    rows = size_kv_cache(manifest, 128, None, 4, 0, DraftCost(3 * MIB, 512))
    assert pod_memory(tiny_bundle, manifest, rows).kv_bytes == rows.total_bytes + 3 * MIB + 512 * 128


def test_print_pod_memory_prints_the_figures_and_starts_nothing(
    tiny_bundle: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--bundle", str(tiny_bundle), "--max-model-len", "128", "--max-batch-size", "4"]
    assert cli.main([*flags, "--prefix-cache-rows", "0", "--print-pod-memory"]) == 0
    manifest = load_bundle(tiny_bundle).manifest
    scoring = ServedFeatures(prompt_logprobs=True)  # on by default
    pod = pod_memory(tiny_bundle, manifest, size_kv_cache(manifest, 128, None, 4, 0), scoring)
    printed = capsys.readouterr().out
    assert f"requests.memory: {pod.request_mib}Mi" in printed
    assert f"limits.memory: {pod.limit_mib}Mi" in printed
    assert "4 running + 0 prefix-cache rows" in printed
    assert cli.main([*flags, "--kv-cache-dtype", "fp16", "--print-pod-memory"]) == 0
    assert "head dim x 2 bytes" in capsys.readouterr().out

"""serve.engine.prepared: the serving graph prepared for this machine (its packed weights in a file ONNX
Runtime maps), cached outside the bundle, keyed, checked when opened, rebuilt rather than served when it does
not match; and the engine built from it gives the tokens and logprobs the bundle's graph gives."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path

import onnx
import pytest
from quantized_bundles import quantized_graphs, tiny_model

from export.pipeline import ExportOptions, Precision, PrecisionKind, write_verified_bundle
from serve.api.cli import main as serve_main
from serve.api.config import ServerSettings
from serve.api.loading import engine_settings
from serve.bundle import Bundle, load_bundle
from serve.engine import prepared, row_pad
from serve.engine.engine import Engine
from serve.engine.prepared import (
    DATA_FILE,
    ENTRY_FILES,
    GRAPH_FILE,
    RECORD_FILE,
    SCORING_FILE,
    CacheKey,
    ServingGraph,
    cache_key,
    prepared_graph,
    serving_graph,
)
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig, SpeculationSettings, TokenOut

CONFIG = SessionConfig(providers=("cpu",), threads=2, spinning=False)
SETTINGS = EngineSettings(max_batch_size=4, session=CONFIG)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14], [15]]


def quantized(tiny_bundle: Path, factory: pytest.TempPathFactory, kind: PrecisionKind) -> Bundle:
    """The tiny bundle quantized to `kind` (MatMulNBits at the kind's default block) and verified."""
    precision = Precision(kind)
    options = ExportOptions(model_name=f"tiny-{kind}", precision=precision, progress=False)
    out = factory.mktemp("quantized") / kind
    graphs = quantized_graphs(tiny_bundle, precision)
    tokenizer = load_bundle(tiny_bundle).tokenizer
    return write_verified_bundle(tiny_model(), tokenizer, graphs, out, options)


@pytest.fixture(scope="module")
def padded_int4(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    """The tiny bundle at 4 bits, block 32: row-padded, so the engine probes this CPU when it opens it."""
    bundle = quantized(tiny_bundle, tmp_path_factory, "int4")
    assert bundle.manifest.odd_rows_padded
    return bundle


@pytest.fixture(scope="module")
def int8(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return quantized(tiny_bundle, tmp_path_factory, "int8")


@pytest.fixture(params=["fp32", "int8", "int4-padded"])
def bundle(request: pytest.FixtureRequest, tiny_bundle: Path) -> Bundle:
    if request.param == "fp32":
        return load_bundle(tiny_bundle)
    return request.getfixturevalue("int8" if request.param == "int8" else "padded_int4")


def generate(engine: Engine, prompts: list[list[int]], n: int) -> dict[str, list[TokenOut]]:
    """Greedy tokens with their logprobs (and the prompt's), every prompt in one batch."""
    seqs = [
        NewSequence(f"s{i}", p, SamplingParams(), logprobs=True, prompt_logprobs=True, prompt_top_logprobs=2)
        for i, p in enumerate(prompts)
    ]
    outs: dict[str, list[TokenOut]] = {s.seq_id: [] for s in seqs}
    for out in engine.prefill(seqs):
        outs[out.seq_id].append(out)
    while min(len(o) for o in outs.values()) < n:
        for out in engine.decode():
            outs[out.seq_id].append(out)
    engine.release(list(outs))
    return {seq: [(o.token_id, o.logprob, o.prompt) for o in got[:n]] for seq, got in outs.items()}  # type: ignore[misc]


def entries(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.exists() else []


def test_the_prepared_graph_serves_the_bundles_tokens_and_logprobs(bundle: Bundle, tmp_path: Path) -> None:
    """Prepared at the first start, opened at the second: both give, bit for bit, the tokens and logprobs
    (and prompt logprobs, from the prepared standard graph) of the bundle's own graphs, batched and each
    prompt alone (batch invariance kept); the entry maps packed weights, the standard graph's stored once
    with the serving graph's, and the bundle's folder is left as it was (it may be read-only)."""
    before = {p.name: p.stat().st_mtime_ns for p in bundle.root.iterdir()}
    plain = generate(Engine.from_bundle(bundle, SETTINGS), PROMPTS, 12)
    cached = replace(SETTINGS, compiled_cache=tmp_path / "cache")
    for start in ("first", "second"):
        engine = Engine.from_bundle(load_bundle(bundle.root), cached)
        assert generate(engine, PROMPTS, 12) == plain, start
        alone = {}
        for i, prompt in enumerate(PROMPTS):
            alone |= {f"s{i}": generate(engine, [prompt], 12)["s0"]}
        assert alone == plain, start
    (entry,) = entries(tmp_path / "cache")
    assert sorted(p.name for p in entry.iterdir()) == sorted([*ENTRY_FILES, RECORD_FILE])
    packed = {}
    for name in (GRAPH_FILE, SCORING_FILE):
        graph = onnx.load(str(entry / name), load_external_data=False)
        refs = [{e.key: e.value for e in t.external_data} for t in graph.graph.initializer if t.external_data]
        assert {ref["location"] for ref in refs} == {DATA_FILE}
        # ONNX Runtime's packed layouts, in the data file: the scoring graph's where the serving graph's are
        packed[name] = {value for ref in refs for key, value in ref.items() if key.startswith("prepacked")}
        assert packed[name], name
    assert packed[GRAPH_FILE] & packed[SCORING_FILE]
    assert {p.name: p.stat().st_mtime_ns for p in bundle.root.iterdir()} == before


def test_speculation_verifies_over_the_prepared_graph(tiny_bundle: Path, tmp_path: Path) -> None:
    """The verification graph is rewritten from the prepared one, so it maps the same packed weights; a
    speculating engine's tokens are a plain one's."""
    bundle = load_bundle(tiny_bundle)
    speculating = replace(SETTINGS, compiled_cache=tmp_path, speculation=SpeculationSettings(num_tokens=3))
    engine = Engine.from_bundle(bundle, speculating)
    prompt = PROMPTS[0] * 4  # repeats, so prompt lookup proposes
    assert generate(engine, [prompt], 16) == generate(Engine.from_bundle(bundle, SETTINGS), [prompt], 16)


def test_the_row_pad_decision_is_recorded_and_another_cpu_prepares_its_own(
    padded_int4: Bundle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe runs when the entry is prepared, its decision is recorded with it, and a later start of the
    same key neither probes nor rebuilds; a CPU with other features (another key) prepares an entry of its
    own and leaves the first one as it was."""
    probes: list[int] = []
    probe = row_pad.lone_row_exact

    def counted(*args: object, **kwargs: object) -> bool:
        probes.append(1)
        return probe(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(row_pad, "lone_row_exact", counted)
    key = cache_key(padded_int4, CONFIG, "auto")
    first = _prepared(padded_int4, key, tmp_path)
    assert probes and first.row_pads_removed == serving_graph(padded_int4, CONFIG, "auto").row_pads_removed
    record = json.loads((first.folder / RECORD_FILE).read_text())
    assert record["row_pads_removed"] == first.row_pads_removed
    probes.clear()
    assert _prepared(padded_int4, key, tmp_path, build=_never).folder == first.folder and not probes
    written = (first.folder / DATA_FILE).stat().st_mtime_ns
    monkeypatch.setattr(prepared, "cpu_features", lambda: "another cpu")
    other = cache_key(padded_int4, CONFIG, "auto")
    assert other.cpu != key.cpu
    assert _prepared(padded_int4, other, tmp_path).folder != first.folder and probes
    assert (first.folder / DATA_FILE).stat().st_mtime_ns == written
    assert len(entries(tmp_path)) == 2


def _never() -> ServingGraph:
    raise AssertionError("a usable entry was prepared again")


def _prepared(bundle: Bundle, key: CacheKey, cache: Path, build: object = None) -> prepared.Prepared:
    def default() -> ServingGraph:
        return serving_graph(bundle, CONFIG, "auto")

    found = prepared_graph(cache, key, build or default, CONFIG)  # type: ignore[arg-type]
    assert found is not None
    return found


@pytest.mark.parametrize("damage", ["flipped byte", "truncated graph", "no record", "another key"])
def test_a_corrupt_or_stale_entry_is_prepared_again_not_served(
    tiny_bundle: Path, tmp_path: Path, damage: str
) -> None:
    bundle = load_bundle(tiny_bundle)
    key = cache_key(bundle, CONFIG, "auto")
    entry = _prepared(bundle, key, tmp_path).folder
    record = (entry / RECORD_FILE).read_text()
    if damage == "flipped byte":
        data = bytearray((entry / DATA_FILE).read_bytes())
        data[len(data) // 2] ^= 1
        (entry / DATA_FILE).write_bytes(bytes(data))
    elif damage == "truncated graph":
        graph = entry / GRAPH_FILE
        graph.write_bytes(graph.read_bytes()[:-100])
    elif damage == "no record":
        (entry / RECORD_FILE).unlink()
    else:  # an entry of another ONNX Runtime found under this key's name (copied from another machine)
        older = json.loads(record)
        older["key"]["onnxruntime"] = "1.0.0"
        (entry / RECORD_FILE).write_text(json.dumps(older))
    rebuilt = []

    def build() -> ServingGraph:
        rebuilt.append(1)
        return serving_graph(bundle, CONFIG, "auto")

    assert _prepared(bundle, key, tmp_path, build).folder == entry and rebuilt
    assert (entry / RECORD_FILE).read_text() == record  # the same files as prepared the first time
    assert entries(tmp_path) == [entry]  # the damaged one deleted, nothing staged left behind


def test_two_replicas_preparing_at_once_serve_one_entry(tiny_bundle: Path, tmp_path: Path) -> None:
    """Both find no entry and prepare one (each in its own staging folder, held until both have built their
    graph); the first rename wins, the other serves the winner's."""
    bundle = load_bundle(tiny_bundle)
    key = cache_key(bundle, CONFIG, "auto")
    both = threading.Barrier(2, timeout=60)
    found: list[prepared.Prepared] = []

    def build() -> ServingGraph:
        both.wait()
        return serving_graph(bundle, CONFIG, "auto")

    def replica() -> None:
        found.append(_prepared(bundle, key, tmp_path, build))

    threads = [threading.Thread(target=replica) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 2 and found[0].folder == found[1].folder
    assert entries(tmp_path) == [found[0].folder]


def test_a_cache_that_cannot_be_written_serves_the_bundles_graph(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache's folder would be")
    assert prepared_graph(blocked, cache_key(bundle, CONFIG, "auto"), _never, CONFIG) is None
    engine = Engine.from_bundle(bundle, replace(SETTINGS, compiled_cache=blocked))
    assert generate(engine, PROMPTS, 4) == generate(Engine.from_bundle(bundle, SETTINGS), PROMPTS, 4)


def test_prepare_only_prepares_the_entry_the_server_then_serves(
    tiny_bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`textgen-serve --prepare-only` (an init container's command, in the torch-free serving image) prepares
    the entry that a server of the same flags opens, and exits 0; run again, it finds that entry."""
    flags = ["--bundle", str(tiny_bundle), "--compiled-cache", str(tmp_path), "--threads", "1"]
    assert serve_main([*flags, "--prepare-only"]) == 0
    (entry,) = entries(tmp_path)
    assert str(entry) in capsys.readouterr().out
    record = (entry / RECORD_FILE).stat().st_mtime_ns
    assert serve_main([*flags, "--prepare-only"]) == 0 and entries(tmp_path) == [entry]
    settings = engine_settings(ServerSettings(bundle=tiny_bundle, compiled_cache=tmp_path, threads=1))
    Engine.from_bundle(load_bundle(tiny_bundle), settings)
    assert entries(tmp_path) == [entry] and (entry / RECORD_FILE).stat().st_mtime_ns == record


def test_prepare_only_fails_with_a_status_for_each_kind_of_problem(tiny_bundle: Path, tmp_path: Path) -> None:
    cache = ["--compiled-cache", str(tmp_path / "cache")]
    contradicting = ["--bundle", str(tiny_bundle), "--prepare-only", "--no-prepared-graph", *cache]
    assert serve_main(contradicting) == 2  # the flags contradict each other
    assert serve_main(["--bundle", str(tmp_path), "--prepare-only", *cache]) == 1  # no bundle there
    assert not (tmp_path / "cache").exists() or entries(tmp_path / "cache") == []

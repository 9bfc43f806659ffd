"""The serving benchmark's record on hand-made results: ratios, verdicts, the docs section and the plots."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.loadgen import BenchmarkOutput, EngineSteps, LoadConfig, RequestRecord, RunResult, summarize
from bench.scenarios import serving
from bench.scenarios.serving import Pair, Plan, Results, offline_rate, pinned_engine, save_summary
from bench.scenarios.serving_report import DOC_BEGIN, DOC_END, near, plot_all, targets, update_doc
from serve.process import allowed_cpus

PLAN = Plan(levels=(1, 16), requests_per_client=2, naive_requests=4, repeats=1, input_len=4, new_tokens=10)


def output(
    clients: int, tokens_per_second: float, gap: float, requests: int = 4, unary: bool = False
) -> BenchmarkOutput:
    """`requests` requests of 10 tokens, `gap` seconds apart, over a run that yields `tokens_per_second`;
    `unary`: as a Generate client records them (no first token or gaps seen)."""
    records = [
        RequestRecord(
            request_id=f"r{i}",
            start=0.01 * i,
            success=True,
            prompt_tokens=4,
            output_tokens=10,
            ttft=None if unary else 0.05 + 0.01 * i,
            itl=[] if unary else [gap] * 9,
            latency=0.05 + 0.01 * i + 9 * gap,
        )
        for i in range(requests)
    ]
    config = LoadConfig(target="127.0.0.1:1", concurrency=clients, num_requests=requests)
    summary = summarize(RunResult(records, duration=10 * requests / tokens_per_second), (90.0, 99.0))
    return BenchmarkOutput(config, {"name": "m"}, summary, records)


# 100 decode steps of 20 ms and 10 prefill steps of 100 ms in a 10 s run; 20 sequences, 220 tokens.
STEPS_16 = EngineSteps(10.0, 100, 2.0, 10, 1.0, 20, 220)


def results(tmp_path: Path, served_16: float, unary: bool = False) -> Results:
    model = {
        "name": "bench-a-random",
        "dtype": "float32",
        "quantization": "none",
        "vocab_size": 8192,
        "context_length": 1024,
        "d_model": 512,
        "n_layers": 8,
        "n_heads": 8,
        "d_ff": 2048,
        "positions": "learned",
    }
    return Results(
        plan=dataclasses.replace(PLAN, rpc="unary") if unary else PLAN,
        machine={
            "cpu": "test cpu",
            "cores": "2",
            "memory": "1 GiB",
            "os": "x",
            "python": "3",
            "onnxruntime": "1",
            "grpcio": "1",
            "load_1min": "2.0 at the start, 2.5 at the end",
        },
        bundle=tmp_path / "bundle",
        results_dir=tmp_path / "results",
        model=model,
        threads=2,
        spinning=False,
        max_batch=16,
        offline={1: 300.0, 16: 1000.0},
        server={
            1: output(1, 290.0, 0.01, unary=unary),
            16: dataclasses.replace(output(16, served_16, 0.02, unary=unary), steps=STEPS_16),
        },
        naive={1: output(1, 280.0, 0.01, unary=unary), 16: output(16, 100.0, 0.01, unary=unary)},
        arrivals=output(16, 500.0, 0.02),
        hf=None,
        commands=["textgen-serve --bundle B"],
        seconds=60.0,
    )


def test_the_summary_records_where_the_engine_and_the_load_generator_ran(tmp_path: Path) -> None:
    first = min(allowed_cpus())
    assert pinned_engine(str(first)) == (first,) and pinned_engine(None) is None  # JSON's kind of sequence
    pinned = dataclasses.replace(results(tmp_path, 900.0), plan=dataclasses.replace(PLAN, engine_cpus=(0,)))
    arrivals = pinned.arrivals
    pinned.arrivals = dataclasses.replace(arrivals, config=dataclasses.replace(arrivals.config, cpus=(1,)))
    save_summary(pinned, tmp_path / "summary.json")
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["plan"]["engine_cpus"] == [0]
    assert saved["arrivals"]["config"]["cpus"] == [1]


def test_a_bad_engine_cpu_list_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        serving.main(["--engine-cpus", "x"])
    assert exited.value.code == 2
    assert "'x' is not a CPU list such as 0-3,6" in capsys.readouterr().err


def test_the_arrivals_rate_comes_from_a_streamed_closed_loop() -> None:
    streamed = LoadConfig(target="127.0.0.1:1", concurrency=16, num_requests=64)
    assert serving.streamed_reference(streamed) is None  # its own rate will do
    unary = dataclasses.replace(streamed, rpc="unary")
    assert serving.streamed_reference(unary) == streamed


def test_offline_passes_go_on_until_they_have_run_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[int] = []

    def generate(engine: object, work: list[list[int]], **options: object) -> None:
        batches.append(len(work))
        time.sleep(0.01)

    monkeypatch.setattr(serving, "generate", generate)
    architecture = SimpleNamespace(vocab_size=50)
    bundle = SimpleNamespace(manifest=SimpleNamespace(architecture=architecture, eos_token_id=0))
    engine = SimpleNamespace(max_batch_size=16)
    long_enough = dataclasses.replace(PLAN, offline_seconds=0.2)
    rate = offline_rate(engine, bundle, long_enough, 4)(3)  # type: ignore[arg-type]
    assert 3 < len(batches) <= 20 and set(batches) == {4}
    assert rate <= 4 * PLAN.new_tokens / 0.01
    batches.clear()
    offline_rate(engine, bundle, PLAN, 4)(3)  # type: ignore[arg-type]
    assert len(batches) == 3


def test_targets_compare_with_offline_and_naive_at_16_clients(tmp_path: Path) -> None:
    met = "\n".join(targets(results(tmp_path, served_16=950.0)))
    assert "served ÷ offline engine at batch 16: **0.95**" in met and "served ÷ naive server: **9.5×**" in met
    assert "**missed**" not in met  # ITL: constant gaps, p99 ÷ median = 1
    missed = "\n".join(targets(results(tmp_path, served_16=450.0)))
    assert "**0.45** (target ≥ 0.9): **missed**" in missed and "**4.5×** (target ≥ 5×): **missed**" in missed


def test_a_figure_next_to_its_target_is_shown_with_the_digits_its_verdict_needs() -> None:
    assert near(0.8996, 2, 0.9) == "0.8996" and near(0.9004, 2, 0.9) == "0.9004"
    assert near(0.87, 2, 0.9) == "0.87" and near(0.9, 2, 0.9) == "0.90" and near(3.04, 1, 3.0) == "3.04"


def test_the_offline_target_uses_the_alternated_pairs_when_there_are_some(tmp_path: Path) -> None:
    drifted = dataclasses.replace(
        results(tmp_path, served_16=450.0),
        # offline passes 1100, 900, 700, 1140 around three served runs: the machine slowed, then sped up
        pairs=[Pair(1100.0, 950.0, 900.0), Pair(900.0, 680.0, 700.0), Pair(700.0, 840.0, 1140.0)],
    )
    line = targets(drifted)[1]
    assert "**0.91** (target ≥ 0.9): **met**" in line  # median of 950/1000, 680/800, 840/920
    assert "680 ÷ (900, 700) = 0.85" in line and "minutes apart: 0.45" in line


def test_doc_section_is_replaced_in_place_and_the_rest_kept(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text("# Benchmarks\n\n## Engine\nengine figures\n")
    images = [tmp_path / "docs" / "images" / name for name in ("a.png", "b.png", "c.png")]
    update_doc(results(tmp_path, served_16=950.0), images, doc, argv_used=["--quick"])
    doc.write_text(doc.read_text() + "\n## After\nlater text\n")
    update_doc(results(tmp_path, served_16=800.0), images, doc, argv_used=[])
    text = doc.read_text()
    assert text.count(DOC_BEGIN) == 1 and text.count(DOC_END) == 1
    assert (
        text.index("engine figures") < text.index(DOC_BEGIN) < text.index(DOC_END) < text.index("later text")
    )
    assert "**0.80**" in text and "**0.95**" not in text  # the second run's figures only
    assert "![throughput vs concurrency](images/a.png)" in text
    # the server's steps, where the run recorded them (the 16-client level here)
    assert "| 16 | 100 × 20.0 ms | 2.0 | 10 × 100.0 ms | 2.0 | 0.30 | 63.64 |" in text
    assert "| 1 | " not in text.split("### Inside the server")[1]
    assert "| 16 | 800 | 100 | 1000 | — | 0.80 | 8.0 |" in text
    assert "(median of 1 pass, after a warm-up)" in text
    timed = results(tmp_path, served_16=800.0)
    timed = dataclasses.replace(timed, plan=dataclasses.replace(timed.plan, offline_seconds=2.0))
    update_doc(timed, images, doc, argv_used=[])
    assert "(median of 1 pass or as many as run 2 s, after a warm-up)" in doc.read_text()


def test_plots_are_written(tmp_path: Path) -> None:
    paths = plot_all(results(tmp_path, served_16=950.0), tmp_path / "images")
    assert [p.name for p in paths] == [
        "serving_throughput.png",
        "serving_latency.png",
        "serving_latency_cdf.png",
    ]
    for path in paths:
        assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000


def test_a_unary_run_plots_end_to_end_latency_and_says_what_the_clients_called(tmp_path: Path) -> None:
    unary = results(tmp_path, served_16=950.0, unary=True)
    paths = plot_all(unary, tmp_path / "images")  # no TTFT or ITL to put on a log scale
    assert all(path.read_bytes().startswith(b"\x89PNG") for path in paths)
    doc = tmp_path / "benchmarks.md"
    update_doc(unary, paths, doc, argv_used=["--rpc", "unary"])
    text = doc.read_text()
    assert "the unary `Generate`" in text and "Per level: Generate request count" in text
    assert "**0.95**" in text

"""bench.scenarios.priority: both policies served against the tiny bundle, and what its figures read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.loadgen import RequestRecord
from bench.scenarios.priority import POLICIES, Run, figures, longest_pause, main


def record(rid: str, start: float, ttft: float, latency: float, itl: list[float]) -> RequestRecord:
    return RequestRecord(rid, start, success=True, ttft=ttft, itl=itl, latency=latency)


def test_the_figures_follow_the_stream_preempted_in_the_priority_run() -> None:
    streams = [
        record("low-0", 0.0, 0.01, 0.2, [0.01, 0.01]),
        record("low-1", 0.0, 0.01, 0.9, [0.01, 0.3]),  # its pause: a preemption's
        record("low-2", 0.0, 0.6, 1.2, [0.02]),
    ]
    run = Run([*streams, record("urgent", 0.5, 0.02, 0.1, [])], preemptions=1)
    assert longest_pause(run.records) == "low-1"
    got = figures(run, "low-1")
    assert (got.urgent_ttft_ms, got.urgent_e2el_ms) == pytest.approx((20.0, 100.0))
    assert (got.watched_e2el_ms, got.watched_pause_ms) == pytest.approx((900.0, 300.0))
    assert (got.streams_e2el_p50_ms, got.streams_end_s, got.preemptions) == pytest.approx((900.0, 1.2, 1))
    assert figures(run, "low-2").watched_e2el_ms == pytest.approx(1200.0)


def test_the_benchmark_serves_both_policies(tiny_bundle: Path, tmp_path: Path) -> None:
    out = tmp_path / "priority.json"
    args = ["--bundle", str(tiny_bundle), "--rounds", "1", "--rows", "2", "--streams", "4", "--threads", "1"]
    assert (
        main(
            [
                *args,
                "--new-tokens",
                "48",
                "--urgent-tokens",
                "4",
                "--urgent-after",
                "0.05",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = json.loads(out.read_text())
    assert list(runs) == list(POLICIES) and all(len(r) == 1 for r in runs.values())
    assert runs["fcfs"][0]["preemptions"] == 0  # fcfs never preempts
    assert all(r[0]["urgent_ttft_ms"] > 0 for r in runs.values())


def test_the_server_must_be_saturated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--bundle", "b", "--rows", "4", "--streams", "4"])
    assert "must be fewer than --streams" in capsys.readouterr().err

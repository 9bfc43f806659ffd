"""textgen-bench step-profile: a step's operators are read from ONNX Runtime's profile by run, and the
offline split counts one session run per decode step."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios.served_peers import Workload
from bench.scenarios.step_profile import offline, ops_by_phase
from serve.bundle import load_bundle


def _run(ts: int, dur: int) -> dict[str, object]:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(op: str, ts: int, dur: int) -> dict[str, object]:
    return {"cat": "Node", "name": f"{op}_{ts}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_operators_are_summed_by_the_run_they_ran_in_and_earlier_runs_are_left_out() -> None:
    trace = [
        _run(0, 100),  # the warm-up pass: not read
        _node("MatMul", 10, 50),
        _run(200, 100),  # prefill
        _node("MatMul", 210, 40),
        _node("Add", 260, 10),
        _node("MatMul_fence", 260, 10) | {"name": "MatMul_fence_before"},  # not a kernel's time
        _run(400, 50),  # decode
        _node("MatMul", 410, 20),
        _run(500, 50),  # decode
        _node("MatMul", 510, 30),
        _node("Softmax", 540, 5),
    ]
    phases = ops_by_phase(trace, prefill_runs=1, decode_runs=2)
    assert phases["prefill"] == {"MatMul": 0.04, "Add": 0.01}
    assert phases["decode"] == {"MatMul": 0.05, "Softmax": 0.005}
    assert list(phases["decode"]) == ["MatMul", "Softmax"]  # largest first


def test_offline_split_runs_the_session_once_a_decode_step(tiny_bundle: Path) -> None:
    manifest = load_bundle(tiny_bundle).manifest
    work = Workload(prompt_len=8, max_tokens=6, threads=1, vocab=manifest.architecture.vocab_size)
    cell = offline(tiny_bundle, 2, work)
    decode, prefill = cell["decode"], cell["prefill"]
    assert decode["steps"] == decode["runs"] == 5
    assert prefill["runs"] >= 1
    for phase in (decode, prefill):
        assert 0 < phase["onnxruntime_ms"] <= phase["wall_ms"]
        assert phase["python_ms"] == pytest.approx(phase["wall_ms"] - phase["onnxruntime_ms"])
        assert "MatMul" in phase["ops_ms"] and all(ms > 0 for ms in phase["ops_ms"].values())

"""The same-weights benchmark's parts: /proc readings, the weights a step reads, the plan, the peers' cells
read from their files, the report on hand-made cells, and a served cell on the tiny bundle against the
engine cell."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from bench.proc import CpuMeter, cpu_seconds, descendants, own_cpu_seconds, tree_rss_mib
from bench.scenarios import engine, peers
from bench.scenarios.peers import STACKS, PeerCell, cell_key, peers_env, plan, report, run_peer, weight_bytes

ROOT = Path(__file__).resolve().parents[2]

# --- /proc -------------------------------------------------------------------------------------------------


def test_cpu_meter_counts_the_named_processes_and_the_rest_apart() -> None:
    start = own_cpu_seconds()
    with CpuMeter([os.getpid()]) as meter:
        while own_cpu_seconds() - start < 0.2:  # CPU time, however busy the machine is
            pass
    (own,) = meter.cpu.values()
    assert own == pytest.approx(own_cpu_seconds() - start, abs=0.03)  # /proc's ticks against getrusage
    assert own <= meter.wall + 0.03  # one thread
    assert 0.0 <= meter.other_load <= 1.0


def test_descendants_and_their_memory() -> None:
    def starting(child: str) -> str:
        start = f"subprocess.Popen([sys.executable, '-c', {child!r}])"
        return f"import subprocess, sys, time; {start}; time.sleep(30)"

    parent = subprocess.Popen([sys.executable, "-c", starting(starting("import time; time.sleep(30)"))])
    try:
        deadline = time.monotonic() + 10
        while len(found := descendants(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(found) == 2  # its child and that child's child
        own = [tree_rss_mib(p) for p in (parent.pid, *found)]  # each process's, and below it
        assert own[0] > own[1] > own[2] > 0
        assert cpu_seconds(found[-1]) >= 0
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


# --- the weights a step reads ------------------------------------------------------------------------------


def test_weight_bytes_counts_a_lookup_table_apart_from_what_a_step_streams(tmp_path: Path) -> None:
    def init(name: str, shape: tuple[int, ...]) -> TensorProto:
        return numpy_helper.from_array(np.zeros(shape, np.float32), name)

    nodes = [
        helper.make_node("Gather", ["embed", "ids"], ["x"]),  # a lookup table
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Gather", ["tied", "ids"], ["y"]),  # looked up, and multiplied whole: streamed
        helper.make_node("MatMul", ["h", "tied"], ["logits"]),
        helper.make_node("Add", ["logits", "bias"], ["out"]),
    ]
    weights = [init("embed", (100, 8)), init("w", (8, 8)), init("tied", (16, 8)), init("bias", (16,))]
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [1])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 16])
    graph = helper.make_graph(nodes, "g", [ids], [out], weights)
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph), str(path))
    sizes = weight_bytes(path)
    assert sizes.lookup == 100 * 8 * 4
    assert sizes.streamed == (8 * 8 + 16 * 8 + 16) * 4


# --- the plan and the peers' cells -------------------------------------------------------------------------


def test_the_plan_runs_every_cell_once_and_rotates_the_first_stack() -> None:
    order = list(plan([1, 16], ["fp32", "int8"]))
    assert sorted(order) == sorted((s, p, b) for s in STACKS for p in ("fp32", "int8") for b in (1, 16))
    groups = [order[i : i + len(STACKS)] for i in range(0, len(order), len(STACKS))]
    assert [g[0][0] for g in groups] == list(STACKS)  # each group starts one further on
    assert all(len({(p, b) for _, p, b in g}) == 1 for g in groups)  # a group: one precision and batch


def test_a_peer_cell_is_run_in_a_work_folder_of_its_own_and_read_from_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = tmp_path / "prepared"
    for name in ("models", "artifacts", "venv"):
        (prepared / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    env = peers_env(Path("prepared"), Path("scratch"))  # run.sh works in the scratch folder: made absolute
    assert Path(env["ANCHOR_RESULTS"]).is_absolute() and Path(env["ANCHOR_VENV"]).is_absolute()
    assert (tmp_path / "scratch" / "models").resolve() == prepared / "models"
    assert env["ANCHOR_IDLE_WAIT"] == "0" and env["ANCHOR_ATTEMPTS"] == "1"  # as textgen's cells: no reruns
    calls: list[tuple[list[str], dict[str, str]]] = []

    def fake_run(anchors: Path, cells: list[str], pass_no: int, env: dict[str, str]) -> Path:
        calls.append((cells, env))
        out = Path(env["ANCHOR_RESULTS"]) / f"pass{pass_no}"
        out.mkdir(parents=True, exist_ok=True)
        record = {"status": "ok", "tok_per_s": 500.0, "walls_s": [1.0], "ttft_s_median": 0.01}
        record |= {"peak_rss_mb": 99.0, "first_row_tokens": [1, 2], "foreign_cpu_frac": 0.02}
        (out / "llama.cpp__q4_0__B-llama__b4.json").write_text(json.dumps(record))
        return out

    monkeypatch.setattr(peers, "run_anchors", fake_run)
    cell = run_peer(tmp_path, peers.peer_cell("llama.cpp", "int4", 4), env)
    assert calls[0][0] == ["llamacpp B-llama q4_0 b4"]  # the label run_all.py's --only matches
    assert cell["tok_s"] == 500.0 and cell["other_load"] == 0.02 and cell["first_row_tokens"] == [1, 2]
    missing = run_peer(tmp_path, PeerCell("ort-genai", "int4", 1, "ortgenai B-llama int4 b1"), env)
    assert "error" in missing


# --- the report --------------------------------------------------------------------------------------------


def _cell(tok_s: float, tokens: list[int], **extra: Any) -> dict[str, Any]:
    cell = {"tok_s": tok_s, "ttft_s": 0.01, "peak_rss_mb": 100.0, "first_row_tokens": tokens}
    return cell | {"other_load": 0.05} | extra


def test_the_report_divides_by_the_best_peer_and_the_engine() -> None:
    ref = list(range(16))
    us = {"front_end": 30.0, "event_loop": 25.0, "engine": 900.0, "load_generator": 20.0}
    cells = {
        # of its passes, the one least disturbed by other processes
        cell_key("textgen engine", "fp32", 1): [
            _cell(200, ref, other_load=0.5),
            _cell(250, ref, other_load=0.1),
        ],
        cell_key("textgen served", "fp32", 1): [_cell(125, ref, us_per_token=us)],
        cell_key("ort-genai", "fp32", 1): [_cell(500, ref)],
        cell_key("llama.cpp", "fp32", 1): [_cell(400, ref[:8] + [99] * 8)],
    }
    record = {
        "cells": cells,
        "reference": {"first_row_tokens": ref},
        "machine": {"read_gbps": 10.0},
        "weights": {"fp32": {"streamed": 100_000_000, "lookup": 16_000_000}},
    }
    text = report(record, ["fp32"], [1])
    assert "| engine fp32 | 0.50 |" in text  # 250 / the faster peer's 500
    assert "| served fp32 | 0.25 |" in text
    assert "| fp32 | 0.50 | 30 (25), 900, 20 |" in text  # served ÷ engine, CPU a token
    assert "| llama.cpp | f32 | 400 |" in text and "8/16" in text  # its tokens drift from the reference
    assert "| fp32 | 100.0 MB | 16.0 MB | 100 | 250 (2.50 of it) |" in text  # 10 GB/s / 100 MB a step


# --- a served cell against the engine cell, on the tiny bundle ---------------------------------------------


def test_a_served_cell_streams_the_engine_cells_tokens(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def rows(batch: int) -> np.ndarray:
        return np.random.default_rng(0).integers(3, 300, size=(max(16, batch), 8))[:batch]

    for module in (engine, peers):
        monkeypatch.setattr(module, "prompt_rows", rows)
        monkeypatch.setattr(module, "NEW_TOKENS", 60)  # enough steps for CPU time in 10 ms ticks
    monkeypatch.setattr(peers, "PROMPT_LEN", 8)
    monkeypatch.chdir(ROOT)
    served = peers.served_cell(tiny_bundle, 4, 3, ["--threads", "1"], tmp_path / "serve.log")
    offline = engine.run_cell(tiny_bundle, 4, threads=1, repeats=1)
    assert served["first_row_tokens"] == offline["first_row_tokens"]
    assert len(served["first_row_tokens"]) == 16
    assert served["tok_s"] > 0 and served["ttft_s"] > 0 and len(served["walls"]) == 3
    us = served["us_per_token"]
    assert us["front_end"] > 0 and us["engine"] > 0 and us["load_generator"] > 0 and us["event_loop"] >= 0
    assert 0 < served["server_rss_mb"] < served["peak_rss_mb"]


def test_a_disturbed_cell_is_measured_again_and_the_least_disturbed_kept() -> None:
    args = argparse.Namespace(idle_wait=0.0, attempts=3, max_other_load=0.2)
    loads = iter([0.6, 0.4, 0.5])
    cell = peers.least_disturbed(lambda: {"tok_s": 1.0, "other_load": next(loads)}, args)
    assert cell["other_load"] == 0.4 and cell["attempt"] == 2  # all three tried, the quietest kept
    quiet = iter([0.1, 0.9])
    assert peers.least_disturbed(lambda: {"other_load": next(quiet)}, args)["attempt"] == 1
    assert "error" in peers.least_disturbed(lambda: {"error": "import failed"}, args)


def test_runs_merge_and_a_cell_keeps_its_quietest_fastest_pass() -> None:
    def record(machine: float, cell: dict[str, Any]) -> dict[str, Any]:
        return {"started": "t", "machine": {"read_gbps": machine}, "cells": {"k": [cell]}, "weights": {}}

    runs = [record(10.0, _cell(100, [], other_load=0.5)), record(20.0, _cell(90, [], other_load=0.02))]
    runs.append(record(15.0, _cell(95, [], other_load=0.04)))  # as quiet as the quietest, and faster
    both = peers.merged(runs)
    assert both["machine"]["read_gbps"] == 20.0 and len(both["cells"]["k"]) == 3
    kept = peers.quietest_cell(both["cells"]["k"])
    assert kept is not None and kept["tok_s"] == 95

"""The memory benchmark's parts: a textgen cell over HTTP (every process of the server read), and the report
on hand-made records (the table, and the weight factors the records ask of the sizing formula)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.scenarios.served_memory import factor_table, predicted, report, run_cell
from bench.scenarios.served_peers import Workload, textgen_command
from bench.servers import free_port
from serve.api.sizing import FIXED_BYTES, MIB

TINY = Workload(slots=4, ctx_per_slot=64, threads=1, prompt_len=6, max_tokens=8, vocab=320)


def test_a_cell_reads_the_front_end_and_the_engine_process(tiny_bundle: Path, tmp_path: Path) -> None:
    port = free_port()
    command = textgen_command(tiny_bundle, port, TINY, ["--prefix-cache-rows", "0"])
    cell = run_cell(command, port, tmp_path / "server.log", TINY, requests=2, seed=5)
    assert cell["failed"] == 0 and cell["ready_s"] > 0
    processes = list(cell["processes"].values())
    assert len(processes) >= 2  # the front end, the engine process (and multiprocessing's helpers)
    assert cell["front_end_mib"] == processes[0]["rss_mib"]
    assert cell["steady_mib"] == pytest.approx(sum(p["rss_mib"] for p in processes))
    assert all(p["rss_mib"] <= p["hwm_mib"] for p in processes)
    assert cell["anon_mib"] + cell["file_mib"] <= cell["steady_mib"] + 1e-6  # shared memory is the rest


def _record(server: str, context: int, steady: float, peak: float) -> dict[str, object]:
    return {
        "round": 0,
        "server": server,
        "precision": "fp32",
        "context": context,
        "ready_s": 2.0,
        "steady_mib": steady,
        "peak_mib": peak,
        "front_end_mib": 100.0,
        "file_mib": 10.0,
        "failed": 0,
    }


def test_the_report_compares_the_servers_and_fits_the_formulas_factors(tiny_bundle: Path) -> None:
    fixed = FIXED_BYTES / MIB
    formula = predicted(tiny_bundle, TINY) | {"weights_mib": 100.0}
    result = {
        "command": "textgen-bench served-memory",
        "machine": {"cpu": "a CPU", "cores": "2", "onnxruntime": "1"},
        "started": "now",
        "slots": 4,
        "contexts": [64, 128],
        "precisions": ["fp32"],
        "kv_mib": {
            "fp32": {
                "64": {"textgen": 10.0, "llama-server": 5.0},
                "128": {"textgen": 20.0, "llama-server": 10.0},
            }
        },
        "predicted": {"fp32": {"64": formula, "128": formula}},
        "records": [
            _record("textgen", 64, fixed + 10 + 110, fixed + 10 + 150),  # 1.1 / 1.5 x the weights
            _record("llama-server", 64, fixed, fixed),
            _record("textgen", 128, fixed + 20 + 120, fixed + 20 + 120),  # 1.2 / 1.2
            _record("llama-server", 128, fixed, fixed),
        ],
    }
    assert "| 1.20 / 1.50 |" in factor_table(result)[2]  # the largest over the contexts, each
    text = report(result)
    assert f"| **{(fixed + 120) / fixed:.2f}** |" in text
    assert "| 100 + " in text and "2.0 s; 2.0 s" in text
    assert "first start" not in text  # no first start recorded: no such table


def test_a_first_start_is_reported_apart_from_the_later_ones(tiny_bundle: Path) -> None:
    fixed = FIXED_BYTES / MIB
    later = _record("textgen", 64, fixed + 120, fixed + 130)
    first = later | {"ready_s": 9.0, "peak_mib": fixed + 900.0, "start": "first"}
    result = {
        "command": "textgen-bench served-memory",
        "machine": {"cpu": "a CPU", "cores": "2", "onnxruntime": "1"},
        "started": "now",
        "slots": 4,
        "contexts": [64],
        "precisions": ["fp32"],
        "kv_mib": {"fp32": {"64": {"textgen": 10.0, "llama-server": 5.0}}},
        "predicted": {"fp32": {"64": predicted(tiny_bundle, TINY) | {"weights_mib": 100.0}}},
        "records": [first, later, _record("llama-server", 64, fixed, fixed)],
    }
    text = report(result)
    assert f"| fp32 | 9.0 s, {fixed + 900:,.0f} MiB | 2.0 s, {fixed + 130:,.0f} MiB |" in text
    assert "2.0 s; 2.0 s" in text and f"{fixed + 900:,.0f} MiB" not in text.split("first start")[0]

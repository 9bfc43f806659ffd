"""The engine benchmark's cells: the peak RSS a cell reports is its own, not that of the process it was
started from (Linux carries getrusage's ru_maxrss across execve); a cell runs its engine spinning or not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.proc import peak_rss_mib
from bench.scenarios import engine
from serve.bundle import Bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings

REPO = Path(__file__).resolve().parents[2]
HELD_MB = 256


def test_a_cell_reports_its_own_peak_rss_not_its_parents() -> None:
    held = np.ones(HELD_MB * 2**20, np.uint8)  # touched: resident in this (the parent) process
    assert peak_rss_mib() > HELD_MB
    code = "from bench.proc import peak_rss_mib; print(peak_rss_mib())"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO, env=env
    )
    assert float(out.stdout) < HELD_MB / 2  # the interpreter and numpy: tens of MB
    del held


@pytest.mark.parametrize("spinning", [True, False])
def test_a_cell_runs_its_engine_spinning_or_not_and_generates_alike(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch, spinning: bool
) -> None:
    """`--no-spinning` reaches the cell's ONNX Runtime session (textgen-serve --no-spinning); same tokens."""
    seen: list[bool] = []
    original = Engine.from_bundle.__func__  # type: ignore[attr-defined]

    def recording(cls: type[Engine], bundle: Bundle, settings: EngineSettings) -> Engine:
        seen.append(settings.session.spinning)
        return original(cls, bundle, settings)

    monkeypatch.setattr(Engine, "from_bundle", classmethod(recording))
    monkeypatch.setattr(engine, "NEW_TOKENS", 24)  # 32 prompt + 24 new fit the tiny context
    rows = engine.prompt_rows
    monkeypatch.setattr(engine, "prompt_rows", lambda b: rows(b) % 300 + 3)  # the tiny vocabulary
    cell = engine.run_cell(tiny_bundle, 2, threads=1, repeats=1, spinning=spinning)
    reference = engine.run_cell(tiny_bundle, 2, threads=1, repeats=1)
    assert seen == [spinning, True]
    assert cell["first_row_tokens"] == reference["first_row_tokens"]

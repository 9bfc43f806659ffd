"""The engine benchmark's cells: the peak RSS a cell reports is its own, not that of the process it was
started from (Linux carries getrusage's ru_maxrss across execve)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.proc import peak_rss_mib

REPO = Path(__file__).resolve().parents[1]
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

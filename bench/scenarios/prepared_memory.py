"""The engine's memory and ready time with and without the prepared graph (serve/engine/prepared.py), each
start in a process of its own, opened as the engine process opens it:

    textgen-bench prepared-memory BUNDLE --cache DIR [--rows 16] [--positions 256] [--threads 2]

prints one JSON line per start: the bundle's graph, with `--speculative` (4 tokens), the prepared graph's
first start (it prepares; DIR is emptied first), a later one, with `--speculative`, and two replicas at once
(each one's proportional set size read while both hold the engine). Memory from /proc: VmRSS, RssAnon,
RssFile, VmHWM and Pss (a shared page counted once over its mappings), in MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_STATUS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def memory(pid: str = "self") -> dict[str, int]:
    """The process's resident memory figures, in MiB."""
    figures = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS:
            figures[key] = int(value.split()[0]) // 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            figures["Pss"] = int(line.split()[1]) // 1024
    return figures


def open_once(args: argparse.Namespace) -> None:
    """In this process: open the engine, print its figures, then hold it `--hold` seconds."""
    from serve.bundle import load_bundle
    from serve.engine.engine import open_engine
    from serve.engine.runtime import onnxruntime
    from serve.engine.types import EngineSettings, SessionConfig, SpeculationSettings

    onnxruntime()  # imported by the engine process before its engine too
    settings = EngineSettings(
        max_batch_size=args.rows,
        capacity=args.positions,
        session=SessionConfig(threads=args.threads, spinning=False),
        compiled_cache=args.cache if args.prepared else None,
        speculation=SpeculationSettings(num_tokens=args.speculative),
    )
    started = time.perf_counter()
    engine = open_engine(load_bundle(args.bundle), settings)
    ready = round(time.perf_counter() - started, 2)
    line = {"prepared": args.prepared, "speculative": args.speculative, "ready_s": ready, **memory()}
    print(json.dumps(line))
    sys.stdout.flush()
    time.sleep(args.hold)
    del engine  # held until now: its sessions' mappings are what is measured


def _command(args: argparse.Namespace, prepared: bool, speculative: int = 0, hold: float = 0) -> list[str]:
    return [
        sys.executable, "-m", "bench", "prepared-memory", str(args.bundle), "--cache", str(args.cache),
        "--rows", str(args.rows), "--positions", str(args.positions), "--threads", str(args.threads),
        "--one", "--speculative", str(speculative), "--hold", str(hold),
    ] + (["--prepared"] if prepared else [])  # fmt: skip


def _replicas(args: argparse.Namespace, prepared: bool) -> dict[str, Any]:
    """Two starts at once; each one's Pss read once both are ready."""
    procs = [
        subprocess.Popen(_command(args, prepared, hold=600), stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        ready = [json.loads(proc.stdout.readline()) for proc in procs if proc.stdout is not None]
        pss = [memory(str(proc.pid))["Pss"] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    return {"replicas": 2, "prepared": prepared, "ready": ready, "Pss_both": pss}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--cache", type=Path, required=True, help="the compiled cache (emptied first)")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--positions", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prepared", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--speculative", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hold", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        open_once(args)
        return 0
    shutil.rmtree(args.cache, ignore_errors=True)
    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]}")
    for prepared, speculative in ((False, 0), (False, 4), (True, 0), (True, 0), (True, 4)):
        subprocess.run(_command(args, prepared, speculative), check=True)
    for prepared in (False, True):
        print(json.dumps(_replicas(args, prepared)))
    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]}")
    return 0

"""`python -m serve` as a subprocess on loopback ports, for the tests that start, drain and kill servers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.proc import tree_status_mib

REPO = Path(__file__).resolve().parents[2]
SLOW_SERVER = REPO / "tests" / "support" / "slow_server"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


class ServerProcess:
    """`python -m serve` with the given flags on loopback ports, its decode steps slowed by 20 ms
    (tests/support/slow_server/sitecustomize.py) so streams are still running when a test acts; `slow=False`:
    the server as it is."""

    def __init__(self, *args: str, slow: bool = True) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTGEN_")}
        if slow:
            env["PYTHONPATH"] = os.pathsep.join([str(SLOW_SERVER), *filter(None, [env.get("PYTHONPATH")])])
            env["SLOW_DECODE_SECONDS"] = "0.02"
        loopback = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--http-host", "127.0.0.1"]
        if "--http-port" not in args:
            loopback += ["--http-port", "0"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serve", *loopback, *args],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._port = threading.Event()
        self.port = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                self._port.set()

    def wait_serving(self, timeout: float = 60) -> str:
        assert self._port.wait(timeout), "".join(self.lines)
        target = f"127.0.0.1:{self.port}"
        deadline = time.monotonic() + timeout
        while health_status(target) != SERVING:
            assert time.monotonic() < deadline and self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.05)
        return target


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m serve` on loopback (any metrics port) until it exits."""
    loopback = ["--host", "127.0.0.1", "--metrics-port", "0", "--http-port", "0"]
    command = [sys.executable, "-m", "serve", *loopback, *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)  # a hang guard


def served_memory_mib(args: Sequence[str], bodies: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """The resident memory (steady, peak; MiB) of all the processes of `python -m serve` with `args`, after
    it answered each completion body in turn over HTTP."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ServerProcess(*args, "--http-port", str(port), slow=False)
    try:
        server.wait_serving()
        for body in bodies:
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as reply:
                assert reply.status == 200
        steady = sum(tree_status_mib(server.proc.pid, "VmRSS").values())
        peak = sum(tree_status_mib(server.proc.pid, "VmHWM").values())
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)
    return steady, peak

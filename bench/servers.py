"""The servers a scenario starts and stops: textgen-serve (ours), the naive server (bench/naive_server.py)
and llama.cpp's llama-server, each a subprocess that a scenario uses once it answers and that is stopped
(SIGTERM, then SIGKILL) when the scenario is done with it."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def textgen_command(bundle: Path, *flags: str) -> list[str]:
    """`textgen-serve` on `bundle` through this interpreter: the code of the checkout it runs in."""
    return [sys.executable, "-m", "serve", "--bundle", str(bundle), *flags]


def naive_command(bundle: Path, *flags: str) -> list[str]:
    """The naive server (bench/naive_server.py: one lock around a batch-1 engine) on `bundle`."""
    return [sys.executable, "-m", "bench.naive_server", "--bundle", str(bundle), *flags]


def llama_server_command(
    bin_dir: Path, gguf: Path, port: int, slots: int, ctx_per_slot: int, threads: int
) -> list[str]:
    """llama-server with `slots` parallel sequences of `ctx_per_slot` positions each (its context is shared
    by the slots), continuous batching (its default), `threads` for both decode and prompt batches."""
    return [
        str(bin_dir / "llama-server"),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(slots * ctx_per_slot)),
        *("-t", str(threads), "-tb", str(threads), "--no-webui"),
    ]


@contextlib.contextmanager
def server_process(
    command: list[str],
    log_path: Path,
    target: str,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    answers: Callable[[], bool] | None = None,
    interval: float = 0.5,
    timeout: float = 300.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server subprocess (`env`: variables set for it on top of ours; run in `cwd`), yielded once it is
    ready (`answers()` is true, asked every `interval` seconds; by default, once it answers GetModelInfo on
    `target`; an error after `timeout` seconds); SIGTERM (then SIGKILL) afterwards."""
    assignments = [f"{name}={value}" for name, value in (env or {}).items()]
    print(f"$ {shlex.join(assignments + command)}", flush=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})}
        )
        try:
            ready = grpc_answers(target) if answers is None else answers
            wait_until(process, log_path, ready, timeout, interval)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def grpc_answers(target: str) -> Callable[[], bool]:
    """Whether the server on `target` answers GetModelInfo (textgen-serve and the naive server)."""
    import grpc

    from serve._proto.textgen.v1 import textgen_pb2 as pb
    from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

    def answers() -> bool:
        with grpc.insecure_channel(target) as channel:
            try:
                pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=2)
            except grpc.RpcError:
                return False
            return True

    return answers


def http_answers(port: int, path: str = "/v1/models") -> bool:
    """Whether GET `path` answers 200 (llama-server answers 503 while it loads)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_until(
    process: subprocess.Popen[bytes],
    log_path: Path,
    answers: Callable[[], bool],
    timeout: float = 300.0,
    interval: float = 0.5,
) -> None:
    """Until `answers()` is true, asked every `interval` seconds; an error naming the log if the server
    exits first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while not answers():
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready after {timeout:.0f} s; see {log_path}")
        time.sleep(interval)

"""The serving side's import boundary: no torch, no export, and a clear line without ONNX Runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SERVE_MODULES = [
    "serve.bundle",
    "serve.api.cli",
    "serve.api.client",
    "serve.engine.engine",
    "serve.api.metrics",
    "serve.scheduling.offline",
    "serve.scheduling.scheduler",
    "serve.api.grpc_service",
    "serve.api.lifecycle",
    "serve.api.loading",
    "serve.api.state",
]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )


def test_serve_never_imports_torch_or_export() -> None:
    imports = "; ".join(f"import {m}" for m in SERVE_MODULES)
    check = (
        "import sys; bad = sorted(m for m in sys.modules if m == 'torch' or m == 'export' "
        "or m.startswith(('torch.', 'export.'))); print(bad); assert not bad"
    )
    result = run_python(f"{imports}; {check}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_server_process_loads_neither_onnxruntime_nor_onnx() -> None:
    # Its engine runs in a process of its own; importing the whole server must not pull them in.
    imports = "; ".join(f"import {m}" for m in SERVE_MODULES)
    check = "import sys; loaded = [m for m in ('onnxruntime', 'onnx') if m in sys.modules]; assert not loaded"
    result = run_python(f"{imports}; {check}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_console_script_module_leaves_the_front_end_unimported() -> None:
    # textgen-serve's spawned engine process imports the script's module again (multiprocessing runs the
    # parent's main script): it must not bring the front end's servers along.
    front = ("grpc", "fastapi", "uvicorn", "prometheus_client", "serve.api.lifecycle")
    check = f"import sys, serve.api.cli; loaded = [m for m in {front} if m in sys.modules]; print(loaded)"
    check += "; assert not loaded"
    result = run_python(check)
    assert result.returncode == 0, result.stdout + result.stderr


def test_missing_onnxruntime_is_one_clear_line(tiny_bundle: Path, tmp_path: Path) -> None:
    # A package named onnxruntime that cannot be imported, ahead of the real one in every process the server
    # starts (its engine process too), stands for an install without either extra.
    (tmp_path / "onnxruntime").mkdir()
    (tmp_path / "onnxruntime" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TEXTGEN_")}
    env["PYTHONPATH"] = str(tmp_path)
    ports = ["--port", "0", "--metrics-port", "0", "--http-port", "0"]
    command = [sys.executable, "-m", "serve", "--bundle", str(tiny_bundle), *ports]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=120, env=env)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "start-up failed" in errors[0] and "install the 'cpu' extra" in errors[0]
    assert "'gpu' extra" in errors[0]

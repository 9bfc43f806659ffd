"""The serving side's import boundary: no torch, no export, and a clear line without ONNX Runtime."""

from __future__ import annotations

import subprocess
import sys

SERVE_MODULES = [
    "serve.bundle",
    "serve.cli",
    "serve.client",
    "serve.engine",
    "serve.metrics",
    "serve.offline",
    "serve.scheduler",
    "serve.server",
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


def test_missing_onnxruntime_is_one_clear_line() -> None:
    # sys.modules[name] = None makes `import name` fail, as in an install without either extra.
    result = run_python("import sys; sys.modules['onnxruntime'] = None; import serve.engine")
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "install the 'cpu' extra" in last and "'gpu' extra" in last, last

"""The committed stubs under serve/_proto match what scripts/gen_proto.py makes from the .proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "serve" / "_proto"


def _generated_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*.py*"))
        if p.suffix in (".py", ".pyi")
    }


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _generated_files(tmp_path)
    committed = _generated_files(COMMITTED)
    assert fresh.keys() == committed.keys()
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto` (python scripts/gen_proto.py) and commit"


def test_stubs_import_by_package_path() -> None:
    from serve._proto.textgen.v1 import textgen_pb2, textgen_pb2_grpc

    service = textgen_pb2.DESCRIPTOR.services_by_name["TextGeneration"]
    methods = ["Generate", "GenerateStream", "GetModelInfo", "Tokenize", "Detokenize"]
    assert [m.name for m in service.methods] == methods
    assert hasattr(textgen_pb2_grpc, "TextGenerationStub")
    assert textgen_pb2.DESCRIPTOR.package == "textgen.v1"

"""Generate the committed Python stubs for proto/textgen/v1/textgen.proto with grpcio-tools.

Usage: python scripts/gen_proto.py [--out DIR]   (default: serve/_proto)

protoc writes imports relative to the proto root (`from textgen.v1 import textgen_pb2`); they are rewritten
to the package path so `import serve._proto.textgen.v1.textgen_pb2_grpc` works without touching sys.path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = ("textgen/v1/textgen.proto",)
DEFAULT_OUT = ROOT / "serve" / "_proto"
PACKAGE = "serve._proto"
PACKAGE_DIRS = ("", "textgen", "textgen/v1")


def _protoc_include() -> str:
    """The well-known types (google/protobuf/*.proto) shipped inside grpc_tools."""
    return str(Path(protoc.__file__).resolve().parent / "_proto")


def _fix_imports(out: Path) -> None:
    for path in out.rglob("*_pb2*.py*"):
        text = path.read_text()
        fixed = text.replace("from textgen.v1 import", f"from {PACKAGE}.textgen.v1 import")
        if fixed != text:
            path.write_text(fixed)


def _ensure_packages(out: Path) -> None:
    for rel in PACKAGE_DIRS:
        init = out / rel / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(
                '"""Generated gRPC stubs; regenerate with `make proto`."""\n' if rel == "" else ""
            )


def generate(out: Path) -> list[Path]:
    """Writes the stubs under `out` and returns the generated files (not the package __init__ files)."""
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{_protoc_include()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(PROTO_FILES)}")
    _fix_imports(out)
    _ensure_packages(out)
    return sorted(p for p in out.rglob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output package directory")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a bundle directory atomically: stage everything in a temp dir next to the target, then rename.

A reader (the server, a concurrent export) never sees a half-written bundle: the old one, the complete new
one, or (for the instant between two renames when replacing) none. An interrupted export leaves only a
`.<name>.tmp-*` directory that nothing reads.

    with BundleStage(out) as stage:
        stage.add_graph("model.onnx", standard_proto, opset)
        stage.add_tokenizer(tokenizer_json)
        bundle = stage.write_manifest(fields)     # checksums computed here; loadable with load_bundle
        ... verify `bundle` ...
        stage.write_manifest(fields, verification=report)
        stage.commit()
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import onnx

from serve.bundle import MANIFEST_FILE, Bundle, GraphSpec, Manifest, load_bundle, sha256_file

# Protobuf cannot serialize a message over 2 GiB; stay well under it so the graph itself still fits.
EXTERNAL_DATA_THRESHOLD = 1_800_000_000
TOKENIZER_FILE = "tokenizer.json"


def _weights_bytes(model: onnx.ModelProto) -> int:
    return sum(len(t.raw_data) for t in model.graph.initializer)


def check_replaceable(out: Path) -> None:
    """Only an old bundle or an empty directory may be replaced: never a directory the user cares about."""
    if out.exists() and not (out.is_dir() and ((out / MANIFEST_FILE).is_file() or not any(out.iterdir()))):
        raise FileExistsError(f"{out}: exists and is not a bundle; refusing to replace it (choose another)")


class BundleStage:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        check_replaceable(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.tmp-", dir=self.out.parent))
        self._committed = False

    def __enter__(self) -> BundleStage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    def add_graph(self, file: str, model: onnx.ModelProto, opset: int) -> GraphSpec:
        """Save `model` as `file` (+ `file.data` only when its weights exceed the 2 GB protobuf limit)."""
        external = f"{file}.data" if _weights_bytes(model) > EXTERNAL_DATA_THRESHOLD else None
        onnx.save_model(
            model,
            str(self.dir / file),
            save_as_external_data=external is not None,
            all_tensors_to_one_file=True,
            location=external,
        )
        return GraphSpec(
            file=file,
            external_data=external,
            inputs=[i.name for i in model.graph.input],
            outputs=[o.name for o in model.graph.output],
            opset=opset,
        )

    def add_tokenizer(self, tokenizer_json: str) -> str:
        (self.dir / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
        return TOKENIZER_FILE

    def write_manifest(self, fields: dict[str, Any]) -> Bundle:
        """Checksum the staged files, write the manifest from `fields`, and load the staged bundle back."""
        files = sorted(p.name for p in self.dir.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        checksums = {f: sha256_file(self.dir / f) for f in files}
        manifest = Manifest.model_validate({**fields, "checksums": checksums})
        (self.dir / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return load_bundle(self.dir)

    def commit(self) -> Path:
        """Move the staged bundle to `out`, replacing whatever was there."""
        old: Path | None = None
        if self.out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.old-", dir=self.out.parent))
            os.replace(self.out, old / self.out.name)
        os.replace(self.dir, self.out)
        self._committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out

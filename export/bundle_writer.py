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

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import onnx

from export.quantize import fold_weight_transposes
from serve.bundle import MANIFEST_FILE, Bundle, GraphSpec, Manifest, load_bundle, sha256_file

TOKENIZER_FILE = "tokenizer.json"
# Both graphs keep their weights here: a tensor the serving graph shares byte for byte with the standard
# graph (every weight matrix: both store [in, out]; the embedding; the head) is written once and referenced
# by both graphs at the same offset, so the bundle holds each weight once (and no graph nears protobuf's
# 2 GB limit).
SHARED_DATA_FILE = "weights.data"
EXTERNAL_MIN_BYTES = 1024  # smaller tensors (shapes, axes, eps) stay inside the graph
ALIGNMENT = 4096  # each tensor starts on a page, as onnx's own writer aligns them for memory mapping


class SharedWeights:
    """The one external data file of a bundle's graphs: each distinct tensor's bytes once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offsets: dict[bytes, tuple[int, int]] = {}  # digest of the bytes -> (offset, length)
        self._file: BinaryIO | None = None
        self.shared_bytes = 0  # bytes a graph referenced that an earlier one had written

    def externalize(self, model: onnx.ModelProto) -> None:
        """Move every initializer of at least EXTERNAL_MIN_BYTES into the file (or point it at the same
        bytes already there), freeing its in-memory copy as it goes."""
        if self._file is None:  # appended to after a manifest was written meanwhile (closing it)
            self._file = self.path.open("r+b" if self.path.exists() else "wb")
            self._file.seek(0, os.SEEK_END)
        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            data = tensor.raw_data
            digest = hashlib.blake2b(data, digest_size=20).digest()
            where = self._offsets.get(digest)
            if where is None:
                end = self._file.tell()
                offset = end + (-end % ALIGNMENT)
                self._file.seek(offset)
                self._file.write(data)
                where = self._offsets[digest] = (offset, len(data))
            else:
                self.shared_bytes += len(data)
            del tensor.external_data[:]
            for key, value in (("location", self.path.name), ("offset", where[0]), ("length", where[1])):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            tensor.ClearField("raw_data")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def check_replaceable(out: Path) -> None:
    """Only an old bundle or an empty directory may be replaced: never a directory the user cares about."""
    if out.exists() and not (out.is_dir() and ((out / MANIFEST_FILE).is_file() or not any(out.iterdir()))):
        raise FileExistsError(f"{out}: exists and is not a bundle; refusing to replace it (choose another)")


class BundleStage:
    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        check_replaceable(self.out)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        # Not tempfile.mkdtemp: its folder is mode 0700, so a bundle exported by one user (root on a host)
        # could not be read by the serving image's user. mkdir gives the mode the user's umask allows.
        self.dir = self.out.parent / f".{self.out.name}.tmp-{uuid.uuid4().hex}"
        self.dir.mkdir()
        self._committed = False
        self._shared: SharedWeights | None = None
        self._checksums: dict[str, tuple[int, int, str]] = {}  # file -> (size, mtime_ns, sha256)

    def __enter__(self) -> BundleStage:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._shared is not None:
            self._shared.close()
        if not self._committed:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def shared_bytes(self) -> int:
        """Bytes of weights that a graph shares with an earlier one in the external data file."""
        return 0 if self._shared is None else self._shared.shared_bytes

    def add_graph(self, file: str, model: onnx.ModelProto, opset: int) -> GraphSpec:
        """Save `model` as `file`, its weights in the bundle's one SHARED_DATA_FILE, each distinct tensor
        once across the graphs. The weights leave `model` (it keeps references into the file)."""
        if self._shared is None:
            self._shared = SharedWeights(self.dir / SHARED_DATA_FILE)
        # A tied head traced as MatMul(x, Transpose(embedding)) stored as the serving graph stores it,
        # [d, vocab], so the two graphs share it too (ONNX Runtime folds the Transpose at load anyway).
        fold_weight_transposes(model)
        self._shared.externalize(model)
        onnx.save_model(model, str(self.dir / file))
        return GraphSpec(
            file=file,
            external_data=SHARED_DATA_FILE,
            inputs=[i.name for i in model.graph.input],
            outputs=[o.name for o in model.graph.output],
            opset=opset,
        )

    def add_tokenizer(self, tokenizer_json: str) -> str:
        (self.dir / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
        return TOKENIZER_FILE

    def write_manifest(self, fields: dict[str, Any]) -> Bundle:
        """Checksum the staged files, write the manifest from `fields`, and load the staged bundle back."""
        if self._shared is not None:
            self._shared.close()
        files = sorted(p.name for p in self.dir.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
        checksums = {f: self._checksum(f) for f in files}
        manifest = Manifest.model_validate({**fields, "checksums": checksums})
        (self.dir / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2) + "\n", encoding="utf-8")
        return load_bundle(self.dir)

    def _checksum(self, name: str) -> str:
        """sha256 of a staged file, computed once while the file is unchanged (gigabytes of weights)."""
        stat = (self.dir / name).stat()
        cached = self._checksums.get(name)
        if cached is not None and cached[:2] == (stat.st_size, stat.st_mtime_ns):
            return cached[2]
        digest = sha256_file(self.dir / name)
        self._checksums[name] = (stat.st_size, stat.st_mtime_ns, digest)
        return digest

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

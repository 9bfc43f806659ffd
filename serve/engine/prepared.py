"""The serving graph prepared for this machine: ONNX Runtime's optimized graph, its packed weights in a file
that every session maps, cached outside the bundle.

Building a session packs every weight matrix into the layout its kernel reads (ONNX Runtime's prepacking),
in anonymous memory, once per session: the verification session of `--speculative` packs them again, and
each replica on a node holds its own copy. ONNX Runtime can instead write the optimized graph with the packed
weights in an external data file (`save_external_prepacked_constant_initializers`), and a session built
from that graph maps them from the file: the page cache holds them once for every session over them, in
this process and in every replica on the node. The packed layout depends on the CPU and on ONNX Runtime's
version (ONNX Runtime warns that the graph may hold hardware-specific optimizations), so it cannot ship in
the bundle: it is prepared on the machine that serves, at the first start or by `textgen-serve
--prepare-only`.

An entry of the cache is a folder named by the digest of its `CacheKey` (the bundle's manifest, ONNX
Runtime's version, the execution providers, the CPU's features, the threads and the KV cache's type):
serving.onnx (with a LoRA bundle's branch-free graph, serving_base.onnx, too), scoring.onnx, weights.data,
and RECORD_FILE, which repeats the key, lists each file's size and sha256, and
records the row-pad probe's decision (serve/engine/row_pad.py), so a later start neither probes nor reads
the bundle's graph. An entry is staged in a folder of its own and renamed into place whole: two replicas
preparing at once each stage their own, the first rename wins and the other serves the winner's. An entry
is checked when opened (its key, and every file against the record); one that fails is moved aside and
prepared again, never served.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve.bundle import MANIFEST_FILE, Bundle, sha256_file
from serve.engine.kv_dtype import fp16_cache_graph, needs_rewrite
from serve.engine.row_pad import strip_row_pads, unpadded_graph
from serve.engine.runtime import (
    InMemoryGraph,
    cpu_only,
    create_session,
    editable_graph,
    onnxruntime,
    resolve_providers,
    structure_only,
)
from serve.engine.types import EngineSettings, KvCacheDtype, SessionConfig
from serve.errors import BundleError

if TYPE_CHECKING:
    import onnx

log = logging.getLogger(__name__)

FORMAT = 1  # of an entry's files; an entry of another is prepared again
GRAPH_FILE = "serving.onnx"
SCORING_FILE = "scoring.onnx"  # the standard graph, which scores prompts (serve/engine/prompt_scoring.py)
BASE_FILE = "serving_base.onnx"  # a LoRA bundle's serving graph without branches (its base-only steps)
DATA_FILE = "weights.data"
# Where ONNX Runtime writes the scoring and branch-free graphs' tensors, before they join DATA_FILE.
_SCORING_DATA = "scoring.data"
_BASE_DATA = "serving_base.data"
ALIGNMENT = 4096  # each tensor added to DATA_FILE starts on a page, as ONNX Runtime aligns its own
RECORD_FILE = "prepared.json"
ENTRY_FILES = (GRAPH_FILE, SCORING_FILE, DATA_FILE)
# Tensors from this size go to the data file, where they are mapped; smaller ones stay in the graph.
EXTERNAL_MIN_BYTES = 1024


def cpu_features() -> str:
    """What ONNX Runtime's kernels choose their packed layouts and their code paths by: the instruction set
    extensions the CPU reports (Linux's /proc/cpuinfo flags), else the machine's and processor's names."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


@dataclass(frozen=True)
class CacheKey:
    """Everything a prepared serving graph depends on; an entry made for another key is never served."""

    bundle: str  # sha256 of the bundle's manifest, which lists every file's sha256
    onnxruntime: str
    providers: tuple[str, ...]
    cpu: str  # sha256 of cpu_features()
    threads: int  # the row-pad probe's (serve/engine/row_pad.py): a lone row's kernel can follow them
    kv_cache_dtype: str

    def fields(self) -> dict[str, Any]:
        return {**asdict(self), "providers": list(self.providers), "format": FORMAT}

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:32]


def cache_key(bundle: Bundle, config: SessionConfig, kv_cache_dtype: KvCacheDtype) -> CacheKey:
    return CacheKey(
        bundle=sha256_file(bundle.path(MANIFEST_FILE)),
        onnxruntime=onnxruntime().__version__,
        providers=tuple(resolve_providers(config.providers)),
        cpu=hashlib.sha256(cpu_features().encode()).hexdigest(),
        threads=config.threads or len(os.sched_getaffinity(0)),
        kv_cache_dtype=kv_cache_dtype,
    )


@dataclass(frozen=True)
class ServingGraph:
    """The serving graph as the engine builds its session from it, how many row pads it took out, and the
    standard graph, which scores prompts with the same weights."""

    graph: Path | InMemoryGraph
    row_pads_removed: int  # 0: none (kept, or the bundle has none)
    scoring: Callable[[], Path]
    # A LoRA bundle's serving graph without branches, for the steps with no adapter row; None: the engine
    # runs every step on `graph` (no such graph, or it would pack a second copy of the weights).
    branch_free: Path | InMemoryGraph | None = None


def serving_graph(
    bundle: Bundle, config: SessionConfig, kv_cache_dtype: KvCacheDtype, branch_free: bool = False
) -> ServingGraph:
    """The bundle's serving graph, checked against the manifest, without its row pads where this CPU does
    not need them (serve/engine/row_pad.py) and with the KV cache's type (serve/engine/kv_dtype.py); with
    `branch_free`, a LoRA bundle's graph without branches too, made alike (the same pads out)."""
    m = bundle.manifest
    if m.graphs.inplace is None:
        raise BundleError(
            f"{bundle.root}: the bundle has no in-place serving graph (graphs.inplace); "
            "re-export it with this version's `textgen-export`"
        )
    # Hashed before ONNX Runtime reads it, not beside: creating a session holds the GIL most of the time,
    # so a hashing thread gained nothing (docs/benchmarks.md, "Ready").
    path = bundle.checked_graph(m.graphs.inplace)
    graph: Path | InMemoryGraph = path
    pads = 0
    if m.odd_rows_padded:  # only such a graph has pads to take out: no other is probed
        unpadded = unpadded_graph(path, config)
        if unpadded is not None:
            graph, pads = unpadded
    fp16_cache = needs_rewrite(kv_cache_dtype, m.dtype, bundle.root)
    if fp16_cache:
        graph = fp16_cache_graph(graph)
    base: Path | InMemoryGraph | None = None
    if branch_free and m.graphs.inplace_base is not None:
        base = bundle.checked_graph(m.graphs.inplace_base)
        if pads:  # its MatMulNBits are the serving graph's: the probe's answer holds for them
            model, folder = editable_graph(base)
            strip_row_pads(model)
            base = InMemoryGraph(model.SerializeToString(), folder)
        if fp16_cache:
            base = fp16_cache_graph(base)
    return ServingGraph(graph, pads, lambda: bundle.standard_graph, base)


def engine_graphs(bundle: Bundle, settings: EngineSettings) -> ServingGraph:
    """The graphs the engine builds its sessions from: the prepared ones where `settings.compiled_cache` is
    set and the session runs on the CPU alone, else (or when the cache cannot be written) the bundle's."""
    config, dtype = settings.session, settings.kv_cache_dtype

    def build() -> ServingGraph:
        return serving_graph(bundle, config, dtype, branch_free=True)

    if settings.compiled_cache is not None and cpu_only(config):
        prepared = prepared_graph(settings.compiled_cache, cache_key(bundle, config, dtype), build, config)
        if prepared is not None:
            return ServingGraph(prepared.graph, prepared.row_pads_removed, prepared.scoring, prepared.base)
    # Without the prepared graph a second session would pack its own copy of the weights: a LoRA bundle
    # runs its base-only steps on the graph with branches (on empty tensors) instead.
    return serving_graph(bundle, config, dtype)


def prepare_bundle(bundle: Bundle, config: SessionConfig, kv_cache_dtype: KvCacheDtype, cache: Path) -> Path:
    """The entry a server of `config` and `kv_cache_dtype` on this machine serves `bundle` from, prepared now
    unless a usable one is there (`textgen-serve --prepare-only`, an init container's); BundleError when it
    cannot be."""
    if not cpu_only(config):
        raise BundleError(f"{bundle.root}: only a session on the CPU alone is served from a prepared graph")
    key = cache_key(bundle, config, kv_cache_dtype)
    found = prepared_graph(
        cache, key, lambda: serving_graph(bundle, config, kv_cache_dtype, branch_free=True), config
    )
    if found is None:
        raise BundleError(f"{cache}: the prepared graph cannot be written there (the log says why)")
    return found.folder


@dataclass(frozen=True)
class Prepared:
    """An opened entry: the prepared graph (its structure; its weights mapped from the entry's data file)."""

    folder: Path
    graph: InMemoryGraph
    row_pads_removed: int
    base: InMemoryGraph | None  # the branch-free graph (ServingGraph.branch_free), its weights mapped alike

    def scoring(self) -> Path:
        """The prepared standard graph, whose weights are the serving graph's where they are the same."""
        return self.folder / SCORING_FILE


class _Unusable(Exception):
    """An entry that must not be served: another key, a file missing, changed or truncated."""


def prepared_graph(
    cache: Path, key: CacheKey, build: Callable[[], ServingGraph], config: SessionConfig
) -> Prepared | None:
    """The entry of `key` under `cache`, prepared from `build()` first when there is none or it is unusable;
    None (logged) when `cache` cannot be written: the caller serves the bundle's graph as it is."""
    entry = cache / key.digest
    found = _open(entry, key)
    if found is not None:
        return found
    try:
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key.digest}.tmp-", dir=cache))
    except OSError as exc:
        log.warning(
            "cannot write the prepared graph under %s (%s): serving the bundle's graph as it is", cache, exc
        )
        return None
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would keep another user's replica out
        prepare(staging, key, build(), config)
        try:
            os.rename(staging, entry)
            log.info("prepared graph written to %s", entry)
        except OSError:  # another replica's entry got there first: serve that one
            log.info("prepared graph %s was written by another process meanwhile", entry)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    opened = _open(entry, key)
    if opened is None:
        raise BundleError(f"{entry}: the prepared graph just written cannot be opened")
    return opened


def prepare(folder: Path, key: CacheKey, serving: ServingGraph, config: SessionConfig) -> None:
    """Write the entry's files into `folder`: a session of the serving graph saves its optimized graph and
    packed weights, one of the standard graph (and of the branch-free graph) its own, whose tensors and
    packed copies then join the serving graph's data file (each one already there, byte for byte, is
    referenced where it lies); the record last (an entry without it is incomplete)."""
    graphs = [(serving.graph, GRAPH_FILE, DATA_FILE), (serving.scoring(), SCORING_FILE, _SCORING_DATA)]
    if serving.branch_free is not None:
        graphs.append((serving.branch_free, BASE_FILE, _BASE_DATA))
    for graph, name, data in graphs:
        create_session(
            graph,
            config,
            optimized_path=folder / name,
            entries={
                "session.optimized_model_external_initializers_file_name": data,
                "session.optimized_model_external_initializers_min_size_in_bytes": str(EXTERNAL_MIN_BYTES),
                "session.save_external_prepacked_constant_initializers": "1",
            },
        )
    merged = [GRAPH_FILE]
    for _, name, data in graphs[1:]:
        _merge(folder, name, data, merged)
        merged.append(name)
    names = [*ENTRY_FILES, *([BASE_FILE] if serving.branch_free is not None else [])]
    files = {name: _fingerprint(folder / name) for name in names}
    record = {"key": key.fields(), "row_pads_removed": serving.row_pads_removed, "files": files}
    (folder / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def _merge(folder: Path, graph: str, data: str, merged: list[str]) -> None:
    """Move the tensors and packed copies `graph` keeps in `data` into DATA_FILE: each one whose bytes are
    there already (those of the `merged` graphs) is referenced where they lie, the others are appended;
    `data` goes. Packed copies are compared by their bytes too: the branch-free graph's are the serving
    graph's (the same weights packed for the same kernels), so they are stored once."""
    import onnx

    index: dict[bytes, int] = {}  # digest of a blob's bytes -> its offset in DATA_FILE
    with (folder / DATA_FILE).open("r+b") as shared, (folder / data).open("rb") as own:
        for name in merged:
            for offset, length in _spans(onnx.load(str(folder / name), load_external_data=False)):
                shared.seek(offset)
                index.setdefault(_digest(shared.read(length)), offset)

        def moved(offset: int, length: int) -> int:
            own.seek(offset)
            blob = own.read(length)
            digest = _digest(blob)
            if digest not in index:
                end = shared.seek(0, os.SEEK_END)
                index[digest] = end + (-end % ALIGNMENT)
                shared.seek(index[digest])
                shared.write(blob)
            return index[digest]

        model = onnx.load(str(folder / graph), load_external_data=False)
        for tensor in model.graph.initializer:
            entries = {e.key: e for e in tensor.external_data}
            if "offset" not in entries:
                continue
            entries["location"].value = DATA_FILE
            entries["offset"].value = str(moved(int(entries["offset"].value), int(entries["length"].value)))
            for entry in tensor.external_data:
                if entry.key.startswith("prepacked"):
                    key, blobs = _packed(entry.value)
                    places = [f"{moved(o, n)};{n};{check}" for o, n, check in blobs]
                    entry.value = "|".join([key, *places])
    onnx.save_model(model, str(folder / graph))
    (folder / data).unlink()


def _packed(value: str) -> tuple[str, list[tuple[int, int, str]]]:
    """A packed copy's reference, as ONNX Runtime writes it: key|offset;length;checksum[|...]."""
    key, *blobs = value.split("|")
    parts = [blob.split(";") for blob in blobs]
    return key, [(int(offset), int(length), check) for offset, length, check in parts]


def _spans(model: onnx.ModelProto) -> Iterator[tuple[int, int]]:
    """Where each external tensor and packed copy of `model` lies in its data file: (offset, length)."""
    for tensor in model.graph.initializer:
        entries = {e.key: e.value for e in tensor.external_data}
        if "offset" in entries:
            yield int(entries["offset"]), int(entries["length"])
        for name, value in entries.items():
            if name.startswith("prepacked"):
                yield from ((offset, length) for offset, length, _ in _packed(value)[1])


def _digest(blob: bytes) -> bytes:
    return hashlib.blake2b(blob, digest_size=20).digest()


def _fingerprint(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def _open(entry: Path, key: CacheKey) -> Prepared | None:
    """The entry, checked; None when there is none, or it was unusable (then moved aside and deleted)."""
    if not entry.exists():
        return None
    try:
        record = _checked_record(entry, key)
    except _Unusable as exc:
        log.warning("prepared graph %s is not served (%s): preparing it again", entry, exc)
        _discard(entry)
        return None
    graph = structure_only(entry / GRAPH_FILE)
    base = structure_only(entry / BASE_FILE) if BASE_FILE in record["files"] else None
    return Prepared(entry, graph, int(record["row_pads_removed"]), base)


def _checked_record(entry: Path, key: CacheKey) -> dict[str, Any]:
    try:
        record = json.loads((entry / RECORD_FILE).read_text(encoding="utf-8"))
        if record["key"] != key.fields():
            raise _Unusable("it was prepared for another bundle, ONNX Runtime, CPU or settings")
        for name, expected in record["files"].items():
            path = entry / name
            if path.stat().st_size != expected["size"] or sha256_file(path) != expected["sha256"]:
                raise _Unusable(f"{name} was changed or truncated")
        if set(record["files"]) - {BASE_FILE} != set(ENTRY_FILES):
            raise _Unusable("its record does not list its files")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _Unusable(f"incomplete or unreadable: {exc}") from exc
    return dict(record)


def _discard(entry: Path) -> None:
    """Move the entry aside (one rename: a process mapping its files keeps them) and delete it."""
    aside = entry.with_name(f".{entry.name}.discard-{uuid.uuid4().hex}")
    try:
        os.rename(entry, aside)
    except OSError:  # another process moved it first
        return
    shutil.rmtree(aside, ignore_errors=True)

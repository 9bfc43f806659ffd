"""An ONNX graph file's protobuf walked field by field (tags and lengths only), without the onnx package.

What the engine reads of a graph's structure (serve/engine/graph_file.py) and what sizing counts of a graph's
weights (`external_data_bytes`) come from here. The headers are read a few bytes at a time through an
unbuffered file, not through a memory map of it: a map makes resident whatever the kernel maps around each
header touched (whole page-cache folios), 170 MB of C-llama int4's 234 MB graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from io import FileIO
from pathlib import Path
from typing import NamedTuple

# onnx.proto's field numbers: ModelProto.graph, GraphProto.initializer, TensorProto.raw_data and
# .external_data, StringStringEntryProto.key and .value
MODEL_GRAPH, GRAPH_INITIALIZER, TENSOR_RAW_DATA, TENSOR_EXTERNAL_DATA = 7, 5, 9, 13
ENTRY_KEY, ENTRY_VALUE = 1, 2
_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_HEADER = 20  # a field's tag and length: two varints of at most 10 bytes each


class Field(NamedTuple):
    """One field of a serialized protobuf message: its number, and where it, its value and its end lie."""

    number: int
    start: int
    value: int
    end: int


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return result, pos
        shift += 7


def read(file: FileIO, first: int, end: int) -> bytes:
    file.seek(first)
    return file.read(end - first) or b""


def fields(file: FileIO, start: int, end: int) -> Iterator[Field]:
    """The fields of the message that fills bytes [start, end) of the file, read a header at a time."""
    pos = start
    while pos < end:
        header = read(file, pos, pos + _HEADER)
        tag, at = _varint(header, 0)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, at = _varint(header, at)
            size = 0
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
        elif wire == _LENGTH:
            size, at = _varint(header, at)
        else:  # groups (3, 4): no ONNX message has them
            raise ValueError(f"protobuf wire type {wire} at byte {pos}")
        yield Field(number, pos, pos + at, pos + at + size)
        pos += at + size
    if pos != end:
        raise ValueError(f"a field runs past its message's end (byte {end})")


def external_data_bytes(path: Path) -> dict[str, int | None]:
    """The bytes the graph at `path` reads from each external data file (its `location`): the lengths of its
    initializers' references there, each distinct (offset, length) once. None for a file some reference
    names without a length (the tensor then runs to the file's end). The file's weights are not read."""
    spans: dict[str, set[tuple[str, str | None]]] = {}
    with FileIO(path, "rb") as file:  # unbuffered: each read takes only the bytes asked for
        size = file.seek(0, 2)
        graph = next((f for f in fields(file, 0, size) if f.number == MODEL_GRAPH), None)
        if graph is None:
            raise ValueError("no graph")
        for init in fields(file, graph.value, graph.end):
            if init.number != GRAPH_INITIALIZER:
                continue
            entries = [f for f in fields(file, init.value, init.end) if f.number == TENSOR_EXTERNAL_DATA]
            where = dict(_entry(file, entry) for entry in entries)
            if "location" in where:
                span = (where.get("offset", "0"), where.get("length"))
                spans.setdefault(where["location"], set()).add(span)
    return {
        location: None if any(length is None for _, length in refs) else sum(int(n or 0) for _, n in refs)
        for location, refs in spans.items()
    }


def _entry(file: FileIO, entry: Field) -> tuple[str, str]:
    """A StringStringEntryProto's key and value."""
    parts = {f.number: read(file, f.value, f.end).decode() for f in fields(file, entry.value, entry.end)}
    return parts.get(ENTRY_KEY, ""), parts.get(ENTRY_VALUE, "")

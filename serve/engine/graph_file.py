"""A graph file read for its structure alone, its weights left where they are on disk.

A bundle's graph keeps its weights inside the .onnx file unless they pass protobuf's 2 GB limit (then in the
bundle's external data file). `onnx.load` reads an embedded graph whole, and ONNX Runtime, given its path,
parses the whole protobuf and then copies each tensor out of it: at start-up the weights are held two or
three times over, and whatever glibc keeps of the freed copies stays resident afterwards. Here the file's
protobuf is walked field by field (tags and lengths only), and every embedded tensor over
INLINE_BYTES becomes an external-data reference to its own bytes at their offset in the same file. The graph
Python holds is then the structure only (kilobytes to a few MB), and ONNX Runtime, given it with the bundle's
folder, maps each tensor from the file as it maps a bundle's external data file.

The headers are read a few bytes at a time (serve/onnx_fields.py says why).
"""

from __future__ import annotations

import os
from io import FileIO
from pathlib import Path
from typing import TYPE_CHECKING

from serve.errors import BundleError
from serve.onnx_fields import GRAPH_INITIALIZER, MODEL_GRAPH, TENSOR_RAW_DATA, Field, fields, read

if TYPE_CHECKING:
    import onnx

# Tensors up to this size stay inside the graph: ONNX Runtime's shape inference needs the values of shape
# constants, which it cannot read from external data when the model comes from memory.
INLINE_BYTES = 1 << 16


def read_structure(path: Path) -> onnx.ModelProto:
    """The graph at `path` without its weights' bytes: each tensor over INLINE_BYTES refers to where its bytes
    are (in `path` itself when embedded, in the external data file otherwise), smaller ones are inside."""
    try:
        with FileIO(path, "rb") as file:  # unbuffered: each read takes only the bytes asked for
            model = _structure(file, path.name, os.fstat(file.fileno()).st_size)
    except Exception as exc:  # the walk's ValueError or IndexError, protobuf's own DecodeError
        raise BundleError(f"{path}: not a readable ONNX graph: {exc}") from exc
    inline_small_external_tensors(model, path.parent)
    return model


def _structure(file: FileIO, name: str, size: int) -> onnx.ModelProto:
    import onnx

    model_parts, graph_parts, referenced = [], [], []
    graph: Field | None = None
    for field in fields(file, 0, size):
        if field.number == MODEL_GRAPH:
            graph = field
        else:
            model_parts.append(read(file, field.start, field.end))
    if graph is None:
        raise ValueError("no graph")
    for field in fields(file, graph.value, graph.end):
        raw = None
        if field.number == GRAPH_INITIALIZER:
            tensor_fields = fields(file, field.value, field.end)
            raw = next((f for f in tensor_fields if f.number == TENSOR_RAW_DATA), None)
        if raw is None or raw.end - raw.value <= INLINE_BYTES:
            graph_parts.append(read(file, field.start, field.end))
            continue
        # the tensor's other fields (name, type, dims) lie before and after its bytes
        rest = read(file, field.value, raw.start) + read(file, raw.end, field.end)
        tensor = onnx.TensorProto.FromString(rest)
        for key, value in (("location", name), ("offset", raw.value), ("length", raw.end - raw.value)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        referenced.append(tensor)
    model = onnx.ModelProto.FromString(b"".join(model_parts))
    model.graph.ParseFromString(b"".join(graph_parts))
    model.graph.initializer.extend(referenced)
    return model


def inline_small_external_tensors(model: onnx.ModelProto, folder: Path) -> None:
    """Read external tensors of up to INLINE_BYTES into the model (see INLINE_BYTES for why)."""
    from onnx import TensorProto
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    for tensor in model.graph.initializer:
        if uses_external_data(tensor):
            length = next((int(e.value) for e in tensor.external_data if e.key == "length"), None)
            if length is not None and length <= INLINE_BYTES:
                # A prepared graph's packed copy (serve/engine/prepared.py) goes with the reference: so small
                # a tensor is packed again in memory.
                kept = [e for e in tensor.external_data if not e.key.startswith("prepacked")]
                del tensor.external_data[:]
                tensor.external_data.extend(kept)
                load_external_data_for_tensor(tensor, str(folder))
                tensor.data_location = TensorProto.DEFAULT
                del tensor.external_data[:]

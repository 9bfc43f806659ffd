"""The KV cache's memory: preallocated `[rows, heads, capacity, head_dim]` buffers, one K and one V per layer,
and what the engine does with them: bind a range of rows into a run, and copy a row over another.

The buffers are OrtValues that ONNX Runtime allocates on the device the session runs on (runtime.kv_device:
CUDA memory under the CUDA/TensorRT providers, host memory on CPU), so on a GPU the cache never leaves the
device between steps. One code path for every device, which differs only in the device name: row ranges are
bound by pointer (buffer start + first row * row bytes; rows are contiguous along the leading axis), as both
the past input and the present output of the serving graph, so GroupQueryAttention appends each step's keys
and values in place (see export/onnx_inplace.py for the graph's semantics). Row copies differ: on a device
they run a tiny Identity graph on whole rows (runtime.copy_graph); in host memory numpy copies only each
head's filled positions, through views of the same buffers — a row is mostly empty, and a whole row holds
every layer's keys and values for the whole context (docs/benchmarks.md, "Prefix cache").

A preempted sequence's row goes to host memory and back (`read_row`, `write_row`): numpy copies of its filled
positions in host memory, a run of the copy graph between the row and host arrays on a device.

Which rows hold what (running sequences, a prefill group, the prefix cache) is the engine's business
(serve/engine/rows.py); this module knows rows only by index.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from serve.engine.runtime import Device, allocate, copy_graph, create_copy_session

if TYPE_CHECKING:
    import onnxruntime as ort


@dataclass(frozen=True)
class KvBuffer:
    name: str  # "key.{layer}" / "value.{layer}": the graph's past_{name} input and present_{name} output
    value: ort.OrtValue  # [rows, heads, capacity, head_dim] on the cache's device
    dtype: Any  # numpy type of the elements
    row_bytes: int  # bytes of one row [heads, capacity, head_dim]

    def row_ptr(self, row: int) -> int:
        return int(self.value.data_ptr()) + row * self.row_bytes


class KvCache:
    """`rows` rows of `row_shape` (heads, capacity, head_dim) in one buffer per entry of `dtypes`, which maps
    each buffer's name ("key.{layer}", "value.{layer}", K and V per layer) to its numpy element type.
    Not thread-safe: the engine calls it from its one thread (a background prefill's run only uses a binding
    made by `bind`, and writes rows no copy touches meanwhile)."""

    def __init__(
        self, rows: int, row_shape: tuple[int, ...], dtypes: Mapping[str, Any], device: Device
    ) -> None:
        self.rows = rows
        self.row_shape = row_shape
        self.device = device
        shape, row_elements = (rows, *row_shape), int(np.prod(row_shape))
        self.buffers: tuple[KvBuffer, ...] = tuple(
            KvBuffer(name, allocate(shape, dtype, device), dtype, row_elements * np.dtype(dtype).itemsize)
            for name, dtype in dtypes.items()
        )
        self._copy_session = create_copy_session(
            copy_graph([b.dtype for b in self.buffers], row_shape), device
        )
        # OrtValue.numpy() of host memory is a view of it (of device memory, a copy: no use). None selects
        # the copy graph (tests set it so to run the device path on host memory).
        self._host_views: list[np.ndarray] | None = (
            [b.value.numpy() for b in self.buffers] if device.type == "cpu" else None
        )
        self._copy_bindings: dict[tuple[int, int], ort.IOBinding] = {}  # (source row, target row) -> binding

    @property
    def kv_bytes(self) -> int:
        """Memory of every row of every buffer, on the cache's device."""
        return self.rows * sum(b.row_bytes for b in self.buffers)

    @property
    def position_bytes(self) -> int:
        """Memory of one position of a row in every buffer: what a host copy of a row (`read_row`) takes a
        token."""
        return sum(b.row_bytes for b in self.buffers) // self.row_shape[1]

    @property
    def dtype_name(self) -> str:
        """The buffers' element type ("float32", "float16"): the graph gives K and V of every layer one."""
        return np.dtype(self.buffers[0].dtype).name

    def kv_buffer_devices(self) -> list[str]:
        """The device ONNX Runtime reports for each buffer ("cpu", "cuda"), K and V per layer."""
        return [b.value.device_name() for b in self.buffers]

    def kv_host(self, layer: int, kind: str, rows: int) -> np.ndarray:
        """A host copy of rows [0, rows) of one layer's "key" or "value" buffer, for tests and checks.
        Copies on every call (on a GPU the whole buffer, device to host)."""
        index = 2 * layer + ("key", "value").index(kind)
        # OrtValue.numpy() is a view of a CPU tensor's memory (a copy from a GPU): copy the rows out.
        return self.buffers[index].value.numpy()[:rows].copy()

    def bind(self, binding: ort.IOBinding, rows: slice, aliases: Sequence[str] = ()) -> None:
        """Bind rows [rows.start, rows.stop) of every buffer as the past input and the present output of a
        serving-graph binding: the run reads and appends to them in place. `aliases`: suffixes of more
        present outputs bound to the same rows (the verification graph's, serve/engine/verify_graph.py)."""
        device = self.device
        shape = (rows.stop - rows.start, *self.row_shape)
        for buf in self.buffers:
            ptr = buf.row_ptr(rows.start)  # rows of the leading axis are contiguous: a sub-buffer
            binding.bind_input(f"past_{buf.name}", device.type, device.id, buf.dtype, shape, ptr)
            for present in (f"present_{buf.name}{suffix}" for suffix in ("", *aliases)):
                binding.bind_output(present, device.type, device.id, buf.dtype, shape, ptr)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy row `src` of every buffer over row `dst`: its first `length` positions in host memory, the
        whole row (contiguous) on a device. A run finishes before it returns (ONNX Runtime synchronizes the
        device at the end of a run), so the serving session's next step sees the copy. Bindings are kept per
        row pair (binding from Python costs time per buffer; the engine copies between a running row and the
        last one, or a running row and a prefix-cache row, so there are at most rows²)."""
        if self._host_views is not None:
            for view in self._host_views:
                view[dst, :, :length] = view[src, :, :length]
            return
        binding = self._copy_bindings.get((src, dst))
        if binding is None:
            binding = self._copy_session.io_binding()
            device, shape = self.device, self.row_shape
            for i, buf in enumerate(self.buffers):
                binding.bind_input(f"src.{i}", device.type, device.id, buf.dtype, shape, buf.row_ptr(src))
                binding.bind_output(f"dst.{i}", device.type, device.id, buf.dtype, shape, buf.row_ptr(dst))
            self._copy_bindings[(src, dst)] = binding
        self._copy_session.run_with_iobinding(binding)

    def read_row(self, row: int, length: int) -> list[np.ndarray]:
        """A host copy of row `row`'s first `length` positions, [heads, length, head_dim] per buffer (a
        preempted sequence's keys and values, kept while others use its row). On a device the copy graph
        brings the whole row over (one run), of which only the valid positions are kept."""
        if self._host_views is not None:
            return [view[row, :, :length].copy() for view in self._host_views]
        whole = [np.empty(self.row_shape, b.dtype) for b in self.buffers]
        self._copy_through_host(row, whole, to_host=True)
        return [np.ascontiguousarray(array[:, :length]) for array in whole]

    def write_row(self, row: int, kept: Sequence[np.ndarray]) -> None:
        """Put what `read_row` returned back, into row `row` (the positions past it are left as they were)."""
        if self._host_views is not None:
            for view, array in zip(self._host_views, kept, strict=True):
                view[row, :, : array.shape[1]] = array
            return
        whole = [np.zeros(self.row_shape, b.dtype) for b in self.buffers]
        for target, array in zip(whole, kept, strict=True):
            target[:, : array.shape[1]] = array
        self._copy_through_host(row, whole, to_host=False)

    def _copy_through_host(self, row: int, host: Sequence[np.ndarray], *, to_host: bool) -> None:
        """Run the copy graph between row `row` of every buffer and whole-row host arrays: ONNX Runtime
        copies between the device and the host side of the binding."""
        binding = self._copy_session.io_binding()
        device, shape = self.device, self.row_shape
        for i, (buf, array) in enumerate(zip(self.buffers, host, strict=True)):
            ends = [(device.type, device.id, buf.row_ptr(row)), ("cpu", 0, array.ctypes.data)]
            src, dst = ends if to_host else ends[::-1]
            binding.bind_input(f"src.{i}", src[0], src[1], buf.dtype, shape, src[2])
            binding.bind_output(f"dst.{i}", dst[0], dst[1], buf.dtype, shape, dst[2])
        self._copy_session.run_with_iobinding(binding)

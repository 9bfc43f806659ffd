"""What each of the server's processes sets up for itself: its logging, its start-up heap, and the CPUs the
engine process and the gRPC server's process run on (`--engine-cpus`).

Left to the kernel, the server's threads (gRPC, the event loop, metrics) and the load on the machine run on
whichever core is free, the engine's included: every time one of them takes the engine's core, the engine
step in flight waits, and ONNX Runtime's parallel operators wait for their slowest thread. With the engine
process on CPUs of its own and the server's process on the others, the engine runs at its offline pace and a
stream whose messages cannot keep up gets several tokens a message instead (vLLM's CPU backend likewise binds
its compute threads and leaves a core to its front end). Linux only: `os.sched_setaffinity`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0", "0-3", "0-3,8,10-11", as `taskset -c` takes); ValueError for anything else."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6 (bad part {part!r})") from None
        if low < 0 or high < low:
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,6 (bad range {part!r})")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The CPU list `parse_cpu_list` reads back, ranges folded: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    ordered = sorted(cpus)
    start = 0
    for index, cpu in enumerate(ordered):
        if index + 1 == len(ordered) or ordered[index + 1] != cpu + 1:
            low = ordered[start]
            parts.append(str(low) if low == cpu else f"{low}-{cpu}")
            start = index + 1
    return ",".join(parts)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (a container's cpuset, `taskset`)."""
    return frozenset(os.sched_getaffinity(0))


def read_engine_cpus(text: str) -> frozenset[int] | str:
    """An `engine_cpus` value as written: "auto", or a CPU list."""
    return "auto" if text.strip().lower() == "auto" else parse_cpu_list(text)


def engine_cpus(setting: frozenset[int] | str | None) -> frozenset[int] | None:
    """The `engine_cpus` setting resolved: "auto" is every CPU this process may use but the lowest, which
    is left to the server's threads (and, often, to the network's interrupts); None with a single CPU."""
    if setting is None or isinstance(setting, frozenset):
        return setting
    allowed = sorted(allowed_cpus())
    return frozenset(allowed[1:]) if len(allowed) > 1 else None


def beside(engine_cpus: frozenset[int]) -> tuple[int, ...] | None:
    """The CPUs this process may use that `engine_cpus` leaves free, for the server's threads or a load
    generator on the same machine (None when none are left: they stay where they are)."""
    rest = allowed_cpus() - engine_cpus
    return tuple(sorted(rest)) if rest else None


def check_cpus(cpus: frozenset[int], setting: str) -> None:
    """ValueError, naming `setting`, unless every one of `cpus` is a CPU this process may run on."""
    allowed = allowed_cpus()
    if not cpus <= allowed:
        raise ValueError(
            f"{setting} {format_cpu_list(cpus)}: this process may run on CPUs {format_cpu_list(allowed)} "
            f"only (not {format_cpu_list(cpus - allowed)})"
        )


def pin_process(cpus: frozenset[int]) -> None:
    """Move every thread of this process onto `cpus`; threads started later inherit it from their parent.

    `os.sched_setaffinity(0, ...)` moves the calling thread only, and gRPC's and ONNX Runtime's threads exist
    already, so each task of /proc/self/task is moved. A thread that ended meanwhile is skipped.
    """
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            continue


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
        force=True,
    )


def freeze_startup_objects() -> int:
    """Collect, then move every object alive now (modules, the tokenizer, ONNX Runtime's and gRPC's Python
    objects) out of the garbage collector's reach, as vLLM does after start-up: its full collections then
    walk only what serving allocated since, and each full collection is a stall every running stream of the
    process sees (measured: docs/benchmarks.md#start-up-and-memory, "Heap freeze"). Returns the objects
    frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def trim_heap() -> bool:
    """Give the heap memory this process has freed back to the OS (glibc's `malloc_trim`), as the engine does
    once built: building sessions frees more than it keeps (a CPU probe's sessions, ONNX Runtime's copies of
    the weights before it packs them), and glibc would otherwise keep it resident for the process's life.
    False where the C library has no `malloc_trim` (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


def resident_memory(pid: int | str = "self") -> tuple[int, int]:
    """A process's resident memory now and at its peak (VmRSS, VmHWM), in bytes; (0, 0) where /proc cannot
    tell (not Linux, or the process is gone)."""
    values = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError):
        return 0, 0
    return values.get("VmRSS", 0), values.get("VmHWM", 0)

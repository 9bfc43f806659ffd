"""What the benchmarks read of processes from /proc (Linux): CPU time, memory, children, and the CPU other
processes took meanwhile; and the commands they run to prepare a measurement, printed as they run.

Peak memory is VmHWM, the resident high-water mark of a process's own address space. `ru_maxrss` is not: the
kernel keeps it across `exec`, so a child started by a large benchmark process reports its parent's peak
whenever that is the larger.
"""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far, all its threads (/proc/PID/stat)."""
    return _stat_cpu(Path(f"/proc/{pid}/stat"))


def main_thread_cpu_seconds(pid: int) -> float:
    """User + system CPU of a process's main thread so far (a Python server's event loop runs there)."""
    return _stat_cpu(Path(f"/proc/{pid}/task/{pid}/stat"))


def _stat_cpu(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def status_mib(pid: int | str, field: str) -> float:
    """A memory line of /proc/PID/status (VmRSS, VmHWM, ...) in MiB; `pid` may be "self"."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def peak_rss_mib(pid: int | str = "self") -> float:
    return status_mib(pid, "VmHWM")


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs, and so on (a server's engine process, ...)."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:  # the process ended meanwhile
            continue
        for task in tasks:
            try:
                kids = [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # the thread ended meanwhile
                continue
            found += kids
            parents += kids
    return found


def tree_status_mib(pid: int, field: str) -> dict[int, float]:
    """A memory line of /proc/PID/status (VmRSS, VmHWM, ...) in MiB for a process and each descendant."""
    found = {}
    for p in (pid, *descendants(pid)):
        try:
            found[p] = status_mib(p, field)
        except OSError:  # it ended meanwhile
            continue
    return found


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants together, now."""
    return sum(tree_status_mib(pid, "VmRSS").values())


def machine_busy_seconds() -> float:
    """CPU seconds every core has spent on anything but idling and waiting for I/O since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / CLOCK_TICKS  # user .. steal (guest time is inside user)


class CpuMeter:
    """Over a block: its wall time, the CPU each of `pids` used, and the share of the machine's cores that
    other processes used (`other_load`: busy CPU time minus these processes', over wall x cores)."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = tuple(pids)
        self.cpu: dict[int, float] = {}
        self.wall = 0.0
        self.other_load = 0.0

    def __enter__(self) -> CpuMeter:
        self._start = (time.perf_counter(), machine_busy_seconds(), [cpu_seconds(p) for p in self.pids])
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        start, busy, cpus = self._start
        self.wall = time.perf_counter() - start
        self.cpu = {p: cpu_seconds(p) - before for p, before in zip(self.pids, cpus, strict=True)}
        others = machine_busy_seconds() - busy - sum(self.cpu.values())
        self.other_load = max(0.0, others / (self.wall * (os.cpu_count() or 1)))


def run_logged(command: list[str], env: dict[str, str] | None = None) -> None:
    """Run `command` to its end (an error if it fails), printed first as it would be typed; `env`: variables
    set for it on top of ours."""
    print(f"$ {shlex.join(command)}", flush=True)
    subprocess.run(command, check=True, env=None if env is None else {**os.environ, **env})

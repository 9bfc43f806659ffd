"""The CPUs the benchmarks keep their load generators on: `--engine-cpus` as a textgen-serve command line
gives it, and this process pinned for the duration of a run. The server's own CPU placement is
serve.process's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from serve.process import allowed_cpus, engine_cpus, pin_process, read_engine_cpus


def resolve_engine_cpus(text: str) -> frozenset[int] | None:
    """An `--engine-cpus` value as written, resolved as the server resolves it; ValueError for a bad list."""
    return engine_cpus(read_engine_cpus(text))


@contextlib.contextmanager
def pinned(cpus: frozenset[int] | None) -> Iterator[None]:
    """This process on `cpus` for the duration (None: where it was), then back where it was."""
    if cpus is None:
        yield
        return
    before = allowed_cpus()
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)


def engine_cpus_flag(flags: Sequence[str]) -> frozenset[int] | None:
    """The CPUs a textgen-serve command line gives `--engine-cpus`, if it does (benchmarks keep their load
    generator off them)."""
    for index, flag in enumerate(flags):
        if flag == "--engine-cpus" and index + 1 < len(flags):
            return resolve_engine_cpus(flags[index + 1])
        if flag.startswith("--engine-cpus="):
            return resolve_engine_cpus(flag.split("=", 1)[1])
    return None

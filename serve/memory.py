"""Amounts of memory as operators write them (`--kv-cache-memory`, `--swap-space`): shared by the server's
settings and the scheduler's knobs, which sit in layers that do not import each other."""

from __future__ import annotations

import re

_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(value: object) -> object:
    """`512MiB`, `2GiB`, `1.5G`, `768M`, `65536B` (binary units either way) or a bare number of MiB ->
    bytes."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value * _UNITS["m"])
    if not isinstance(value, str):
        return value
    match = _MEMORY.match(value)
    if match is None:
        raise ValueError(
            f"{value!r} is not an amount of memory: give e.g. 512MiB or 2GiB (a bare number: MiB)"
        )
    number, unit, suffix = match.groups()
    scale = _UNITS[unit.lower()] if unit or suffix else _UNITS["m"]
    return int(float(number) * scale)

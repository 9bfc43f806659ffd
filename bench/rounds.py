"""Rounds alternated: this machine's speed drifts within minutes, and whatever runs first in a round may fare
otherwise, so the variants a scenario compares take turns going first and their figures are medians over
rounds (of each round's ratio, where a ratio is reported)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def in_turn(items: Sequence[T], round_no: int) -> list[T]:
    """`items` in the order round `round_no` (from 0) runs them: each round starts one further on, so every
    item goes first equally often (of two, the order flips every round)."""
    shift = round_no % len(items)
    return [*items[shift:], *items[:shift]]


def median_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median over rounds of each round's ours ÷ theirs (rounds where theirs is 0 left out; NaN when
    none is left): a drift of the machine between rounds cancels out of each ratio."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True) if b]
    return statistics.median(ratios) if ratios else float("nan")

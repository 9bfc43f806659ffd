"""The prefix cache's bookkeeping: which kept row a prompt reuses, and which row a leaving sequence takes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_fakes import shared_prefix

from serve.engine.prefix_cache import PrefixCache


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_match_takes_the_longest_shared_prefix_and_leaves_the_last_prompt_token() -> None:
    cache = PrefixCache(rows=[8, 9], min_tokens=2)
    assert cache.match([1, 2, 3]) is None  # nothing kept yet
    assert cache.store(ids(1, 2, 3, 4)) == 8
    assert cache.store(ids(1, 2, 7, 7, 7)) == 9
    assert cache.match([1, 2, 3, 4, 5]) == (8, 4)
    assert cache.match([1, 2, 7, 7, 7, 0]) == (9, 5)
    assert cache.match([1, 2, 3, 4]) == (8, 3)  # all of it kept: the last token still runs
    assert cache.match([1, 5]) is None  # one shared token, under min_tokens
    assert cache.match([2, 1, 2, 3]) is None  # a prefix, not a substring


def test_running_rows_are_candidates_too_but_only_with_cache_rows() -> None:
    cache = PrefixCache(rows=[8], min_tokens=2)
    cache.store(ids(1, 2, 3))
    running = [(0, ids(1, 2, 3, 4, 5)), (1, ids(7, 7, 7))]
    assert cache.match([1, 2, 3, 4, 5, 6], running) == (0, 5)  # the running row shares more
    assert cache.match([1, 2, 3, 9], running) == (8, 3)  # the kept row comes first on a tie
    assert cache.match([7, 7, 0], running) == (1, 2)
    assert PrefixCache(rows=[], min_tokens=2).match([1, 2, 3, 4, 5, 6], running) is None  # caching off


def test_store_extends_a_previous_turn_and_skips_what_is_already_kept() -> None:
    cache = PrefixCache(rows=[4, 5], min_tokens=3)
    assert cache.store(ids(1, 2)) is None  # too short to be worth a copy
    assert cache.store(ids(1, 2, 3)) == 4
    assert cache.store(ids(1, 2, 3, 4, 5)) == 4  # the next turn of the same chat replaces it
    assert len(cache) == 1
    assert cache.store(ids(1, 2, 3, 4)) is None  # already held, and more
    assert cache.store(ids(9, 9, 9)) == 5
    cache.clear()
    assert len(cache) == 0 and cache.match([1, 2, 3, 4, 5, 6]) is None


def test_a_sequence_extending_two_kept_rows_frees_one() -> None:
    cache = PrefixCache(rows=[0, 1, 2], min_tokens=1)
    cache.store(ids(1, 2))
    cache.store(ids(3))
    assert cache.store(ids(1, 2, 3, 4)) is not None
    cache.store(ids(1, 2, 3, 4, 5, 6))  # extends the row above only
    assert len(cache) == 2


def test_the_least_recently_used_row_is_given_up() -> None:
    cache = PrefixCache(rows=[0, 1], min_tokens=1)
    assert cache.store(ids(1, 1)) == 0
    assert cache.store(ids(2, 2)) == 1
    cache.use(0)  # a prompt reused row 0: row 1 is now the older
    assert cache.store(ids(3, 3)) == 1
    assert cache.match([2, 2, 0]) is None and cache.match([1, 1, 0]) == (0, 2)
    assert cache.store(ids(4, 4)) == 0  # row 0 was stored before row 1's (3, 3)


def test_no_rows_keeps_nothing() -> None:
    cache = PrefixCache(rows=[], min_tokens=1)
    assert cache.store(ids(1, 2, 3)) is None and cache.match([1, 2, 3, 4]) is None
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache(rows=[0], min_tokens=0)


@settings(max_examples=200, deadline=None)
@given(
    stored=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=8),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    min_tokens=st.integers(1, 3),
)
def test_match_agrees_with_a_search_over_what_is_kept(
    stored: list[list[int]], prompt: list[int], min_tokens: int
) -> None:
    cache = PrefixCache(rows=range(3), min_tokens=min_tokens)
    kept: dict[int, list[int]] = {}  # row -> tokens, as a reference follows the cache's answers
    for tokens in stored:
        row = cache.store(ids(*tokens))
        if row is not None:
            kept = {r: t for r, t in kept.items() if not _is_prefix(t, tokens)}
            kept[row] = tokens
        else:
            assert len(tokens) < min_tokens or any(_is_prefix(tokens, t) for t in kept.values())
    assert len(cache) == len(kept) <= 3
    best = max(
        (min(shared_prefix(t, prompt), len(prompt) - 1) for t in kept.values()),
        default=0,
    )
    hit = cache.match(prompt)
    if best >= min_tokens:
        assert hit is not None and hit[1] == best
        assert kept[hit[0]][: hit[1]] == prompt[: hit[1]]
    else:
        assert hit is None


def _is_prefix(a: list[int], b: list[int]) -> bool:
    return len(a) <= len(b) and b[: len(a)] == a


def test_the_prefix_benchmark_runs_every_case_and_reuses_what_it_says(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    from bench.prefix_bench import ANSWER, BURST, main

    out = tmp_path / "prefix.json"
    main(
        [
            "--bundle",
            str(tiny_bundle),
            "--history",
            "16",
            "--system",
            "16",
            "--rounds",
            "1",  # made 2: each engine goes first once
            "--json",
            str(out),
        ]
    )
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 6
    for figures in cases.values():
        for by_engine in figures.values():
            assert list(by_engine) == ["4 rows", "0 rows"] and all(len(v) == 2 for v in by_engine.values())
    chat = next(figures for case, figures in cases.items() if case.startswith("chat"))
    # The previous prompt and its answer, but the answer's last token (never fed back), came from the cache.
    assert chat["cached prompt tokens"] == {"4 rows": [16 + ANSWER - 1] * 2, "0 rows": [0, 0]}
    warm, cold = (figures for case, figures in cases.items() if "system" in case)
    assert all(n >= BURST * 16 for n in warm["cached prompt tokens"]["4 rows"])
    # Cold: what is not prefilled in the burst's first group starts from a running row.
    assert all(n >= 16 for n in cold["cached prompt tokens"]["4 rows"])
    assert warm["cached prompt tokens"]["0 rows"] == cold["cached prompt tokens"]["0 rows"] == [0, 0]

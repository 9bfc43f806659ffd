"""The prefix cache's bookkeeping: which kept row a prompt reuses, and which row a leaving sequence takes; and
that a prompt continued over a cached prefix (a copied row's, or its own earlier pieces') gets the very tokens
and logprobs it gets prefilled whole: with the cache warm, alone or batched, and in pieces of any size."""

from __future__ import annotations

import inspect
import json
import json.decoder
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quantized_bundles import rotary_gqa_bundle
from scheduler_fakes import shared_prefix

from export.pipeline import Precision
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.prefix_cache import PrefixCache
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.types import MIN_PIECE, EngineSettings, NewSequence, next_piece
from serve.scheduling.offline import generate
from serve.scheduling.request import Completion


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


def test_match_takes_the_longest_shared_prefix_and_leaves_the_last_prompt_tokens() -> None:
    cache = PrefixCache(rows=[8, 9], min_tokens=2)
    assert cache.match([1, 2, 3, 4]) is None  # nothing kept yet
    assert cache.store(ids(1, 2, 3, 4)) == 8
    assert cache.store(ids(1, 2, 7, 7, 7)) == 9
    assert cache.match([1, 2, 3, 4, 5, 6]) == (8, 4)
    assert cache.match([1, 2, 7, 7, 7, 0, 0]) == (9, 5)
    assert MIN_PIECE == 2
    assert cache.match([1, 2, 3, 4]) == (8, 2)  # all of it kept: the last two tokens still run
    assert cache.match([1, 2, 3]) is None  # one token left to reuse, under min_tokens
    assert cache.match([1, 5]) is None  # one shared token, under min_tokens
    assert cache.match([2, 1, 2, 3]) is None  # a prefix, not a substring


def test_running_rows_are_candidates_too_but_only_with_cache_rows() -> None:
    cache = PrefixCache(rows=[8], min_tokens=2)
    cache.store(ids(1, 2, 3))
    running = [(0, ids(1, 2, 3, 4, 5)), (1, ids(7, 7, 7))]
    assert cache.match([1, 2, 3, 4, 5, 6, 7], running) == (0, 5)  # the running row shares more
    assert cache.match([1, 2, 3, 9, 9], running) == (8, 3)  # the kept row comes first on a tie
    assert cache.match([7, 7, 0, 0], running) == (1, 2)
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
    assert cache.match([2, 2, 0, 0]) is None and cache.match([1, 1, 0, 0]) == (0, 2)
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
        (min(shared_prefix(t, prompt), len(prompt) - MIN_PIECE) for t in kept.values()),
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
    from bench.scenarios.prefix import BURST, main

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
    # The previous prompt came from the cache; its answer, computed by decode steps, is prefilled again.
    assert chat["cached prompt tokens"] == {"4 rows": [16] * 2, "0 rows": [0, 0]}
    warm, cold = (figures for case, figures in cases.items() if "system" in case)
    assert all(n >= BURST * 16 for n in warm["cached prompt tokens"]["4 rows"])
    # Cold: what is not prefilled in the burst's first group starts from a running row.
    assert all(n >= 16 for n in cold["cached prompt tokens"]["4 rows"])
    assert warm["cached prompt tokens"]["0 rows"] == cold["cached prompt tokens"]["0 rows"] == [0, 0]


# --- the same tokens and logprobs with the cache warm -------------------------------------------------------

CACHED = EngineSettings(
    max_batch_size=8,
    session=SessionConfig(threads=2, spinning=False),
    prefix_cache_rows=8,
    prefix_cache_min_tokens=8,
)
NEW_TOKENS = 24  # tokens generated per request
PRECISIONS = [Precision(), Precision("int8"), Precision("int4")]  # int4: the exporter's block, 32


@pytest.fixture(scope="module")
def gqa_bundles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the rotary GQA bundles are written, the fp32 one shared by all."""
    return tmp_path_factory.mktemp("gqa")


@pytest.fixture(scope="module", params=PRECISIONS, ids=lambda precision: precision.kind)
def warm_pair(request: pytest.FixtureRequest, tiny_bundle: Path, gqa_bundles: Path) -> tuple[Engine, Engine]:
    """An engine without a prefix cache and one with it, of the rotary GQA bundle at a precision."""
    bundle = load_bundle(rotary_gqa_bundle(tiny_bundle, gqa_bundles, request.param))
    plain = Engine.from_bundle(bundle, replace(CACHED, prefix_cache_rows=0))
    return plain, Engine.from_bundle(bundle, CACHED)


def completions(engine: Engine, prompts: list[list[int]]) -> list[Completion]:
    """The prompts' greedy completions with logprobs, all submitted at once (one prompt: alone)."""
    return generate(engine, prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, include_logprobs=True)


def outputs(done: list[Completion]) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in done]


def cached_tokens(done: list[Completion]) -> list[int]:
    return [c.finish.cached_prompt_tokens for c in done if c.finish]


def test_a_request_gets_the_same_tokens_and_logprobs_alone_and_batched_with_the_cache_warm(
    warm_pair: tuple[Engine, Engine],
) -> None:
    """Prompts, then each one's next chat turn (prompt + answer + more), each alone, then all of them at once
    on the same engine: every one starts from the cache and gets the tokens and logprobs it gets alone
    without one, bit for bit. A prompt repeated whole recomputes its last two tokens, and a next turn the
    previous answer: a one-token query (a decode step's) attends in another order than a prefill's, so those
    positions' keys and values are not the ones a prefill of the prompt computes."""
    plain, cached = warm_pair
    source = cached.tokenizer.encode(inspect.getsource(json.decoder)).ids
    firsts = [source[200 * i : 200 * i + 24 + 4 * i] for i in range(4)]
    alone = [outputs(completions(plain, [p]))[0] for p in firsts]
    messages = [source[900 + 10 * i : 906 + 10 * i] for i in range(4)]
    turns = [[*p, *a, *m] for p, (a, _), m in zip(firsts, alone, messages, strict=True)]
    alone += [outputs(completions(plain, [p]))[0] for p in turns]
    prompts = [*firsts, *turns]
    warm = [completions(cached, [p])[0] for p in prompts]
    assert outputs(warm) == alone
    # Each next turn started from its first prompt's row, which holds that prompt (not its answer).
    assert cached_tokens(warm[4:]) == [len(p) for p in firsts]
    batched = completions(cached, prompts)
    assert outputs(batched) == alone
    # Every one started from the cache: the whole prompt but its last tokens.
    assert cached_tokens(batched) == [len(p) - MIN_PIECE for p in prompts]


@settings(max_examples=300, deadline=None)
@given(total=st.integers(MIN_PIECE, 60), chunk=st.integers(1, 70), data=st.data())
def test_pieces_cover_the_prompt_and_none_is_a_lone_token(
    total: int, chunk: int, data: st.DataObject
) -> None:
    done = data.draw(st.integers(0, total - MIN_PIECE))  # a hit leaves at least MIN_PIECE tokens
    pieces = []
    while done < total:
        pieces.append(next_piece(done, chunk, total))
        done += pieces[-1]
    assert done == total
    assert all(MIN_PIECE <= piece <= max(chunk, 2 * MIN_PIECE - 1) for piece in pieces)
    assert all(piece == max(chunk, MIN_PIECE) for piece in pieces[:-2])  # only the last two may differ


def test_a_prompt_prefilled_in_pieces_gets_the_tokens_and_logprobs_of_a_whole_prefill(
    warm_pair: tuple[Engine, Engine],
) -> None:
    """Pieces of every size, those that would leave a lone last token among them: a one-token piece would
    attend as a decode step does, and its keys and values would not be the whole prefill's."""
    plain, _ = warm_pair
    prompt = plain.tokenizer.encode(inspect.getsource(json.decoder)).ids[:29]
    want = outputs(completions(plain, [prompt]))[0]
    for chunk in (1, 2, 4, 7, 14, 28):  # 29 = 28 + 1 = 4 x 7 + 1: a lone last token, but for next_piece
        outs = plain.prefill([NewSequence("c", prompt, SamplingParams(), logprobs=True)], chunk=chunk)
        while plain.staged_id is not None:
            outs += plain.continue_prefill()
        while len(outs) < NEW_TOKENS:
            outs += plain.decode()
        plain.release(["c"])
        assert ([o.token_id for o in outs], [o.logprob for o in outs]) == want, chunk

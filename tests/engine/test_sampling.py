"""Sampling: each processor against a plain per-row reference, the draw's distribution, seeded reproducibility
whatever the batch around a row, logprobs of the raw distribution, and validation messages."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from serve.engine.logits_processors import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
)
from serve.engine.sampling import SamplingBatch, SamplingParams
from serve.errors import InvalidRequest

# ---------------------------------------------------------------- references: one row at a time, float64


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def ref_top_k(row: np.ndarray, k: int) -> np.ndarray:
    if k == 0 or k >= row.size:
        return row.copy()
    kth_largest = np.sort(row)[::-1][k - 1]
    return np.where(row < kth_largest, -np.inf, row)


def ref_top_p(row: np.ndarray, p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose probability reaches p (HF's nucleus)."""
    if p in (0.0, 1.0):
        return row.copy()
    probs = np.exp(log_softmax(row))
    order = np.argsort(-row, kind="stable")
    cumulative = np.cumsum(probs[order])
    last = int(np.searchsorted(cumulative, p))  # first index whose cumulative mass reaches p
    return np.where(row < row[order[min(last, row.size - 1)]], -np.inf, row)


def ref_penalty(row: np.ndarray, penalty: float, seen: set[int]) -> np.ndarray:
    out = row.copy()
    if penalty in (0.0, 1.0):
        return out
    for token in seen:
        out[token] = out[token] / penalty if out[token] > 0 else out[token] * penalty
    return out


def ref_openai(row: np.ndarray, frequency: float, presence: float, generated: list[int]) -> np.ndarray:
    """OpenAI's documented formula, token by token."""
    out = row.astype(np.float64)
    for token in set(generated):
        count = generated.count(token)
        out[token] -= count * frequency + (1.0 if count > 0 else 0.0) * presence
    return out


def ref_min_p(row: np.ndarray, min_p: float) -> np.ndarray:
    if min_p == 0.0:
        return row.copy()
    probs = np.exp(log_softmax(row))
    return np.where(probs < min_p * probs.max(), -np.inf, row)


# ---------------------------------------------------------------- strategies

small_logits = hnp.arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(2, 40)),
    elements=st.floats(-20, 20, width=32),
)


# ---------------------------------------------------------------- processors


@settings(max_examples=40, deadline=None)
@given(logits=small_logits, data=st.data())
def test_temperature_divides_rows_and_leaves_off_rows(logits: np.ndarray, data: st.DataObject) -> None:
    temps = np.array(
        data.draw(
            st.lists(st.sampled_from([0.0, 1.0, 0.5, 0.7, 2.0]), min_size=len(logits), max_size=len(logits))
        ),
        dtype=np.float32,
    )
    out = logits.copy()
    apply_temperature(out, temps)
    for row, t, got in zip(logits, temps, out, strict=True):
        expected = row if t in (0.0, 1.0) else (row - row.max()) / t
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


@settings(max_examples=50, deadline=None)
@given(logits=small_logits, data=st.data())
def test_top_k_matches_reference(logits: np.ndarray, data: st.DataObject) -> None:
    vocab = logits.shape[1]
    ks = np.array(data.draw(st.lists(st.integers(0, vocab + 2), min_size=len(logits), max_size=len(logits))))
    out = logits.copy()
    apply_top_k(out, ks)
    for row, k, got in zip(logits, ks, out, strict=True):
        np.testing.assert_array_equal(got, ref_top_k(row, int(k)))
        if 0 < k < vocab:
            assert np.isfinite(got).sum() >= k


@settings(max_examples=50, deadline=None)
@given(logits=small_logits, data=st.data())
def test_top_p_matches_reference(logits: np.ndarray, data: st.DataObject) -> None:
    ps = data.draw(
        st.lists(st.sampled_from([0.0, 1.0, 0.1, 0.5, 0.9, 0.95]), min_size=len(logits), max_size=len(logits))
    )
    for row, p in zip(logits, ps, strict=True):
        # A cumulative mass within rounding of p could go either way: not a property of the algorithm.
        cumulative = np.cumsum(np.sort(np.exp(log_softmax(row)))[::-1])
        assume(np.abs(cumulative - p).min() > 1e-4)
    out = logits.copy()
    apply_top_p(out, np.array(ps, dtype=np.float32))
    for row, p, got in zip(logits, ps, out, strict=True):
        np.testing.assert_array_equal(got, ref_top_p(row, p))


def test_top_p_wide_nucleus_beyond_the_candidate_shortcut() -> None:
    """A flat row needs more than the 256 candidates top-p looks at first; a peaked one does not."""
    rng = np.random.default_rng(3)
    flat = rng.normal(0.0, 0.1, 2000).astype(np.float32)
    peaked = rng.normal(0.0, 1.0, 2000).astype(np.float32)
    peaked[:10] += 12.0
    logits = np.stack([flat, peaked])
    out = logits.copy()
    apply_top_p(out, np.array([0.9, 0.9], dtype=np.float32))
    assert np.isfinite(out[0]).sum() > 1000
    assert np.isfinite(out[1]).sum() <= 10
    for row, got in zip(logits, out, strict=True):
        np.testing.assert_array_equal(got, ref_top_p(row, 0.9))


@settings(max_examples=40, deadline=None)
@given(logits=small_logits, data=st.data())
def test_repetition_penalty_matches_reference(logits: np.ndarray, data: st.DataObject) -> None:
    n, vocab = logits.shape
    penalties = data.draw(st.lists(st.sampled_from([0.0, 1.0, 0.5, 1.3, 2.0]), min_size=n, max_size=n))
    seen_sets = [data.draw(st.sets(st.integers(0, vocab - 1), max_size=vocab)) for _ in range(n)]
    # Repeats, as a row's history holds them, must not apply the penalty twice.
    seen = [np.array(sorted(tokens) * 2, dtype=np.int64) for tokens in seen_sets]
    out = logits.copy()
    apply_repetition_penalty(out, np.array(penalties, dtype=np.float32), seen)
    for row, penalty, tokens, got in zip(logits, penalties, seen_sets, out, strict=True):
        np.testing.assert_allclose(got, ref_penalty(row, penalty, tokens), rtol=1e-6)


@settings(max_examples=40, deadline=None)
@given(logits=small_logits, data=st.data())
def test_frequency_and_presence_penalties_match_openais_formula(
    logits: np.ndarray, data: st.DataObject
) -> None:
    n, vocab = logits.shape
    levels = st.sampled_from([0.0, 0.5, -0.7, 2.0, -2.0])
    frequency = data.draw(st.lists(levels, min_size=n, max_size=n))
    presence = data.draw(st.lists(levels, min_size=n, max_size=n))
    generated = [data.draw(st.lists(st.integers(0, vocab - 1), max_size=12)) for _ in range(n)]
    out = logits.copy()
    apply_frequency_presence(
        out,
        np.array(frequency, dtype=np.float32),
        np.array(presence, dtype=np.float32),
        [np.array(g, dtype=np.int64) for g in generated],
    )
    for i, row in enumerate(logits):
        np.testing.assert_allclose(
            out[i], ref_openai(row, frequency[i], presence[i], generated[i]), atol=1e-5
        )


def test_logit_bias_adds_to_the_named_tokens_of_each_row() -> None:
    logits = np.zeros((3, 5), dtype=np.float32)
    biases = [
        (np.array([4, 0]), np.array([2.5, -1.0], np.float32)),
        (np.array([1]), np.array([7.0], np.float32)),
    ]
    apply_logit_bias(logits, np.array([0, 2]), biases)
    np.testing.assert_array_equal(logits, [[-1, 0, 0, 0, 2.5], [0, 0, 0, 0, 0], [0, 7, 0, 0, 0]])
    apply_logit_bias(logits, np.array([], dtype=np.int64), [])  # no row biased: nothing to do


def test_logit_bias_steers_greedy_and_sampled_rows() -> None:
    row = np.array([5.0, 1.0, 0.0, -1.0], dtype=np.float32)
    batch = SamplingBatch()
    batch.append(SamplingParams(logit_bias=((3, 100.0),)), (1,))  # all but forces token 3
    batch.append(SamplingParams(temperature=1.0, seed=2, logit_bias=((0, -100.0),)), (1,))  # bans token 0
    batch.append(SamplingParams(), (1,))
    picks = [batch.sample(np.tile(row, (3, 1)))[0].tolist() for _ in range(30)]
    assert all(p[0] == 3 and p[1] != 0 and p[2] == 0 for p in picks)


@settings(max_examples=40, deadline=None)
@given(logits=small_logits, data=st.data())
def test_min_p_matches_reference(logits: np.ndarray, data: st.DataObject) -> None:
    n = logits.shape[0]
    min_p = data.draw(st.lists(st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]), min_size=n, max_size=n))
    out = logits.copy()
    apply_min_p(out, np.array(min_p, dtype=np.float32))
    for i, row in enumerate(logits):
        expected = ref_min_p(row, min_p[i])
        # Tokens within float32 rounding of the threshold may fall either way; all others must agree.
        probs = np.exp(log_softmax(row))
        clear = np.abs(probs - min_p[i] * probs.max()) > 1e-5
        np.testing.assert_array_equal(out[i][clear], expected[clear])
        assert out[i][row.argmax()] == row.max()  # the most likely token always stays


def test_repetition_penalty_lowers_both_signs() -> None:
    logits = np.array([[2.0, -2.0, 1.0]], dtype=np.float32)
    apply_repetition_penalty(logits, np.array([2.0], dtype=np.float32), [np.array([0, 1])])
    np.testing.assert_array_equal(logits, [[1.0, -4.0, 1.0]])


# ---------------------------------------------------------------- SamplingBatch


def batch_of(
    *params: SamplingParams, prompt: tuple[int, ...] = (1, 2), logprobs: bool = True
) -> SamplingBatch:
    batch = SamplingBatch()
    for p in params:
        batch.append(p, prompt, logprobs)
    return batch


def test_greedy_is_argmax_and_logprobs_are_log_softmax() -> None:
    logits = np.random.default_rng(0).normal(0, 3, (5, 300)).astype(np.float32)
    tokens, logprobs = batch_of(*[SamplingParams()] * 5).sample(logits)
    np.testing.assert_array_equal(tokens, logits.argmax(axis=1))
    assert tokens.dtype == np.int64 and logprobs.dtype == np.float32
    expected = [log_softmax(row)[t] for row, t in zip(logits, tokens, strict=True)]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)


def test_logprobs_are_of_the_raw_distribution_not_the_processed_one() -> None:
    logits = np.random.default_rng(1).normal(0, 2, (3, 50)).astype(np.float32)
    batch = batch_of(
        SamplingParams(temperature=0.3, top_k=3, seed=1),
        SamplingParams(temperature=2.0, top_p=0.5, seed=2),
        SamplingParams(repetition_penalty=3.0),
        prompt=tuple(range(50)),
    )
    tokens, logprobs = batch.sample(logits)
    expected = [log_softmax(row)[t] for row, t in zip(logits, tokens, strict=True)]
    np.testing.assert_allclose(logprobs, expected, rtol=1e-5, atol=1e-5)


def test_logprobs_only_for_the_rows_that_ask() -> None:
    logits = np.random.default_rng(3).normal(0, 2, (4, 60)).astype(np.float32)
    batch = SamplingBatch()
    for i, wants in enumerate((False, True, False, True)):
        batch.append(SamplingParams(temperature=0.5 * i, seed=i), (1, 2), logprobs=wants)
    tokens, logprobs = batch.sample(logits)
    assert np.isnan(logprobs[[0, 2]]).all()
    expected = [log_softmax(logits[i])[tokens[i]] for i in (1, 3)]
    np.testing.assert_allclose(logprobs[[1, 3]], expected, rtol=1e-5, atol=1e-5)
    # The flag moves with its row on swap-remove: row 3 takes row 0's place.
    batch.remove(0)
    tokens, logprobs = batch.sample(logits[:3])
    assert np.isfinite(logprobs[[0, 1]]).all() and np.isnan(logprobs[2])
    untouched = batch_of(SamplingParams(), SamplingParams(), logprobs=False).sample(logits[:2])
    assert np.isnan(untouched[1]).all()


def draw_frequencies(params: SamplingParams, logits_row: np.ndarray, rows: int, steps: int) -> np.ndarray:
    batch = SamplingBatch()
    for seed in range(rows):
        batch.append(dataclasses.replace(params, seed=seed), ())
    logits = np.tile(logits_row, (rows, 1))
    counts = np.zeros(logits_row.size)
    for _ in range(steps):
        tokens, _ = batch.sample(logits)
        counts += np.bincount(tokens, minlength=logits_row.size)
    return counts / (rows * steps)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=0.8, top_p=0.7),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9),
        SamplingParams(temperature=0.9, min_p=0.2),
        SamplingParams(temperature=1.4, top_p=0.95, min_p=0.1),
    ],
)
def test_sampled_frequencies_follow_the_processed_distribution(params: SamplingParams) -> None:
    row = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -np.inf, 0.2, 1.2], dtype=np.float32)
    expected_logits = ref_top_p(ref_top_k(row / params.temperature, params.top_k), params.top_p)
    expected_logits = ref_min_p(expected_logits, params.min_p)
    expected = np.exp(log_softmax(expected_logits))
    samples = 2000 * 10
    freq = draw_frequencies(params, row, rows=2000, steps=10)
    assert np.all(freq[expected == 0.0] == 0.0), "a token outside the processed support was drawn"
    sigma = np.sqrt(expected * (1 - expected) / samples)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), (freq, expected)


def test_draw_over_a_vocabulary_that_is_not_a_multiple_of_the_block() -> None:
    vocab = 1000
    row = np.full(vocab, -np.inf, dtype=np.float32)
    row[[0, 63, 64, 999]] = [0.0, 1.0, 0.5, 2.0]
    freq = draw_frequencies(SamplingParams(temperature=1.0), row, rows=500, steps=8)
    expected = np.exp(log_softmax(row))
    assert set(np.flatnonzero(freq)) <= {0, 63, 64, 999}
    np.testing.assert_allclose(freq, expected, atol=0.03)


def row_logits(row_id: int, step: int, vocab: int) -> np.ndarray:
    """What the model would say for sequence `row_id` at `step`, whatever batch it is in."""
    return np.random.default_rng([row_id, step]).normal(0, 2, vocab).astype(np.float32)


@pytest.mark.parametrize("vocab", [257, 8192])
def test_seeded_row_is_reproducible_whatever_the_batch(vocab: int) -> None:
    target = SamplingParams(
        temperature=0.9,
        top_k=100,
        top_p=0.95,
        repetition_penalty=1.1,
        seed=1234,
        min_p=0.01,
        frequency_penalty=0.4,
        presence_penalty=0.3,
    )
    steps = 12
    banned = (3, 4)  # its EOS and a stop token, for its first 5 tokens

    alone = SamplingBatch()
    alone.append(target, (5, 6, 7), banned=banned, banned_for=5)
    expected = [int(alone.sample(row_logits(0, s, vocab)[None])[0][0]) for s in range(steps)]

    # The same sequence joins behind others, which leave (swap-remove moves it) and join around it.
    batch = SamplingBatch()
    ids: list[int] = []
    neighbours = [
        SamplingParams(),
        SamplingParams(temperature=1.3, seed=9),
        SamplingParams(temperature=0.7, top_p=0.5),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(temperature=1.1, frequency_penalty=-1.0, min_p=0.2, seed=3),
    ]
    for i, p in enumerate(neighbours, start=1):
        batch.append(p, (i,))
        ids.append(i)
    # It joins as the engine's prefill does: sampled first in its own group, then the group joins.
    group = SamplingBatch()
    group.append(SamplingParams(temperature=1.0, seed=77), (8,))
    group.append(target, (5, 6, 7), banned=banned, banned_for=5)
    prefill_ids = [50, 0]
    first = group.sample(np.stack([row_logits(i, 0, vocab) for i in prefill_ids]))[0]
    got = [int(first[1])]
    batch.sample(np.stack([row_logits(i, 0, vocab) for i in ids]))
    batch.extend(group)
    ids.extend(prefill_ids)
    for s in range(1, steps):
        if s == 3:  # the first row leaves: the target (last) moves into row 0
            batch.remove(0)
            ids[0] = ids.pop()
        if s == 6:
            batch.append(SamplingParams(temperature=2.0, top_k=7, seed=5), (9,))
            ids.append(99)
        if s == 8:
            batch.remove(len(batch) - 2)
            ids[len(ids) - 2] = ids.pop()
        logits = np.stack([row_logits(i, s, vocab) for i in ids])
        tokens, _ = batch.sample(logits)
        got.append(int(tokens[ids.index(0)]))
    assert got == expected


@pytest.mark.parametrize("vocab", [5, 300])
def test_alternatives_are_the_most_likely_tokens_of_the_raw_distribution(vocab: int) -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4, vocab)).astype(np.float32)
    batch = SamplingBatch()
    batch.append(SamplingParams(), (1,), logprobs=True, top_logprobs=3)
    batch.append(SamplingParams(temperature=0.5, top_k=2, seed=1), (1,), logprobs=True, top_logprobs=20)
    batch.append(SamplingParams(), (1,), logprobs=True)  # logprobs only: no alternatives
    batch.append(SamplingParams(repetition_penalty=3.0), (1,), logprobs=True, top_logprobs=1)
    tokens, logprobs = batch.sample(logits)
    top = batch.alternatives
    assert sorted(top) == [0, 1, 3]
    for row, k in ((0, 3), (1, 20), (3, 1)):
        reference = log_softmax(logits[row])
        expected = np.argsort(-reference, kind="stable")[: min(k, vocab)]
        assert top[row].token_ids == expected.tolist()
        np.testing.assert_allclose(top[row].logprobs, reference[expected], rtol=1e-5, atol=1e-5)
    # Greedy on the raw logits picks the first alternative, with the same logprob.
    assert top[0].token_ids[0] == tokens[0] and top[0].logprobs[0] == logprobs[0]
    assert SamplingBatch().alternatives == {}
    with pytest.raises(ValueError, match=r"top_logprobs must be in 0\.\.20"):
        batch.append(SamplingParams(), (1,), top_logprobs=21)


def test_banned_tokens_are_not_picked_for_their_first_tokens_then_are() -> None:
    # Token 2 (an EOS, say) is every row's argmax and most likely draw; rows ban it for 3 tokens.
    row = np.array([0.0, 1.0, 9.0, 0.5], dtype=np.float32)
    batch = SamplingBatch()
    batch.append(SamplingParams(), (1,), banned=(2,), banned_for=3)
    batch.append(SamplingParams(temperature=1.0, seed=4), (1,), banned=(2, 0), banned_for=3)
    batch.append(SamplingParams(), (1,))  # bans nothing: picks 2 from the start
    batch.append(SamplingParams(), (1,), banned=(), banned_for=3)  # min_new_tokens with ignore_eos
    picks = [batch.sample(np.tile(row, (4, 1)))[0].tolist() for _ in range(5)]
    assert [p[0] for p in picks] == [1, 1, 1, 2, 2]
    assert all(p[1] in (1, 3) for p in picks[:3])
    assert [p[2] for p in picks] == [2] * 5 == [p[3] for p in picks]


def test_banned_token_logprobs_stay_those_of_the_raw_distribution() -> None:
    row = np.array([0.0, 1.0, 9.0], dtype=np.float32)
    batch = SamplingBatch()
    batch.append(SamplingParams(), (1,), logprobs=True, banned=(2,), banned_for=1)
    tokens, logprobs = batch.sample(row[None])
    assert tokens.tolist() == [1]
    np.testing.assert_allclose(logprobs, [log_softmax(row)[1]], rtol=1e-6)


def test_greedy_frequency_penalty_counts_generated_tokens_not_the_prompt() -> None:
    row = np.array([3.0, 2.5, 0.0], dtype=np.float32)
    batch = SamplingBatch()
    batch.append(SamplingParams(frequency_penalty=0.4), (0, 0, 0))  # the prompt's 0s cost nothing
    batch.append(SamplingParams(presence_penalty=1.0), (0,))
    picks = [batch.sample(np.tile(row, (2, 1)))[0].tolist() for _ in range(4)]
    # frequency: 0 (3.0), 0 (2.6), 1 (2.5 > 2.2), 0 (2.2 > 2.1): counts 2 of token 0 then 1 of token 1
    assert [p[0] for p in picks] == [0, 0, 1, 0]
    # presence: 0 (3.0), then 1 (2.5 > 2.0), then 0 and 1 are both penalized once: 0 (2.0 > 1.5)
    assert [p[1] for p in picks] == [0, 1, 0, 0]


def test_unseeded_rows_differ() -> None:
    batch = batch_of(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0))
    logits = np.zeros((2, 1000), dtype=np.float32)
    draws = np.array([batch.sample(logits)[0] for _ in range(10)])
    assert not np.array_equal(draws[:, 0], draws[:, 1])


def test_greedy_repetition_penalty_uses_prompt_and_generated_tokens() -> None:
    batch = SamplingBatch()
    batch.append(SamplingParams(repetition_penalty=4.0), (0,))
    logits = np.array([[3.0, 2.0, 1.0, -5.0]], dtype=np.float32)
    first, _ = batch.sample(logits)  # 0 is in the prompt: 3/4 < 2
    second, _ = batch.sample(logits)  # 1 was just generated: 2/4 < 1
    third, _ = batch.sample(logits)  # 0.75, 0.5, 0.25: back to token 0
    assert [int(first[0]), int(second[0]), int(third[0])] == [1, 2, 0]


def test_penalty_history_grows_past_its_first_buffer() -> None:
    vocab, prompt = 300, list(range(0, 300, 7))
    batch = SamplingBatch()
    batch.append(SamplingParams(repetition_penalty=1.3), prompt)
    rng = np.random.default_rng(4)
    seen = set(prompt)
    for _ in range(150):
        logits = rng.normal(0, 1, (1, vocab)).astype(np.float32)
        expected = int(ref_penalty(logits[0], 1.3, seen).argmax())
        assert int(batch.sample(logits)[0][0]) == expected
        seen.add(expected)


def test_remove_swaps_the_last_row_in() -> None:
    batch = batch_of(SamplingParams(repetition_penalty=100.0), SamplingParams(), prompt=(0,))
    batch.append(SamplingParams(repetition_penalty=100.0), (1,))
    batch.remove(0)
    logits = np.tile(np.array([2.0, 1.9, 0.5], dtype=np.float32), (2, 1))
    tokens, _ = batch.sample(logits)
    # Row 0 is now the penalized one that saw token 1; row 1 the plain greedy one.
    assert tokens.tolist() == [0, 0]
    logits = np.tile(np.array([1.9, 2.0, 0.5], dtype=np.float32), (2, 1))
    assert batch.sample(logits)[0].tolist() == [2, 1]


def test_a_tiny_temperature_samples_the_argmax_without_nan() -> None:
    logits = np.random.default_rng(2).normal(0, 3, (4, 100)).astype(np.float32)
    batch = batch_of(*[SamplingParams(temperature=1e-38, seed=i) for i in range(4)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, logprobs = batch.sample(logits)
    np.testing.assert_array_equal(tokens, logits.argmax(axis=1))
    assert np.isfinite(logprobs).all()


def test_empty_batch_samples_nothing() -> None:
    tokens, logprobs = SamplingBatch().sample(np.zeros((0, 10), dtype=np.float32))
    assert tokens.shape == logprobs.shape == (0,)


def test_bad_calls_are_refused() -> None:
    batch = batch_of(SamplingParams())
    with pytest.raises(ValueError, match=r"logits must be \[1, vocab\]"):
        batch.sample(np.zeros((2, 10), dtype=np.float32))
    with pytest.raises(IndexError, match="row 3 out of range"):
        batch.remove(3)
    with pytest.raises(ValueError, match=">= 0"):
        batch.append(SamplingParams(repetition_penalty=1.2), (-1,))
    with pytest.raises(InvalidRequest, match="temperature"):
        batch.append(SamplingParams(temperature=-1.0), (1,))
    assert len(batch) == 1
    penalized = batch_of(SamplingParams(repetition_penalty=1.2), prompt=(50,))
    with pytest.raises(ValueError, match="outside the vocabulary of 10"):
        penalized.sample(np.zeros((1, 10), dtype=np.float32))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.1), "temperature must be a finite number >= 0"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_k=-1), "top_k must be an integer >= 0"),
        (SamplingParams(top_p=1.5), r"top_p must be in \[0, 1\]"),
        (SamplingParams(top_p=float("nan")), "top_p"),
        (SamplingParams(repetition_penalty=-1.0), "repetition_penalty must be 0"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(seed=-3), "seed must be an integer in 0.."),
        (SamplingParams(seed=2**64), "seed"),
        (SamplingParams(min_p=1.2), r"min_p must be in \[0, 1\]"),
        (SamplingParams(min_p=float("nan")), "min_p"),
        (SamplingParams(frequency_penalty=2.5), r"frequency_penalty must be in \[-2, 2\]"),
        (SamplingParams(presence_penalty=float("-inf")), "presence_penalty"),
        (SamplingParams(logit_bias=((5, 101.0),)), r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
        (SamplingParams(logit_bias=((5, float("nan")),)), r"logit_bias\[5\]"),
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias token ids must be integers >= 0, got -1"),
        (SamplingParams(logit_bias=((5, 1.0), (5, 2.0))), "names a token id twice"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "301 entries; at most 300"),
    ],
)
def test_validate_names_the_field_and_range(params: SamplingParams, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        params.validate()


def test_validate_accepts_the_documented_ranges() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=40, top_p=1.0, repetition_penalty=1.1, seed=2**64 - 1).validate()
    SamplingParams(min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0).validate()
    SamplingParams(logit_bias=tuple((i, 100.0 if i % 2 else -100.0) for i in range(300))).validate()


def test_the_sampling_benchmark_times_every_case_it_reports() -> None:
    from bench.scenarios.sampling import CASES, REPORTED, logits_like, per_step_ms

    logits = logits_like("peaked", 3, 300, np.random.default_rng(0))
    timings = [per_step_ms(params, logits, steps=2, repeats=1) for params in CASES.values()]
    greedy = SamplingParams()
    timings += [per_step_ms(greedy, logits, steps=2, repeats=1, top_logprobs=k) for k in REPORTED.values()]
    assert all(wall > 0 and cpu >= 0 for wall, cpu in timings)

"""The logits processors: each transforms the running batch's `[n, vocab]` logits in place, row by row, with a
per-row parameter vector, and leaves alone the rows where its parameter means "off" (serve/engine/sampling.py
chains them and keeps each row's state). Vectorized numpy: they run on every decode step. Every reduction
runs along its own row, so a row's result does not depend on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Top-p looks for its threshold among this many largest logits, then (rows whose nucleus is wider) among
# the next size's, and sorts a whole row only past the last: O(vocab) for the usual case instead of a sort.
# At a vocabulary of 151,936 a peaked row's tail alone can hold 10% of the mass, so its nucleus of 0.9
# needs more than 256 tokens; the second size spares those rows the full sort
# (docs/benchmarks.md, "Sampling, logprobs and scoring costs").
_TOP_P_CANDIDATES = (256, 4096)
# Tokens per block of the two-level inverse-CDF draw.
_DRAW_BLOCK = 64


def _active_rows(logits: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows a processor changes, as a block it may modify, and their indices (None: all rows)."""
    if active.all():
        return logits, None
    rows = np.flatnonzero(active)
    return logits[rows], rows


def _store(logits: np.ndarray, block: np.ndarray, rows: np.ndarray | None) -> None:
    if rows is not None:
        logits[rows] = block


def penalizes(penalty: np.ndarray) -> np.ndarray:
    """Which rows a repetition penalty changes: 0 is off and 1 is the identity."""
    return (penalty > 0.0) & (penalty != 1.0)


def apply_repetition_penalty(logits: np.ndarray, penalty: np.ndarray, seen: Sequence[np.ndarray]) -> None:
    """In place: over tokens already seen, positive logits are divided by the penalty, the rest multiplied.

    `penalty` [n] (0 and 1 are off); `seen[i]` holds the token ids row i has seen (prompt and generated;
    repeats are harmless). Only the seen entries are gathered and scattered: a full-width pass would cost
    a mispredicted branch per logit.
    """
    active = np.flatnonzero(penalizes(penalty))
    if active.size == 0:
        return
    ids = [seen[i] for i in active.tolist()]
    rows = np.repeat(active, [len(row_ids) for row_ids in ids])
    cols = np.concatenate(ids)
    values = logits[rows, cols]  # a repeated id reads and writes the same original value
    factor = penalty[rows].astype(np.float32)
    logits[rows, cols] = np.where(values > 0.0, values / factor, values * factor)


def apply_logit_bias(
    logits: np.ndarray, rows: np.ndarray, biases: Sequence[tuple[np.ndarray, np.ndarray]]
) -> None:
    """In place: add `biases[j]` (token ids, values) to row `rows[j]`."""
    if len(rows):
        ids, values = zip(*biases, strict=True)
        cols = np.concatenate(ids)
        logits[np.repeat(rows, [len(i) for i in ids]), cols] += np.concatenate(values)


def apply_frequency_presence(
    logits: np.ndarray, frequency: np.ndarray, presence: np.ndarray, generated: Sequence[np.ndarray]
) -> None:
    """In place (OpenAI's definition): logit[t] -= frequency x count[t] + presence x (count[t] > 0), where
    count[t] is how often row i generated token t (the prompt does not count). `frequency`, `presence` [n];
    `generated[i]` the token ids row i generated so far."""
    active = np.flatnonzero((frequency != 0.0) | (presence != 0.0))
    ids = [generated[i] for i in active.tolist()]
    if not ids or not sum(len(row_ids) for row_ids in ids):
        return
    vocab = logits.shape[1]
    keys = np.repeat(active, [len(row_ids) for row_ids in ids]) * vocab + np.concatenate(ids)
    keys, counts = np.unique(keys, return_counts=True)  # one entry per (row, token), with its count
    rows, cols = np.divmod(keys, vocab)
    logits[rows, cols] -= (frequency[rows] * counts + presence[rows]).astype(np.float32)


def apply_token_bitmask(logits: np.ndarray, rows: np.ndarray, bitmask: np.ndarray) -> None:
    """In place: -inf in row `rows[j]` for every token whose bit is 0 in `bitmask[j]` (llguidance's layout:
    int32 words, bit t % 32 of word t // 32 is token t; words past the vocabulary are ignored). `rows`
    ascend and are distinct."""
    if not len(rows):
        return
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words cannot cover a vocabulary of {vocab}")
    words = np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8)
    banned = np.unpackbits(words, axis=1, count=vocab, bitorder="little").view(bool)
    np.logical_not(banned, out=banned)
    if len(rows) == logits.shape[0]:  # every row masked (rows ascend): in place
        np.putmask(logits, banned, -np.inf)
        return
    block = logits[rows]
    np.putmask(block, banned, -np.inf)
    logits[rows] = block


def ban_tokens(logits: np.ndarray, rows: np.ndarray, banned: Sequence[np.ndarray]) -> None:
    """In place: -inf for the token ids `banned[j]` in row `rows[j]` (EOS until `min_new_tokens`)."""
    if len(rows):
        logits[np.repeat(rows, [len(ids) for ids in banned]), np.concatenate(banned)] = -np.inf


def apply_temperature(logits: np.ndarray, temperature: np.ndarray) -> None:
    """In place: divide each row by its temperature (0 = greedy and 1 are left alone).

    Each row is first shifted so that its largest logit is 0, which changes no probability: a tiny
    temperature then sends the others to -inf (the argmax, as in the limit T -> 0) instead of sending the
    top ones to +inf, where the softmax's inf - inf is NaN.
    """
    active = (temperature > 0.0) & (temperature != 1.0)
    if not active.any():
        return
    block, rows = _active_rows(logits, active)
    block -= block.max(axis=1, keepdims=True)
    with np.errstate(over="ignore"):
        block /= temperature[active, None].astype(np.float32)
    _store(logits, block, rows)


def apply_top_k(logits: np.ndarray, top_k: np.ndarray) -> None:
    """In place: keep each row's `k` largest logits (and any tied with the k-th), -inf elsewhere; 0 = off."""
    vocab = logits.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    if not active.any():
        return
    block, rows = _active_rows(logits, active)
    kth = vocab - top_k[active]
    # One partition places every distinct k-th position the block needs.
    partitioned = np.partition(block, np.unique(kth), axis=1)
    threshold = np.take_along_axis(partitioned, kth[:, None], axis=1)
    block[block < threshold] = -np.inf
    _store(logits, block, rows)


def apply_min_p(logits: np.ndarray, min_p: np.ndarray) -> None:
    """In place: -inf for tokens less likely than `min_p` x the row's most likely token; 0 is off.
    In logits: below the row's largest logit + log(min_p); no softmax is needed."""
    active = min_p > 0.0
    if not active.any():
        return
    block, rows = _active_rows(logits, active)
    threshold = block.max(axis=1, keepdims=True) + np.log(min_p[active, None].astype(np.float32))
    block[block < threshold] = -np.inf
    _store(logits, block, rows)


def _nucleus_threshold(descending: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the logit of the last token the nucleus needs, and whether the sorted prefix reached it.

    `descending` holds (a prefix of) each row's logits sorted high to low; `target` is the probability
    mass to reach, in the unnormalized units of exp(logit - row max).
    """
    cumulative = np.cumsum(np.exp(descending - descending[:, :1]), axis=1, dtype=np.float64)
    inside = (cumulative < target[:, None]).sum(axis=1)
    reached = inside < descending.shape[1]
    last = np.minimum(inside, descending.shape[1] - 1)
    return np.take_along_axis(descending, last[:, None], axis=1), reached


def apply_top_p(logits: np.ndarray, top_p: np.ndarray) -> None:
    """In place: keep the smallest set of top tokens whose probability reaches `p` (ties with its last token
    kept too), -inf elsewhere; 0 and 1 are off."""
    active = (top_p > 0.0) & (top_p < 1.0)
    if not active.any():
        return
    block, rows = _active_rows(logits, active)
    row_max = block.max(axis=1, keepdims=True)
    target = top_p[active].astype(np.float32) * np.exp(block - row_max).sum(axis=1)
    vocab = block.shape[1]
    threshold = np.empty((block.shape[0], 1), dtype=block.dtype)
    wide = np.ones(block.shape[0], dtype=bool)
    for candidates in _TOP_P_CANDIDATES:
        if candidates >= vocab or not wide.any():
            break
        rows_left = np.flatnonzero(wide)
        top = np.partition(block[rows_left], vocab - candidates, axis=1)[:, vocab - candidates :]
        found, reached = _nucleus_threshold(np.sort(top, axis=1)[:, ::-1], target[rows_left])
        threshold[rows_left[reached]] = found[reached]
        wide[rows_left[reached]] = False
    if wide.any():
        threshold[wide] = _nucleus_threshold(np.sort(block[wide], axis=1)[:, ::-1], target[wide])[0]
    block[block < threshold] = -np.inf
    _store(logits, block, rows)


def draw(logits: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Inverse-CDF sampling from softmax(logits), one uniform in [0, 1) per row.

    In two levels (which block of tokens, then which token in it) because a cumulative sum over the whole
    vocabulary is a serial chain of adds, several times slower than the block sums.
    """
    n, vocab = logits.shape
    blocks = -(-vocab // _DRAW_BLOCK)
    weights = np.zeros((n, blocks * _DRAW_BLOCK), dtype=np.float32)
    np.exp(logits - logits.max(axis=1, keepdims=True), out=weights[:, :vocab])
    weights = weights.reshape(n, blocks, _DRAW_BLOCK)
    block_cdf = np.cumsum(weights.sum(axis=2), axis=1, dtype=np.float64)
    # (1 - u) lies in (0, 1], so the target is > 0 and <= the total: the chosen block has weight > 0.
    target = (1.0 - uniform) * block_cdf[:, -1]
    block = np.minimum((block_cdf < target[:, None]).sum(axis=1), blocks - 1)
    before = np.where(block > 0, block_cdf[np.arange(n), block - 1], 0.0)
    inner = weights[np.arange(n), block]
    offset = (np.cumsum(inner, axis=1, dtype=np.float64) < (target - before)[:, None]).sum(axis=1)
    # Rounding may leave the block's running sum just short of its total: take its last weighted token.
    last_weighted = _DRAW_BLOCK - 1 - np.argmax(inner[:, ::-1] > 0.0, axis=1)
    return block * _DRAW_BLOCK + np.minimum(offset, last_weighted)

"""Routing a run's tokens to their LoRA slots: which tokens of a run take which slot, given per run as the
serving graph's routing inputs (serve/lora_layout.py: LORA_ROWS_INPUT, LORA_POSITIONS_INPUT,
LORA_TOKENS_INPUT).
"""

from __future__ import annotations

import numpy as np

from serve.lora_layout import LORA_POSITIONS_INPUT, LORA_ROWS_INPUT, LORA_TOKENS_INPUT


def token_slots(row_slots: np.ndarray, tokens: int, span: tuple[int, int]) -> dict[str, np.ndarray]:
    """The graph's inputs that route a run's tokens to their slots (serve/lora_layout.py, LORA_ROWS_INPUT and
    the rest), for rows whose slots are `row_slots` (0: none; the others within `span`, the slots the run is
    given, first to last), `tokens` positions each: the tokens of each slot of the span in a row of their
    own (in token order, padded with token (0, 0) to the longest), and each token with an adapter, where it
    is there. A token is its (row, position)."""
    slot = np.repeat(row_slots.astype(np.int64), tokens)  # by token, flat
    token = np.flatnonzero(slot)  # the tokens with an adapter, in order
    span_slot = slot[token] - span[0]  # each one's slot counted in the span
    k = span[1] - span[0] + 1 if token.size else 0
    counts = np.bincount(span_slot, minlength=k)
    n = int(counts.max()) if token.size else 0
    order = np.argsort(span_slot, kind="stable")  # the tokens grouped by slot, in order within each
    place = np.empty(token.size, np.int64)
    place[order] = np.arange(token.size) - (np.cumsum(counts) - counts)[span_slot[order]]
    at = np.stack(np.divmod(token, tokens), axis=-1)  # [m, 2]: (row, position)
    rows = np.zeros((k, 1, n, 2), np.int64)
    rows[span_slot, 0, place] = at
    return {
        LORA_ROWS_INPUT: rows,
        LORA_POSITIONS_INPUT: np.stack([span_slot, place], axis=-1),
        LORA_TOKENS_INPUT: at,
    }

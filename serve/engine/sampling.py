"""Next-token choice for the whole running batch: logits processors and per-row sampling state.

Runs on the hot path (every decode step, every row), so everything is vectorized numpy over `[n, vocab]`. The
processors (serve/engine/logits_processors.py) follow Hugging Face / TGI / vLLM semantics and are applied as a
chain: a constrained row's allowed-token mask (structured output, serve/engine/constraints.py: -inf outside
it), OpenAI's logit bias (-100 bans the token, as OpenAI documents), the penalties (repetition over prompt and
output, then OpenAI's frequency and presence over the output), banned tokens (EOS and stop token ids until
`min_new_tokens`), then for sampled rows temperature, top-k, top-p and min-p. Each takes a per-row parameter
vector and leaves alone the rows where its parameter means "off". A row that the mask and the bans leave
without any token is refused (`SamplingBatch.refused`) rather than sampled from nothing.

Reproducibility: a seeded row draws its randomness only from its own `np.random.Generator` (one uniform per
step) and every reduction runs along its own row, so its tokens do not depend on what else is in the batch.

Over 400 lines because the per-row state (`SamplingBatch`: histories, generators, what each row reports) and
the checks of the parameters it reads (`SamplingParams.validate`) are one contract; the processors themselves
are apart.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from serve.engine.logits_processors import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_token_bitmask,
    apply_top_k,
    apply_top_p,
    ban_tokens,
    draw,
    penalizes,
)
from serve.errors import InvalidRequest

MAX_SEED = 2**64 - 1
MAX_OPENAI_PENALTY = 2.0  # the range OpenAI and vLLM accept for frequency and presence penalties
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs allows
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
MAX_LOGIT_BIAS_TOKENS = 300  # entries per request

_NO_ROWS = np.empty(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class Alternatives:
    """The most likely tokens of one step under the model's raw distribution, most likely first (ties in
    any order), with their logprobs."""

    token_ids: list[int]
    logprobs: list[float]


class PromptScores(NamedTuple):
    """Of prompt tokens 2..n (the first has nothing before it): each one's logprob after those before it,
    and, if asked for, the most likely tokens at its position (serve/engine/prompt_scoring.py)."""

    logprobs: list[float]
    top: list[Alternatives]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens. The zero value of each field means "off"; temperature 0 is greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    repetition_penalty: float = 0.0
    seed: int | None = None
    min_p: float = 0.0  # keep tokens with probability >= min_p x the top token's (after temperature)
    frequency_penalty: float = 0.0  # OpenAI: subtracted from a token's logit per time it was generated
    presence_penalty: float = 0.0  # OpenAI: subtracted once from the logit of every token generated so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI: (token id, bias) added to the model's logits

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise InvalidRequest naming the field, the value and the allowed range."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise InvalidRequest(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 <= self.top_p <= 1.0:  # also false for NaN
            raise InvalidRequest(f"top_p must be in [0, 1] (0 = off), got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty >= 0.0):
            raise InvalidRequest(
                f"repetition_penalty must be 0 (off) or a finite number > 0, got {self.repetition_penalty}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_OPENAI_PENALTY <= value <= MAX_OPENAI_PENALTY):
                bound = f"{MAX_OPENAI_PENALTY:g}"
                raise InvalidRequest(f"{name} must be in [-{bound}, {bound}] (0 = off), got {value}")
        self._validate_logit_bias()
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequest(f"seed must be an integer in 0..{MAX_SEED} or unset, got {self.seed!r}")

    def _validate_logit_bias(self) -> None:
        entries = len(self.logit_bias)
        if entries > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest(
                f"logit_bias has {entries} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed"
            )
        for token, bias in self.logit_bias:
            _check_bias(token, bias)
        if len({token for token, _ in self.logit_bias}) < entries:
            raise InvalidRequest("logit_bias names a token id twice; give one bias per token")


def _check_bias(token: object, bias: object) -> None:
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise InvalidRequest(f"logit_bias token ids must be integers >= 0, got {token!r}")
    if not (isinstance(bias, int | float) and math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
        raise InvalidRequest(
            f"logit_bias[{token}] must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}"
        )


def score_tokens(logits: np.ndarray, tokens: np.ndarray, k: int) -> tuple[np.ndarray, list[Alternatives]]:
    """For each row i of [n, vocab] logits: log_softmax(logits[i])[tokens[i]] (float32 [n]) and the row's k
    most likely tokens with theirs (empty when k is 0). (The engine's own reporting, `SamplingBatch._report`,
    does the same for the rows that ask, in a reused buffer.)"""
    scores = np.asarray(logits, dtype=np.float32)
    row_max, log_sum = _log_normalizer(scores, np.empty_like(scores))
    chosen = _chosen(scores, tokens, row_max, log_sum)
    if not k:
        return chosen, []
    ids, logprobs = _top_k(scores, row_max, log_sum, k)
    return chosen, [Alternatives(i, lp) for i, lp in zip(ids.tolist(), logprobs.tolist(), strict=True)]


class _History:
    """The token ids a row has seen, prompt then each sampled token, in a buffer that doubles when full."""

    __slots__ = ("_count", "_ids", "_start", "largest")

    def __init__(self, prompt_ids: Sequence[int]) -> None:
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if ids.size and ids.min() < 0:
            raise ValueError(f"prompt token ids must be >= 0, got {int(ids.min())}")
        self._ids = np.empty(max(64, 2 * ids.size), dtype=np.int64)
        self._ids[: ids.size] = ids
        self._count = self._start = ids.size
        self.largest = int(ids.max()) if ids.size else -1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._count]

    @property
    def generated(self) -> np.ndarray:
        return self._ids[self._start : self._count]

    def add(self, token: int) -> None:
        if self._count == self._ids.size:
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self._count] = token
        self._count += 1


@dataclass(slots=True)
class _Row:
    params: SamplingParams
    rng: np.random.Generator | None  # None for greedy rows: they never draw
    history: _History  # empty unless the row has a penalty; the prompt only for a repetition penalty
    logprobs: bool  # the caller wants the chosen token's logprob
    top_logprobs: int  # and this many most likely tokens of each step
    bias: tuple[np.ndarray, np.ndarray]  # logit_bias as token ids and values
    banned: np.ndarray  # token ids it may not pick while `banned_for` > 0
    banned_for: int  # tokens still to pick without them


# One row's sampling state (its RNG, penalty history, bans left), opaque outside this module: what the engine
# keeps of a preempted sequence between `SamplingBatch.remove` and `put`.
RowState = _Row


def _penalizes_openai(params: SamplingParams) -> bool:
    return params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


@dataclass(slots=True)
class _Layout:
    """Per-row parameter vectors and row groups, rebuilt when rows join or leave (not every step)."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    penalty: np.ndarray
    frequency: np.ndarray
    presence: np.ndarray
    greedy: np.ndarray  # row indices decided by argmax
    sampled: np.ndarray  # row indices drawn at random
    repeated: np.ndarray  # row indices with a repetition penalty
    openai: np.ndarray  # row indices with a frequency or presence penalty
    penalized: np.ndarray  # row indices with either: their tokens are recorded
    banning: np.ndarray  # row indices with banned tokens this step
    biased: np.ndarray  # row indices with a logit bias
    excluding: np.ndarray  # row indices whose bias bans tokens (-100) or that have banned tokens this step
    generators: list[np.random.Generator]  # of the sampled rows, in the same order
    scored: np.ndarray  # row indices whose chosen token's logprob is wanted
    listed: np.ndarray  # row indices that want the most likely tokens too
    listed_k: np.ndarray  # how many each, in the same order
    reported: np.ndarray  # scored or listed: their log-softmax normalizer is computed once

    @property
    def plain(self) -> bool:
        """Every row is greedy on the raw logits: one argmax decides the batch (unless a row is masked)."""
        return not (self.sampled.size or self.penalized.size or self.banning.size or self.biased.size)

    @classmethod
    def of(cls, rows: Sequence[_Row]) -> _Layout:
        params = [row.params for row in rows]
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        penalty = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        openai = np.array([_penalizes_openai(p) for p in params], dtype=bool)
        scored = np.flatnonzero([row.logprobs for row in rows])
        listed = np.flatnonzero([row.top_logprobs > 0 for row in rows])
        banning = np.flatnonzero([row.banned_for > 0 and row.banned.size > 0 for row in rows])
        bias_bans = np.flatnonzero([bool(np.isneginf(row.bias[1]).any()) for row in rows])
        return cls(
            temperature=temperature,
            top_k=np.array([p.top_k for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            penalty=penalty,
            frequency=np.array([p.frequency_penalty for p in params], dtype=np.float32),
            presence=np.array([p.presence_penalty for p in params], dtype=np.float32),
            greedy=np.flatnonzero(temperature == 0.0),
            sampled=np.flatnonzero(temperature > 0.0),
            repeated=np.flatnonzero(penalizes(penalty)),
            openai=np.flatnonzero(openai),
            penalized=np.flatnonzero(penalizes(penalty) | openai),
            banning=banning,
            biased=np.flatnonzero([len(p.logit_bias) > 0 for p in params]),
            excluding=np.union1d(banning, bias_bans),
            generators=[row.rng for row in rows if row.rng is not None],
            scored=scored,
            listed=listed,
            listed_k=np.array([row.top_logprobs for row in rows if row.top_logprobs > 0], dtype=np.int64),
            reported=np.union1d(scored, listed),
        )


def _most_likely(
    block: np.ndarray, row_max: np.ndarray, log_sum: np.ndarray, layout: _Layout
) -> dict[int, Alternatives]:
    """The `layout.listed_k` largest logits of each listed row of `block`, high to low, as logprobs computed
    as the chosen token's are ((logit - row max) - log sum), so a greedy row's first alternative is its token
    with the same logprob."""
    ids, logprobs = _top_k(block, row_max, log_sum, int(layout.listed_k.max()))
    return {
        row: Alternatives(ids[j, :n].tolist(), logprobs[j, :n].tolist())
        for j, (row, n) in enumerate(zip(layout.listed.tolist(), layout.listed_k.tolist(), strict=True))
    }


def _log_normalizer(block: np.ndarray, buffer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's max [n, 1] and log-sum-exp around it [n] (log_softmax = logit - max - log sum), using
    `buffer` [n, vocab] as scratch."""
    row_max = block.max(axis=1, keepdims=True)
    np.subtract(block, row_max, out=buffer)
    np.exp(buffer, out=buffer)
    return row_max, np.log(buffer.sum(axis=1))


def _chosen(block: np.ndarray, tokens: np.ndarray, row_max: np.ndarray, log_sum: np.ndarray) -> np.ndarray:
    """The logprob of `tokens[i]` in each row, computed as `_top_k`'s are (equal for the same token)."""
    return ((np.take_along_axis(block, tokens[:, None], axis=1) - row_max)[:, 0] - log_sum).astype(np.float32)


def _top_k(
    block: np.ndarray, row_max: np.ndarray, log_sum: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Ids [n, k] of each row's k largest logits, high to low, and their logprobs, computed as a chosen
    token's are: (logit - row max) - log sum."""
    k = min(k, block.shape[1])
    ids = np.argpartition(block, block.shape[1] - k, axis=1)[:, -k:]
    values = np.take_along_axis(block, ids, axis=1)
    order = np.argsort(-values, axis=1)
    ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    return ids, ((values - row_max) - log_sum[:, None]).astype(np.float32)


class SamplingBatch:
    """Sampling state of the running sequences, in the engine's row order (swap-remove keeps them aligned)."""

    def __init__(self) -> None:
        self._rows: list[_Row] = []
        self._layout: _Layout | None = None  # rebuilt lazily: several rows often join before a step
        self._scratch = np.empty((0, 0), dtype=np.float32)
        self._alternatives: dict[int, Alternatives] = {}  # of the last `sample` call
        self._refused = _NO_ROWS  # of the last `sample` call

    def __len__(self) -> int:
        return len(self._rows)

    def append(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        logprobs: bool = False,
        banned: Sequence[int] = (),
        banned_for: int = 0,
        top_logprobs: int = 0,
    ) -> None:
        """Add a row at the end (the engine's next row). Unseeded sampling rows get a seed from OS entropy.
        `logprobs`: `sample` computes this row's logprob (a log-softmax over the vocabulary: skipped for
        rows that do not ask, which on a small model costs as much as the rest of sampling). `banned`: token
        ids its first `banned_for` tokens may not be (EOS and stop token ids under `min_new_tokens`).
        `top_logprobs`: `alternatives` lists this many most likely tokens of each step for it."""
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
        params.validate()
        rng = None if params.greedy else np.random.default_rng(params.seed)
        repeated = bool(penalizes(np.asarray(params.repetition_penalty, dtype=np.float32)))
        row = _Row(
            params=params,
            rng=rng,
            history=_History(prompt_ids if repeated else ()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            bias=(
                np.array([token for token, _ in params.logit_bias], dtype=np.int64),
                # -100 is OpenAI's ban: -inf, so no constraint or ban elsewhere can leave it the only choice
                np.array(
                    [-np.inf if bias <= -MAX_LOGIT_BIAS else bias for _, bias in params.logit_bias],
                    dtype=np.float32,
                ),
            ),
            banned=np.unique(np.asarray(banned, dtype=np.int64)),
            banned_for=banned_for,
        )
        self._rows.append(row)
        self._layout = None

    def extend(self, other: SamplingBatch) -> None:
        """Append `other`'s rows, state included (a prefill group joining the running batch)."""
        self._rows.extend(other._rows)
        self._layout = None

    def remove(self, index: int) -> RowState:
        """Drop row `index` and return its state (`put` resumes it, RNG and penalties where they were); the
        last row moves into its place, as the engine's KV rows do."""
        if not 0 <= index < len(self._rows):
            raise IndexError(f"row {index} out of range for a batch of {len(self._rows)}")
        gone = self._rows[index]
        last = self._rows.pop()
        if index < len(self._rows):
            self._rows[index] = last
        self._layout = None
        return gone

    def put(self, row: RowState) -> None:
        """Add a row that `remove` took, at the end, its state as it was (a preempted sequence resuming)."""
        self._rows.append(row)
        self._layout = None

    def sample(
        self, logits: np.ndarray, allowed: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Choose each row's next token from its logits [n, vocab]: tokens int64 [n] and their logprobs
        float32 [n] under the model's raw distribution (before any processor), NaN for rows that did not ask
        for them. Records the tokens for the repetition penalty.

        `allowed`: (rows, bitmask), the allowed tokens of the constrained rows (`apply_token_bitmask`). A row
        left without any token by its mask, bias bans and banned tokens is `refused`: its token is -1."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 2 or logits.shape[0] != len(self._rows):
            raise ValueError(
                f"logits must be [{len(self._rows)}, vocab] for this batch, got {list(logits.shape)}"
            )
        if self._layout is None:
            self._layout = _Layout.of(self._rows)
        layout = self._layout
        self._refused = _NO_ROWS
        if layout.plain and allowed is None:
            tokens = logits.argmax(axis=1)
        else:
            tokens = self._choose(logits, layout, allowed)
        logprobs = np.full(len(tokens), np.nan, dtype=np.float32)
        self._alternatives = {}
        if layout.reported.size:
            self._report(logits, tokens, layout, logprobs)
        if self._refused.size:
            logprobs[self._refused] = np.nan
        return tokens, logprobs

    @property
    def refused(self) -> np.ndarray:
        """Row indices the last `sample` call found no allowed token for (their token is -1)."""
        return self._refused

    @property
    def alternatives(self) -> dict[int, Alternatives]:
        """Of the step `sample` last chose, for the rows appended with `top_logprobs`, by row index: that many
        most likely tokens under the raw distribution. Empty when no row asks."""
        return self._alternatives

    def _choose(
        self, logits: np.ndarray, layout: _Layout, allowed: tuple[np.ndarray, np.ndarray] | None
    ) -> np.ndarray:
        work = logits
        masked = _NO_ROWS if allowed is None else allowed[0]
        if layout.penalized.size or layout.banning.size or layout.biased.size or masked.size:
            work = logits.copy()
            if allowed is not None:
                apply_token_bitmask(work, *allowed)
            apply_logit_bias(work, layout.biased, [self._rows[i].bias for i in layout.biased])
            if layout.repeated.size:
                seen = self._histories(layout.repeated, logits.shape[1])
                apply_repetition_penalty(work, layout.penalty, seen)
            if layout.openai.size:
                generated = [row.history.generated for row in self._rows]
                apply_frequency_presence(work, layout.frequency, layout.presence, generated)
            ban_tokens(work, layout.banning, [self._rows[i].banned for i in layout.banning])
            checked = np.union1d(masked, layout.excluding)
            if checked.size:
                empty = checked[np.isneginf(work[checked].max(axis=1))]
                if empty.size:
                    self._refused = empty
                    work[empty] = 0.0  # sampled as if uniform (no NaN), then thrown away
        tokens = np.empty(logits.shape[0], dtype=np.int64)
        tokens[layout.greedy] = work[layout.greedy].argmax(axis=1)
        if layout.sampled.size:
            rows = layout.sampled
            warped = work[rows]  # a copy: the chain below works in place
            apply_temperature(warped, layout.temperature[rows])
            apply_top_k(warped, layout.top_k[rows])
            apply_top_p(warped, layout.top_p[rows])
            apply_min_p(warped, layout.min_p[rows])
            uniform = np.array([rng.random() for rng in layout.generators])
            tokens[rows] = draw(warped, uniform)
        if self._refused.size:
            tokens[self._refused] = -1
        for i in layout.penalized:
            if tokens[i] >= 0:
                self._rows[i].history.add(int(tokens[i]))
        for i in layout.banning:
            row = self._rows[i]
            row.banned_for -= 1
            if row.banned_for == 0:
                self._layout = None  # it no longer needs the slow path
        return tokens

    def _histories(self, penalized: np.ndarray, vocab: int) -> list[np.ndarray]:
        """Each row's seen token ids (empty for rows without a penalty, which the processor skips)."""
        for i in penalized:
            largest = self._rows[i].history.largest
            if largest >= vocab:
                raise ValueError(f"row {i} has prompt token id {largest} outside the vocabulary of {vocab}")
        return [row.history.ids for row in self._rows]

    def _report(self, logits: np.ndarray, tokens: np.ndarray, layout: _Layout, logprobs: np.ndarray) -> None:
        """The chosen tokens' logprobs (into `logprobs`) and the alternatives, from one log-softmax normalizer
        per row, in a reused buffer (a fresh [n, vocab] one costs page faults)."""
        rows = layout.reported
        block = logits[rows]
        n, vocab = block.shape
        if self._scratch.shape[0] < n or self._scratch.shape[1] != vocab:
            self._scratch = np.empty((max(n, self._scratch.shape[0]), vocab), dtype=np.float32)
        row_max, log_sum = _log_normalizer(block, self._scratch[:n])
        if layout.scored.size:
            chosen = _chosen(block, tokens[rows], row_max, log_sum)
            logprobs[layout.scored] = chosen[np.searchsorted(rows, layout.scored)]
        if layout.listed.size:
            at = np.searchsorted(rows, layout.listed)
            self._alternatives = _most_likely(block[at], row_max[at], log_sum[at], layout)

"""Prefill: a group of prompts run right-padded into the rows after the running ones, which then join the
batch with their first tokens; or one long prompt in pieces between decode steps (chunked prefill), or a
group on a thread of its own beside them (`begin_prefill`). A prompt with a prefix the prefix cache keeps
starts from a copy of that row, and a fork (n choices of one prompt) from a copy of its parent's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from serve.engine.prefix_cache import PrefixHit
from serve.engine.sampling import PromptScores, SamplingBatch
from serve.engine.speculation import Pace
from serve.engine.state import Background, Joining, Staged
from serve.engine.step import RunInputs, Steps
from serve.engine.types import NewSequence, TokenOut


def _timed(call: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


class Prefills(Steps):
    """Prompts into rows, and their sequences into the batch."""

    def score_prompt(self, prompt_ids: Sequence[int], top: int = 0) -> PromptScores:
        """Each prompt token's logprob after the ones before it (len - 1 values) and, with `top`, the most
        likely tokens of each position; RuntimeError for an engine made without the bundle's standard
        graph."""
        if self._scorer is None:
            raise RuntimeError("this engine was made without a scoring graph: it cannot score prompts")
        return self._scorer.score(prompt_ids, top)

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int:
        """How many of this prompt's tokens a prefill now would copy from the prefix cache (0: none)."""
        slot = self._adapters.resident.get(adapter) if adapter else 0
        return 0 if slot is None else _reusable(self._hit(prompt_ids, slot))  # another's rows were forgotten

    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]:
        """Run the prompts of `new` as one right-padded group; they join the batch. Returns first tokens.

        A prompt that begins with a prefix the prefix cache keeps (`cached_tokens`) starts from a copy of
        that row instead and runs only the rest, alone (a piece over a cached prefix is one row: see below).
        A sequence that forks another of the group (`NewSequence.fork_of`: n choices of one prompt) is not
        run: it takes a copy of that one's row and first-step logits once the group has run.

        With `chunk` > 0, one sequence whose prompt (the part not cached) is longer than `chunk` is
        prefilled `chunk` tokens at a time instead: this call runs the first piece and returns nothing;
        `continue_prefill` runs the others (decode steps of the running batch may come in between) and the
        last one returns its first token.
        """
        n, k = self.batch_size, len(new)
        if not new:
            return []
        self._check_joining(new)
        self._make_resident({seq.adapter for seq in new if seq.adapter})
        forks = _forks(new)
        if forks:
            new = [seq for seq in new if seq.seq_id not in forks]
        hits = [self._hit(seq.prompt_ids, self.slot(seq.adapter)) for seq in new]
        # One sequence only: GroupQueryAttention (ONNX Runtime 1.32) refuses a piece over a cached prefix for
        # more than one row ("batch_size must be 1 when sequence_length > 1 and past context is given").
        if chunk > 0 and k == 1 and len(new[0].prompt_ids) - _reusable(hits[0]) > chunk:
            self._staged = Staged(new[0], chunk)
            try:
                self._staged.done = self._reuse(hits[0], n, new[0])
                self._prefill_piece()
            except Exception:
                self._staged = None
                raise
            return []
        misses = [seq for seq, hit in zip(new, hits, strict=True) if hit is None]
        reused = [(seq, hit) for seq, hit in zip(new, hits, strict=True) if hit is not None]
        ordered = [*misses, *(seq for seq, _ in reused)]
        # Their first masks (the forks' too, which take the rows after them), computed while the prompts run.
        joining = self._joining([*ordered, *forks.values()])
        try:
            parts = [self._prefill_group(n, misses)] if misses else []
            for row, (seq, hit) in enumerate(reused, start=n + len(misses)):
                if parts:  # every run writes the same logits buffer
                    parts[-1] = parts[-1].copy()
                parts.append(self._prefill_rows(row, seq.prompt_ids, self._reuse(hit, row, seq)))
        except BaseException:
            _settle(joining)
            raise
        self.last_logits = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if forks:
            ordered, self.last_logits = self._fork(n, ordered, list(forks.values()), self.last_logits)
        lens = np.array([len(s.prompt_ids) for s in ordered])
        return self._join(ordered, self.last_logits, lens, joining)

    def continue_prefill(self) -> list[TokenOut]:
        """The next piece of the chunked prefill; the last piece joins the sequence and returns its token."""
        staged = self._staged
        if staged is None:
            raise RuntimeError("continue_prefill() with no chunked prefill in progress")
        last = staged.piece_end() >= len(staged.seq.prompt_ids)
        joining = self._joining([staged.seq]) if last else None
        try:
            logits = self._prefill_piece()
        except BaseException:
            _settle(joining)
            raise
        if staged.done < len(staged.seq.prompt_ids):
            return []
        self._staged = None
        return self._join([staged.seq], logits, np.array([staged.done], np.int64), joining)

    def begin_prefill(self, new: Sequence[NewSequence]) -> None:
        """Start prefilling `new` into the rows after the running ones, on a thread of its own: decode steps
        of the running sequences go on meanwhile, and `end_prefill` joins `new` to the batch.

        A prefill between two decode steps stalls every running stream for its whole length; beside them,
        it shares the cores and the streams slow down instead (docs/benchmarks.md, "Latency under
        arrivals", `--prefill-beside-decode`). The two runs write
        disjoint rows of the cache, and logits of their own. Prompts with a prefix-cache hit are not taken:
        theirs is a row copy and a piece run alone (`prefill`).
        """
        self._check_joining(new)
        if not new:
            raise ValueError("begin_prefill() with no sequence")
        self._make_resident({seq.adapter for seq in new if seq.adapter})
        if any(self._hit(seq.prompt_ids, self.slot(seq.adapter)) is not None for seq in new):
            raise ValueError("a prompt with a prefix-cache hit cannot be prefilled beside decode steps")
        if _forks(new):
            raise ValueError("forked sequences (n choices of one prompt) are prefilled between decode steps")
        first = self.batch_size
        rows = slice(first, first + len(new))
        session, binding, inputs = self._bound(rows, self._group_inputs(first, new), side=True)
        if self._side is None:
            self._side = ThreadPoolExecutor(1, thread_name_prefix="textgen-prefill")
        joining = self._joining(new)
        run = self._side.submit(_timed, session.run_with_iobinding, binding)
        self._background = Background(new, first, run, inputs, joining)

    def end_prefill(self) -> tuple[list[TokenOut], float]:
        """Wait for the background prefill, join its sequences (those released meanwhile leave at once) and
        return their first tokens and the seconds its run took; raises what the run raised (they are gone)."""
        background = self._background
        if background is None:
            raise RuntimeError("end_prefill() with no background prefill")
        try:
            seconds = background.run.result()
        except BaseException:
            _settle(background.joining)
            raise
        finally:  # over either way: its rows are free again until joined
            self._background = None
        n, k = self.batch_size, len(background.new)
        lens = np.array([len(s.prompt_ids) for s in background.new], np.int64)
        if background.first != n:  # sequences that left meanwhile opened a gap below the group: close it
            for i, length in enumerate(lens.tolist()):  # row by row upwards: a source is never overwritten
                self._move_row(background.first + i, n + i, length)  # its length: set by _join
        outs = self._join(background.new, self._side_logits[:k], lens, background.joining)
        gone = background.released
        if gone:
            self.release(gone)
            outs = [out for out in outs if out.seq_id not in gone]
        return outs, seconds

    def greedy_next(self, ids: Sequence[int], start: int) -> int:
        """Append ids[start:] to row 0, whose cache holds ids[:start], and return the argmax token after
        them: a draft model's proposal step (speculation.DraftModel), in an engine that runs no sequence.
        No sampling processors, constraints or prefix cache: a proposal needs none of them."""
        if self._ids or self._staged is not None or self._background is not None:
            raise RuntimeError("greedy_next() on an engine that runs sequences")
        logits = self._prefill_rows(0, ids, start)
        return int(np.argmax(logits[0]))

    def _check_joining(self, new: Sequence[NewSequence]) -> None:
        """ValueError (RuntimeError during a chunked prefill) unless `new` can join as it is."""
        if self._staged is not None:
            raise RuntimeError(f"sequence {self._staged.seq.seq_id} is still being prefilled in chunks")
        if self._background is not None:
            raise RuntimeError(f"sequences {self.background_ids} are still being prefilled")
        n, k = self.batch_size, len(new)
        if n + k > self.max_batch_size:
            raise ValueError(f"{n} running + {k} new sequences exceed max_batch_size {self.max_batch_size}")
        known = set(self._ids)
        for seq in new:
            if not 1 <= len(seq.prompt_ids) < self.capacity:
                raise ValueError(
                    f"sequence {seq.seq_id}: prompt of {len(seq.prompt_ids)} tokens, "
                    f"must be 1..{self.capacity - 1}"
                )
            if seq.seq_id in known:
                raise ValueError(f"sequence {seq.seq_id} is already running")
            if seq.adapter and seq.adapter not in self._adapters.registered:
                raise ValueError(f"no adapter named {seq.adapter!r} is loaded")
            if seq.adapter and seq.prompt_logprobs:
                raise ValueError(
                    "prompt logprobs are scored by the base model's graph, which has no adapters: not with "
                    f"adapter {seq.adapter!r}"
                )
            known.add(seq.seq_id)

    def _prefill_group(self, first_row: int, new: Sequence[NewSequence]) -> np.ndarray:
        """Prefill whole prompts as one right-padded group in rows [first_row, first_row + len(new))."""
        return self._run(slice(first_row, first_row + len(new)), self._group_inputs(first_row, new))

    def _group_inputs(self, first_row: int, new: Sequence[NewSequence]) -> RunInputs:
        """The run inputs of a right-padded prefill group; records its prompts as the rows' tokens."""
        k = len(new)
        lens = np.array([len(s.prompt_ids) for s in new], np.int64)
        width = int(lens.max())
        ids = np.full((k, width), self.spec.pad_token_id, np.int64)
        for row, seq in enumerate(new):
            ids[row, : lens[row]] = seq.prompt_ids
        self._tokens[first_row : first_row + k, :width] = ids
        self._row_adapter[first_row : first_row + k] = [self.slot(seq.adapter) for seq in new]
        positions = np.broadcast_to(np.arange(width, dtype=np.int64), (k, width))
        return RunInputs(ids, positions, lens - 1, width, lens - 1)

    def _prefill_piece(self) -> np.ndarray:
        """Append the staged sequence's next piece (about `chunk` prompt tokens) to its row's cache; returns
        its logits."""
        assert self._staged is not None
        staged = self._staged
        end = staged.piece_end()
        logits = self._prefill_rows(self.batch_size, staged.seq.prompt_ids, staged.done, end)
        staged.done = end
        return logits

    def _prefill_rows(
        self, row: int, prompt_ids: Sequence[int], start: int, end: int | None = None
    ) -> np.ndarray:
        """Append prompt tokens [start, end) to one row whose cache holds the first `start`; its logits."""
        end = len(prompt_ids) if end is None else end
        piece = np.asarray(prompt_ids[start:end], np.int64)
        self._tokens[row, start:end] = piece
        positions = np.arange(start, end, dtype=np.int64)[None]
        seqlens = np.array([end - 1], np.int64)
        inputs = RunInputs(piece[None], positions, seqlens, end, np.array([end - start - 1]))
        return self._run(slice(row, row + 1), inputs)

    def _joining(self, new: Sequence[NewSequence]) -> Joining:
        """Fresh matchers for sequences about to join, and their first masks started on the masks' thread."""
        rows = self._constraints.group([seq.constraint for seq in new])
        return Joining(rows, rows.start_fill())

    def _join(
        self,
        new: Sequence[NewSequence],
        logits: np.ndarray,
        lens: np.ndarray,
        joining: Joining | None = None,
    ) -> list[TokenOut]:
        """The prefilled rows after the running ones join the batch with their first sampled tokens."""
        n = self.batch_size
        group = SamplingBatch()
        for seq in new:
            group.append(
                seq.sampling, seq.prompt_ids, seq.logprobs, seq.banned, seq.banned_for, seq.top_logprobs
            )
        rows, pending = self._joining(new) if joining is None else joining
        tokens, logprobs, notes = self._pick(group, rows, logits, pending)
        self._sampling.extend(group)
        self._constraints.extend(rows)
        self._speculating.extend(Pace(self._speculative_limit(seq)) for seq in new)
        self._ids.extend(s.seq_id for s in new)
        self._lengths[n : n + len(new)] = lens
        self._prefilled[n : n + len(new)] = lens
        outs = self._emit(n, tokens, logprobs, group.alternatives, notes)
        scored: dict[tuple[tuple[int, ...], int], PromptScores] = {}  # n choices of a prompt: scored once
        for i, seq in enumerate(new):
            if seq.prompt_logprobs:
                key = (tuple(seq.prompt_ids), seq.prompt_top_logprobs)
                if key not in scored:
                    scored[key] = self.score_prompt(seq.prompt_ids, seq.prompt_top_logprobs)
                outs[i] = outs[i]._replace(prompt=scored[key])
        return outs

    def _speculative_limit(self, seq: NewSequence) -> int:
        """The most tokens proposed for `seq` per step. A constrained sequence proposes none:
        each position's mask would depend on the tokens accepted before it."""
        if seq.constraint is not None:
            return 0
        limit = self.speculation.num_tokens
        return limit if seq.speculative_tokens is None else min(seq.speculative_tokens, limit)


def _settle(joining: Joining | None) -> None:
    """A join that failed: let its first masks' fill end (its thread holds the matchers until then)."""
    if joining is not None and joining.first_masks is not None:
        joining.first_masks.settle()


def _forks(new: Sequence[NewSequence]) -> dict[str, NewSequence]:
    """The sequences of a group that fork another of it (`NewSequence.fork_of`): same prompt, a parent that
    is no fork itself; by id, in the group's order."""
    by_id = {seq.seq_id: seq for seq in new}
    forks = {}
    for seq in new:
        parent = by_id.get(seq.fork_of) if seq.fork_of is not None else None
        if parent is not None and parent.fork_of is None and list(parent.prompt_ids) == list(seq.prompt_ids):
            forks[seq.seq_id] = seq
    return forks


def _reusable(hit: PrefixHit | None) -> int:
    return 0 if hit is None else hit.tokens

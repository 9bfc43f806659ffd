"""The KV rows' moves: a fork takes a copy of its parent's row; a leaving sequence's row is filled by the
last one (swap-remove), after the prefix cache may keep a copy; a preempted sequence's row goes to host
memory and comes back after the running ones; a prompt starts from a copy of a kept or running row that
shares its prefix.

Rows [0, n) hold the running sequences, right-padded: row r's valid cache entries are [0, lengths[r]). The
rows past max_batch_size are the prefix cache's (serve/engine/prefix_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from serve.engine.adapters import Adapters
from serve.engine.prefix_cache import PrefixHit
from serve.engine.sampling import RowState
from serve.engine.speculation import Pace
from serve.engine.state import Swapped
from serve.engine.types import MIN_PIECE, NewSequence

if TYPE_CHECKING:
    from llguidance import LLMatcher


class KvRows(Adapters):
    """Moves of rows and of the state that goes with them (sampling, constraint, pace, adapter)."""

    def _fork(
        self, n: int, ordered: list[NewSequence], forks: list[NewSequence], logits: np.ndarray
    ) -> tuple[list[NewSequence], np.ndarray]:
        """Rows [n, n + len(ordered)) are prefilled; each fork takes the next row, a copy of its parent's
        (the prompt's keys and values and tokens), and a copy of its parent's logits for its first token."""
        parent_row = {seq.seq_id: i for i, seq in enumerate(ordered)}
        sources = []
        for j, fork in enumerate(forks):
            assert fork.fork_of is not None
            source = parent_row[fork.fork_of]
            length = len(fork.prompt_ids)
            self._kv.copy_row(n + source, n + len(ordered) + j, length)
            self._tokens[n + len(ordered) + j, :length] = self._tokens[n + source, :length]
            self._row_adapter[n + len(ordered) + j] = self._row_adapter[n + source]
            sources.append(source)
        return [*ordered, *forks], np.concatenate([logits, logits[sources]])

    def release(self, seq_ids: Iterable[str]) -> None:
        """The sequences leave the batch; each is replaced by the current last row. The prefix cache may
        keep a copy of the leaving row first."""
        for seq_id in seq_ids:
            if seq_id == self.staged_id:
                self._staged = None  # its row is simply free again
                continue
            if seq_id in self.background_ids:
                assert self._background is not None
                self._background.released.add(seq_id)  # its run is writing its row: it leaves once joined
                continue
            if self._swapped.pop(seq_id, None) is not None:  # preempted: its host copy is all there is
                continue
            try:
                row = self._ids.index(seq_id)
            except ValueError:
                continue  # already gone: release is idempotent
            self._keep(row)
            self._remove_row(row)  # its matcher goes with it

    def swap_out(self, seq_ids: Iterable[str]) -> None:
        """Preempt running sequences: each one's row (its valid keys and values, token ids, pending token)
        and its sampling, constraint and speculation state move to host memory, and its row is freed (the
        last row takes its place). `swap_in` resumes it exactly where it stopped: the tokens it then gives
        are those it would have given without the pause (vLLM's swapping; recomputing the keys and values by
        a prefill would sum attention in another order than the decode steps did, and drift)."""
        if self._staged is not None or self._background is not None:
            raise RuntimeError("cannot preempt while a prefill is in progress: it holds the rows after them")
        for seq_id in seq_ids:
            row = self._row_of(seq_id)
            length = int(self._lengths[row])
            kv = self._kv.read_row(row, length)
            tokens, pending = self._tokens[row, :length].copy(), int(self._pending[row])
            adapter, prefilled = self._adapter_in(int(self._row_adapter[row])), int(self._prefilled[row])
            sampling, matcher, pace = self._remove_row(row)
            self._swapped[seq_id] = Swapped(kv, tokens, pending, sampling, matcher, pace, adapter, prefilled)

    def swap_in(self, seq_ids: Sequence[str]) -> None:
        """Resume preempted sequences (`swap_out`) in the rows after the running ones; the next decode step
        feeds each its pending token. Sequences not preempted are refused (ValueError) before any moves."""
        if self._staged is not None or self._background is not None:
            raise RuntimeError("cannot resume while a prefill is in progress: it holds the rows after them")
        missing = [seq_id for seq_id in seq_ids if seq_id not in self._swapped]
        if missing:
            raise ValueError(f"sequences {missing} are not preempted")
        n, k = self.batch_size, len(seq_ids)
        if n + k > self.max_batch_size:
            raise ValueError(f"{n} running + {k} resumed exceed max_batch_size {self.max_batch_size}")
        self._make_resident({self._swapped[seq_id].adapter for seq_id in seq_ids} - {""})
        for seq_id in seq_ids:
            kept = self._swapped.pop(seq_id)
            row, length = self.batch_size, len(kept.tokens)
            self._row_adapter[row] = self.slot(kept.adapter)
            self._kv.write_row(row, kept.kv)
            self._tokens[row, :length] = kept.tokens
            self._lengths[row], self._pending[row] = length, kept.pending
            self._prefilled[row] = kept.prefilled
            self._sampling.put(kept.sampling)
            self._constraints.append(kept.matcher)
            self._speculating.append(kept.pace)
            self._ids.append(seq_id)

    @property
    def swapped_bytes(self) -> int:
        """Host memory holding the preempted sequences' keys and values."""
        return sum(kept.nbytes for kept in self._swapped.values())

    def swap_bytes(self, seq_id: str) -> int:
        """What `swapped_bytes` grows by if the running sequence `seq_id` is swapped out now: its row's valid
        keys and values and its token ids (the scheduler keeps the preempted ones within --swap-space)."""
        length = int(self._lengths[self._row_of(seq_id)])
        return length * (self._kv.position_bytes + self._tokens.itemsize)

    def _row_of(self, seq_id: str) -> int:
        try:
            return self._ids.index(seq_id)
        except ValueError:
            raise ValueError(f"sequence {seq_id} is not running") from None

    def _remove_row(self, row: int) -> tuple[RowState, LLMatcher | None, Pace]:
        """Take a running row out (the last row moves into its place, the staged one follows it down);
        returns its sampling state, matcher and pace."""
        last = len(self._ids) - 1
        if row != last:
            self._move_row(last, row, int(self._lengths[last]))
            self._pending[row] = self._pending[last]
            self._ids[row] = self._ids[last]
        self._ids.pop()
        sampling = self._sampling.remove(row)
        pace = self._speculating[row]
        moved = self._speculating.pop()
        if row < len(self._speculating):
            self._speculating[row] = moved
        matcher = self._constraints.remove(row)
        if self._staged is not None:  # keep the staged row right after the running ones
            self._move_row(last + 1, last, self._staged.done)
        return sampling, matcher, pace

    def _keep(self, row: int) -> None:
        """Offer a leaving row to the prefix cache, unless a failed step may have left it half written."""
        seq_id = self._ids[row]
        if seq_id in self._untrusted:
            self._untrusted.discard(seq_id)
            return
        length = int(self._prefilled[row])  # its prompt: the generated positions are not reused
        target = self._prefix.store(self._tokens[row, :length], int(self._row_adapter[row]))
        if target is not None:
            try:
                self._kv.copy_row(row, target, length)
                self._row_adapter[target] = self._row_adapter[row]
            except Exception:  # the row now holds neither its old tokens nor the new ones
                self._prefix.clear()
                raise

    def _move_row(self, src: int, dst: int, length: int) -> None:
        self._kv.copy_row(src, dst, length)
        self._lengths[dst] = self._lengths[src]
        self._prefilled[dst] = self._prefilled[src]
        self._row_adapter[dst] = self._row_adapter[src]
        self._tokens[dst, :length] = self._tokens[src, :length]

    def _hit(self, prompt_ids: Sequence[int], adapter: int) -> PrefixHit | None:
        """The row (kept, or running) to copy a prompt's prefix from, and the tokens it gives; None: none.

        Admission asks this for every waiting prompt it considers, so the running rows are screened in one
        vectorized test first: a row can give `min_tokens` only if its first `min_tokens` tokens are the
        prompt's (one numpy test over all rows instead of a Python loop over them)."""
        head = self._prefix.min_tokens
        if not self._prefix.rows or len(prompt_ids) < head + MIN_PIECE:  # its last tokens are never reused
            return None
        n = self.batch_size
        same = (self._tokens[:n, :head] == np.asarray(prompt_ids[:head])).all(axis=1)
        mine = self._row_adapter[:n] == adapter  # another adapter's keys and values are not this prompt's
        rows = np.flatnonzero(same & mine & (self._prefilled[:n] >= head)).tolist()
        running = [(r, self._tokens[r, : self._prefilled[r]]) for r in rows]
        return self._prefix.match(prompt_ids, running, adapter)

    def _reuse(self, hit: PrefixHit | None, row: int, seq: NewSequence) -> int:
        """Copy a hit's row (kept or running) into `row`; returns the prompt tokens it gave (0: no hit)."""
        self._row_adapter[row] = self.slot(seq.adapter)
        if hit is None:
            return 0
        source, reused = hit
        self._kv.copy_row(source, row, reused)
        self._prefix.use(source)
        self._tokens[row, :reused] = seq.prompt_ids[:reused]
        return reused

"""The step: one run of the serving graph over a range of rows, and what becomes of its logits (sampled
under the constrained rows' masks, each row's TokenOut); the decode step, and speculation's step, which
scores a row's pending token and a proposal (serve/engine/speculation.py) in one run of the verification
graph (serve/engine/verify_graph.py).

A run's rows are bound as both the past input and the present output of the graph, so each step appends its
keys and values in place. Small inputs are bound from host arrays and logits are written into a host array
(ONNX Runtime copies them from the device): sampling is numpy.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from serve.engine.constraints import ConstraintRows, PendingMasks
from serve.engine.rows import KvRows
from serve.engine.runtime import ortvalue
from serve.engine.sampling import Alternatives, SamplingBatch
from serve.engine.types import ConstraintState, TokenOut
from serve.engine.verify_graph import PICK_INDEX, chained_present_outputs

# What a refused row's TokenOut says (SamplingBatch.refused).
NO_ALLOWED_TOKEN = (
    "no token is allowed at this step: its constraint, its logit_bias (-100 bans a token) and min_new_tokens "
    "(EOS and the stop token ids are banned until then) leave nothing to sample"
)
# Per row of a step: a constrained row's state after its token, and why the row cannot go on (or None).
_Notes = dict[int, tuple[ConstraintState | None, str | None]]


class RunInputs(NamedTuple):
    input_ids: np.ndarray  # [rows, tokens]
    position_ids: np.ndarray  # [rows, tokens]
    seqlens_k: np.ndarray  # [rows]: each row's tokens after the run, minus one
    total: int  # the longest row's tokens after the run
    last_index: np.ndarray  # [rows]: the position in the run whose logits each row returns


class Steps(KvRows):
    """Runs over rows, and the decode step."""

    def decode(self) -> list[TokenOut]:
        """One step for every running sequence: feed each its pending token, sample the next."""
        n = self.batch_size
        if n == 0:
            raise RuntimeError("decode() with no running sequence")
        lengths = self._lengths[:n]
        if int(lengths.max()) >= self.capacity:
            full = [s for s, length in zip(self._ids, lengths, strict=True) if length >= self.capacity]
            raise ValueError(
                f"sequences {full} filled their {self.capacity}-token KV slot; release them first"
            )
        if n == 1 and self._speculating[0].limit:
            proposal = self._proposal()
            if proposal.size:
                return self._speculate(proposal)
        # The constrained rows' masks are computed on the masks' thread while ONNX Runtime runs the step.
        pending = self._constraints.start_fill()
        try:
            logits = self._run(
                slice(0, n),
                RunInputs(
                    self._pending[:n, None],
                    lengths[:, None],
                    lengths,  # after this step each row holds lengths + 1 tokens; seqlens_k is that minus one
                    int(lengths.max()) + 1,
                    np.zeros(n, np.int64),
                ),
            )
        except BaseException:
            if pending is not None:
                pending.settle()
            raise
        self._tokens[self._row_index[:n], lengths] = self._pending[:n]
        self._lengths[:n] += 1
        tokens, logprobs, notes = self._pick(self._sampling, self._constraints, logits, pending)
        return self._emit(0, tokens, logprobs, self._sampling.alternatives, notes)

    def _proposal(self) -> np.ndarray:
        """The tokens proposed after the one running row's pending token (empty: none), no more than its
        slot has room for: the run writes the keys and values of every proposed position."""
        pace = self._speculating[0]
        length = int(self._lengths[0])
        room = min(pace.tokens, self.capacity - length - 1)
        if room <= 0 or not pace.ready():
            return self._pending[:0]
        context = np.append(self._tokens[0, :length], self._pending[0])
        return self.proposer.propose(context, room)

    def _speculate(self, proposal: np.ndarray) -> list[TokenOut]:
        """One run over the row's pending token and the proposal; then each position's token is sampled as a
        decode step would sample it, in order, while the proposal agrees: the tokens sampled (the agreeing
        proposed ones, then the first that differs or the one after the last), each a TokenOut.

        The keys and values of the rejected positions stay in the slot past the row's length, where the next
        run overwrites them (a row's cache is valid up to its length only)."""
        length, k = int(self._lengths[0]), len(proposal)
        ids = np.concatenate([self._pending[:1], proposal])
        logits = self._verify(length, ids)
        self._tokens[0, length : length + k + 1] = ids
        outs: list[TokenOut] = []
        for j in range(k + 1):
            tokens, logprobs, notes = self._pick(self._sampling, self._constraints, logits[j : j + 1], None)
            outs.extend(self._emit(0, tokens, logprobs, self._sampling.alternatives, notes))
            if notes or j == k or int(tokens[0]) != int(proposal[j]):
                break
        accepted = len(outs) - 1
        self._lengths[0] = length + 1 + accepted
        self._speculating[0].record(k, accepted)
        outs[0] = outs[0]._replace(proposed=k, accepted=accepted)
        return outs

    def _verify(self, length: int, ids: np.ndarray) -> np.ndarray:
        """The logits of each of `ids` appended to row 0's `length` tokens, by the verification graph."""
        assert self._verifier is not None
        binding = self._verify_bindings.get(len(ids))
        if binding is None:
            binding = self._verify_bindings[len(ids)] = self._verifier.io_binding()
            binding.bind_ortvalue_output("logits", ortvalue(self._logits[: len(ids)]))
            self._kv.bind(binding, slice(0, 1), chained_present_outputs(self._positions))
        steps = np.arange(length, length + len(ids), dtype=np.int64)
        span = self._lora_span(slice(0, 1))
        inputs = {
            "input_ids": ids[None],
            "position_ids": steps[None],
            "seqlens_k": steps[-1:].astype(np.int32),
            "total_sequence_length": np.array(steps[-1] + 1, np.int32),
            PICK_INDEX: np.arange(len(ids), dtype=np.int64),
            **self._lora_routes(slice(0, 1), len(ids), span),
        }
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        self._bind_adapters(binding, span)
        try:
            self._verifier.run_with_iobinding(binding)
        except Exception:  # as _run: the row may be half written
            self._untrusted.update(self._ids[:1])
            raise
        self.last_logits = self._logits[: len(ids)]
        return self.last_logits

    def _pick(
        self,
        sampling: SamplingBatch,
        constraints: ConstraintRows,
        logits: np.ndarray,
        pending: PendingMasks | None,
    ) -> tuple[np.ndarray, np.ndarray, _Notes]:
        """Sample rows (under their masks, once `pending` is filled) and advance their matchers: tokens,
        logprobs, and the constrained or failed rows' notes."""
        masks, failed = (None, {}) if pending is None else pending.wait()
        tokens, logprobs = sampling.sample(logits, masks)
        refused = sampling.refused.tolist()
        notes: _Notes = dict(constraints.consume(tokens, [*refused, *failed]))
        for row in refused:
            notes[row] = (None, NO_ALLOWED_TOKEN)
            tokens[row] = self.spec.pad_token_id  # a valid id in its KV input until it is released
        for row, reason in failed.items():
            notes[row] = (None, f"its constraint failed: {reason}")
        return tokens, logprobs, notes

    def _run(self, rows: slice, inputs: RunInputs) -> np.ndarray:
        session, binding, _arrays = self._bound(rows, inputs)
        logits = self._logits[: rows.stop - rows.start]
        try:
            session.run_with_iobinding(binding)
        except Exception:  # it may have written part of any row it was given: do not keep those
            self._untrusted.update(self._ids[rows])
            raise
        self.last_logits = logits
        return logits

    def _bound(
        self, rows: slice, run: RunInputs, side: bool = False
    ) -> tuple[Any, Any, dict[str, np.ndarray]]:
        """The session that runs a row range (the branch-free one when no row has an adapter and there is
        one), its binding with these inputs bound, and the arrays to keep alive until it has run."""
        span = self._lora_span(rows)
        branch_free = span == (0, 0) and self._branch_free is not None
        inputs: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(run.input_ids, np.int64),
            "position_ids": np.ascontiguousarray(run.position_ids, np.int64),
            "seqlens_k": run.seqlens_k.astype(np.int32),
            "total_sequence_length": np.array(run.total, np.int32),
            "last_index": np.ascontiguousarray(run.last_index, np.int64),
            **({} if branch_free else self._lora_routes(rows, run.input_ids.shape[1], span)),
        }
        session = self._branch_free if branch_free else self.session
        binding = self._binding(rows, side, session)
        for name, array in inputs.items():
            binding.bind_cpu_input(name, array)
        if not branch_free:
            self._bind_adapters(binding, span)
        return session, binding, inputs

    def _binding(self, rows: slice, side: bool, session: Any) -> Any:
        """The IOBinding of a row range on the serving session (or the branch-free one), with its KV rows and
        logits bound once and reused; `side`: a prefill beside a decode step, which writes its own logits.
        Both sessions bind the same KV buffers: a row's cache is one whichever runs its step."""
        key = (rows.start, rows.stop, side, session is not self.session)
        binding = self._bindings.get(key)
        if binding is None:
            binding = session.io_binding()
            logits = self._side_logits if side else self._logits
            binding.bind_ortvalue_output("logits", ortvalue(logits[: rows.stop - rows.start]))
            self._kv.bind(binding, rows)
            self._bindings[key] = binding
        return binding

    def _emit(
        self,
        first_row: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        top: dict[int, Alternatives],
        notes: _Notes,
    ) -> list[TokenOut]:
        """`top` and `notes` are keyed by row index within `tokens`."""
        self._pending[first_row : first_row + len(tokens)] = tokens
        ids = self._ids[first_row:]
        # Python scalars in one call each (.tolist()), not a numpy scalar conversion per row.
        rows = zip(ids, tokens.tolist(), logprobs.tolist(), strict=True)
        if not top:
            outs = [TokenOut(seq_id, t, lp) for seq_id, t, lp in rows]
        else:
            outs = [TokenOut(seq_id, t, lp, top.get(i)) for i, (seq_id, t, lp) in enumerate(rows)]
        for i, (state, error) in notes.items():
            outs[i] = outs[i]._replace(constraint=state, error=error)
        return outs

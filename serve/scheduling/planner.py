"""`Planner`: what the next engine step does, decided without calling the engine.

The planning half of a runner step, as vLLM v1's `Scheduler.schedule()` or ONNX Runtime GenAI's PlanStep: it
reads the runner's state (`RunnerState`) and what the engine reports (`EngineView`: prefix-cache hits, the
prefill in progress) and returns a frozen `StepPlan`. `BatchRunner` (runner.py) then makes the plan's engine
call and takes its tokens (`update_from_output`, CommitStep). Nothing here calls the engine, so the admission
policy is tested against a stand-in for the view alone.

Admission policy, evaluated between every two engine steps:
- FCFS: the oldest waiting request heads the next prefill group; when it does not fit, nobody overtakes it,
  so the running batch drains until it does (a long prompt cannot be starved by a stream of short ones).
  Under the priority policy (`scheduling_policy`) the queue is read by (priority, arrival) instead: the
  lowest priority value heads it, the oldest among equals, and the same head-of-line rule holds.
- Padding-aware grouping: younger requests join the head's group while the group's padding
  (rows x longest prompt vs. the sum of lengths) stays within `max_padding_ratio` and the group's padded
  size within `max_prefill_tokens` (large arrivals are split over several steps; a single prompt larger
  than the budget is prefilled alone).
- Chunked prefill (`prefill_chunk_tokens`): while others decode, a prefill step computes at most that many
  prompt tokens. Arrivals that fit go together and the rest wait for the next prefill step (which follows
  a decode step); a prompt longer than that is prefilled alone, that many tokens a step, with decode
  steps in between (the engine continues one sequence at a time).
- Prefill beside the decode steps (`prefill_beside_decode`, off by default): while others decode, a group
  with no prefix-cache hit and nothing to chunk is prefilled on the engine's own thread for it
  (`Engine.begin_prefill`) and every step decodes the running rows meanwhile; the first step after its run
  is over joins it (`end_prefill`) and may begin the next group. One such group at a time.
- KV budget: every request reserves prompt + max_new_tokens; the batch's padded footprint
  rows x largest reservation must stay within `max_batch_tokens`. Decode pads every row to the longest
  context, so this bounds every step; a long request gives its share back as soon as it leaves.
- LoRA slots: the running requests and a group never use more distinct adapters than the engine has slots
  (the engine writes an adapter into a slot as its first request is prefilled, evicting the least recently
  used idle one). A request whose adapter finds no slot waits without holding back those behind it; while
  one waits, no request of the adapter with the fewest running requests is admitted, so that adapter's
  slot frees once they finish, and adapters new to the batch are not admitted either.
- Running streams are never stalled by two prefills in a row, and a partial group waits up to
  `max_wait_seconds` for company while others are decoding (no wait when the engine is idle).
- Preemption (priority policy only): when every row is busy and waiting requests rank strictly above the
  lowest-ranked decoding ones, those are preempted (the highest priority value first, the latest arrival
  among equals), one for each such waiting request that the plan then admits or resumes in the freed rows:
  a row is never freed for another request (one of equal priority, while the urgent one waits for a LoRA
  slot or the KV budget). The runner swaps their rows out to host memory (`Engine.swap_out`) and they rejoin
  the queue with their arrival, so they come first among their priority. Their host copies stay within
  `swap_space` bytes (`Engine.swap_bytes`: a row's valid keys and values and its token ids): a preemption
  that would pass it is not made, and its urgent request waits for a row to free. A preempted request at the
  head of the queue resumes (`Engine.swap_in`, no compute) into a free row and decodes in the same step, once
  its adapter has a slot as admission counts them (else it waits, and those behind it go on as above).
  Equal priorities never preempt each other, and the fcfs policy never preempts. No preemption while a
  prefill is in progress (chunked or beside the decode steps): it holds the rows a resumed request would
  take.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from serve.engine.types import next_piece
from serve.scheduling.engine_protocol import EngineView, StepKind
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import RequestState, RequestTracker


class StepShape(NamedTuple):
    """A step record's sizes: its rows, the token slots computed (padding included), the tokens among them."""

    rows: int
    padded_tokens: int
    real_tokens: int


NO_STEP = StepShape(0, 0, 0)


@dataclass(frozen=True)
class StepPlan:
    """One step's decision. `group`: the rows prefilled (PREFILL and BEGIN_BACKGROUND: admitted now, with
    `cached` prompt tokens each from the prefix cache; CONTINUE_PREFILL: the staged one; END_BACKGROUND: those
    still running of the group joined); `decoded`: the rows decoded (DECODE, BEGIN_BACKGROUND)."""

    kind: StepKind
    group: tuple[RequestTracker, ...] = ()
    cached: tuple[int, ...] = ()
    chunk: int = 0  # PREFILL: the engine prefills a lone longer prompt this many tokens a step (0: whole)
    prefill_sizes: StepShape = NO_STEP  # its prefill's record (BEGIN_BACKGROUND: written by END_BACKGROUND)
    decoded: tuple[RequestTracker, ...] = ()
    decode_sizes: StepShape = NO_STEP
    preempted: tuple[RequestTracker, ...] = ()  # running ones swapped out before the step, back to the queue
    resumed: tuple[RequestTracker, ...] = ()  # preempted ones swapped back in before the step (they decode)

    @property
    def admitted(self) -> tuple[RequestTracker, ...]:
        """The waiting requests this plan moves into the running set."""
        return self.group if self.kind in (StepKind.PREFILL, StepKind.BEGIN_BACKGROUND) else ()


IDLE = StepPlan(StepKind.IDLE)


@dataclass(frozen=True)
class RunnerState:
    """What the planner reads of the runner, taken after the step's sweep of cancelled and expired ones."""

    running: tuple[RequestTracker, ...]  # admitted and not ended, in admission order
    last_phase: StepKind | None  # of the latest prefill or decode call: PREFILL | DECODE | None (none yet)
    now: float  # time.monotonic() at the step's start
    waiting: tuple[RequestTracker, ...] = ()  # in the order they joined the queue
    background: StepShape = NO_STEP  # the record of the group prefilling beside the decode steps


class Planner:
    """The admission policy (module docstring) over a runner's state and its engine's reports."""

    def __init__(self, limits: SchedulerLimits, engine: EngineView) -> None:
        self.limits = limits
        self.engine = engine

    def join(self, state: RunnerState) -> StepPlan | None:
        """The plan that joins the group prefilled beside the decode steps, first in a step, once its run is
        over or when nothing else decodes (the join then waits for it); None: nothing to join now. Apart from
        `plan` because a step may do both: the joined rows decode, and the next group may begin, at once."""
        ids = self.engine.background_ids
        if not ids or not (self.engine.background_done or not self._decoding(state)):
            return None
        running = {t.request_id: t for t in state.running}
        group = tuple(running[i] for i in ids if i in running)  # the cancelled ones left already
        return StepPlan(StepKind.END_BACKGROUND, group, prefill_sizes=state.background)

    def plan(self, state: RunnerState) -> StepPlan:
        """This step's plan, after any join (`join`); never END_BACKGROUND."""
        decoding = self._decoding(state)
        staged = self._staged(state)
        if staged is not None:
            if decoding and state.last_phase is StepKind.PREFILL:
                return self._decode(state)  # the decoders are not stalled by two prefill pieces in a row
            return self._continue(staged)
        planned = None if self.engine.background_ids else self._admission(state)
        if planned is not None:
            return planned
        return self._decode(state) if decoding else IDLE

    # -- preemption -----------------------------------------------------------------------------------------
    def _admission(self, state: RunnerState) -> StepPlan | None:
        """The plan that admits or resumes the head of the queue, preempting for it where the policy says."""
        pairs = self._preemptions(state)
        asking = {urgent.request_id for urgent, _ in pairs}
        victims = tuple(victim for _, victim in pairs)
        while victims:
            planned = self._admit_or_resume(_without(state, victims))
            taken = {t.request_id for t in planned.admitted + planned.resumed} if planned else set()
            # Rows are freed only for the requests that asked for them: the plan may give one to another
            # (the next in line, maybe of the victims' own priority, while one that asked waits for a LoRA
            # slot or the KV budget) or take fewer. Then as many victims as rows went to those that asked,
            # the lowest-ranked: the pairs are in order, so each one that asked outranks every one of them.
            asked = len(taken & asking)
            if planned is not None and asked == len(victims):
                return replace(planned, preempted=victims)
            victims = victims[:asked]
        return self._admit_or_resume(state)

    def _preemptions(self, state: RunnerState) -> list[tuple[RequestTracker, RequestTracker]]:
        """(waiting request, decoding one to preempt for it) pairs: the waiting ones in admission order, each
        paired with the lowest-ranked decoding one left if it ranks strictly above it, as long as their host
        copies fit `swap_space`; none unless every row is busy."""
        if (
            self.limits.scheduling_policy != "priority"
            or len(state.running) < self.limits.batch_size
            or not state.waiting
            or state.last_phase is StepKind.PREFILL  # no admission this step: nothing to preempt for
        ):
            return []
        decoding = (t for t in state.running if t.state is RequestState.DECODING)
        lowest_first = sorted(decoding, key=_priority_then_arrival, reverse=True)
        room = self.limits.swap_space - self.engine.swapped_bytes
        pairs: list[tuple[RequestTracker, RequestTracker]] = []
        for urgent, victim in zip(self._admission_order(state.waiting), lowest_first, strict=False):
            if urgent.request.priority >= victim.request.priority:
                break
            room -= self.engine.swap_bytes(victim.request_id)
            if room < 0:  # past the cap: the urgent ones wait for rows to free instead
                break
            pairs.append((urgent, victim))
        return pairs

    def _admit_or_resume(self, state: RunnerState) -> StepPlan | None:
        """Resume the preempted requests at the head of the queue, else admit the next prefill group; None:
        neither now."""
        resumed = self._resumable(state)
        if resumed:
            running = (*state.running, *resumed)
            return replace(self._decode(replace(state, running=running)), resumed=resumed)
        group = self._select(state)
        if group is None:
            return None
        if self._beside(group, self._decoding(state)):
            return self._begin(state, group)
        return self._prefill(state, group)

    def _resumable(self, state: RunnerState) -> tuple[RequestTracker, ...]:
        """The preempted requests at the head of the queue that the free rows, the LoRA slots and the KV
        budget take."""
        free_rows = self.limits.batch_size - len(state.running)
        running = _Group.of(state.running)
        resumed = _Group()
        for tracker in self._admitted_adapters(state.running, self._admission_order(state.waiting)):
            if not tracker.preempted or len(resumed.members) == free_rows:
                break
            more = resumed.plus(tracker, 0)
            if not self._fits_kv(running, more):
                break
            resumed = more
        return resumed.members

    # -- which rows are where -----------------------------------------------------------------------------
    def _staged(self, state: RunnerState) -> RequestTracker | None:
        """The request the engine is prefilling in chunks: it holds a row but does not decode yet."""
        staged = self.engine.staged_id
        return next((t for t in state.running if t.request_id == staged), None)

    def _decoding(self, state: RunnerState) -> bool:
        """Some running request is past its prefill."""
        prefilling = (self._staged(state) is not None) + len(self.engine.background_ids)
        return len(state.running) > prefilling

    # -- admission ------------------------------------------------------------------------------------------
    def _select(self, state: RunnerState) -> _Group | None:
        """The next prefill group (None: decode instead)."""
        free_rows = self.limits.batch_size - len(state.running)
        if not state.waiting or free_rows <= 0 or (state.running and state.last_phase is StepKind.PREFILL):
            return None
        waiting = self._admitted_adapters(state.running, self._admission_order(state.waiting))
        if not waiting:
            return None
        if waiting[0].preempted:
            return None  # it resumes once it fits; nobody overtakes it meanwhile
        running = _Group.of(state.running)
        group = self._group_plus(_Group(), waiting[0])
        if not self._fits_kv(running, group):
            return None  # FCFS: nobody overtakes the head; running requests leave until it fits
        left_out = False
        for candidate in itertools.islice(waiting, 1, None):
            if len(group.members) == free_rows or candidate.preempted:  # it resumes, before those after it
                break
            bigger = self._group_plus(group, candidate)
            if self._acceptable(running, bigger):
                group = bigger
            else:
                left_out = True
        partial = len(group.members) < free_rows and not left_out
        waited = state.now - group.members[0].times.arrival
        if state.running and partial and waited < self.limits.max_wait_seconds:
            return None  # let more arrivals share this prefill instead of stalling the decoders again soon
        return group

    def _admission_order(self, waiting: tuple[RequestTracker, ...]) -> Sequence[RequestTracker]:
        """The queue in the order the policy admits it. Sorted each step rather than kept sorted: the sort is
        stable, so equal keys keep the order they joined in, and a request put back with its old arrival
        takes its old place."""
        if self.limits.scheduling_policy == "fcfs":
            return waiting
        return sorted(waiting, key=_priority_then_arrival)

    def _admitted_adapters(
        self, running: Sequence[RequestTracker], waiting: Sequence[RequestTracker]
    ) -> list[RequestTracker]:
        """The waiting requests whose adapters can have a slot, in order (module docstring, LoRA slots): the
        adapters of the ones kept and of the running requests stay within the engine's slots."""
        if not self.engine.lora_slots:  # no adapters served: nothing to keep within slots
            return list(waiting)
        held = Counter(t.request.adapter for t in running if t.request.adapter)
        draining = min(held, key=lambda a: held[a]) if held else None  # its slot frees soonest
        chosen, kept, blocked = set(held), [], False
        for tracker in waiting:
            adapter = tracker.request.adapter
            if blocked:  # behind a request waiting for a slot: nothing that keeps it waiting longer
                if not adapter or (adapter in chosen and adapter != draining):
                    kept.append(tracker)
            elif not adapter or adapter in chosen or len(chosen) < self.engine.lora_slots:
                if adapter:
                    chosen.add(adapter)
                kept.append(tracker)
            else:
                blocked = True
        return kept

    def _group_plus(self, group: _Group, tracker: RequestTracker) -> _Group:
        """`group` and `tracker`, whose prefill computes only what the engine's prefix cache lacks (nothing,
        for a fork of a member: another choice of its request, whose row the engine copies)."""
        parent = tracker.request.fork_of
        if parent is not None and any(
            m.request_id == parent
            and m.request.fork_of is None
            and m.request.prompt_ids == tracker.request.prompt_ids
            for m in group.members
        ):
            return group.fork(tracker)
        return group.plus(
            tracker, self.engine.cached_tokens(tracker.request.prompt_ids, tracker.request.adapter)
        )

    def _acceptable(self, running: _Group, group: _Group) -> bool:
        """Whether a group of two or more may prefill together (the head alone always may: a prompt longer
        than the chunk is chunked instead)."""
        # A prefix-cache hit runs alone (one weight pass each): two in a step save nothing, and the second
        # would hold back the first one's first token and stall the running streams twice as long.
        # While others decode, their stall is bounded by the chunk.
        chunk = self.limits.prefill_chunk_tokens if running.members else 0
        return (
            group.hits <= 1
            and group.prefill_tokens <= self.limits.max_prefill_tokens
            and not (chunk and group.prefill_tokens > chunk)
            and group.padding_ratio <= self.limits.max_padding_ratio
            and self._fits_kv(running, group)
        )

    def _fits_kv(self, running: _Group, group: _Group) -> bool:
        rows = len(running.members) + len(group.members)
        return rows * max(running.reserved, group.reserved) <= self.limits.batch_tokens

    def _beside(self, group: _Group, decoding: bool) -> bool:
        """Whether `group` prefills beside the decode steps: some run, no prompt has a prefix-cache hit, and
        none is to be chunked."""
        chunk = self.limits.prefill_chunk_tokens
        lone = group.members[0]
        return (
            self.limits.prefill_beside_decode
            and decoding
            and not (chunk and len(group.members) == 1 and lone.prompt_len > chunk)
            and not group.hits
            and not group.forks
        )

    # -- the plans ----------------------------------------------------------------------------------------
    def _prefill(self, state: RunnerState, group: _Group) -> StepPlan:
        # In pieces only while others decode: nobody is stalled when nothing else runs.
        chunk = self.limits.prefill_chunk_tokens if state.running else 0
        if chunk and len(group.members) == 1:  # the engine chunks a lone prompt only; the record: one piece
            piece = next_piece(group.cached[0], chunk, group.members[0].prompt_len)
            sizes = StepShape(1, piece, piece)
        else:
            sizes = group.computed
        return StepPlan(StepKind.PREFILL, group.members, group.cached, chunk, sizes)

    def _begin(self, state: RunnerState, group: _Group) -> StepPlan:
        # The rows decoding now decode beside it: the group joins them only at its END_BACKGROUND.
        decode = self._decode(state)
        return StepPlan(
            StepKind.BEGIN_BACKGROUND,
            group.members,
            group.cached,
            prefill_sizes=group.computed,
            decoded=decode.decoded,
            decode_sizes=decode.decode_sizes,
        )

    def _continue(self, staged: RequestTracker) -> StepPlan:
        piece = next_piece(self.engine.staged_done, self.limits.prefill_chunk_tokens, staged.prompt_len)
        return StepPlan(StepKind.CONTINUE_PREFILL, (staged,), prefill_sizes=StepShape(1, piece, piece))

    def _decode(self, state: RunnerState) -> StepPlan:
        prefilling = {*self.engine.background_ids, self.engine.staged_id}
        rows = tuple(t for t in state.running if t.request_id not in prefilling)
        contexts = [t.context for t in rows]
        sizes = StepShape(len(rows), len(rows) * max(contexts), sum(contexts))
        return StepPlan(StepKind.DECODE, decoded=rows, decode_sizes=sizes)


@dataclass(frozen=True)
class _Group:
    """Requests considered together, with the sizes admission checks (kept incrementally). The engine
    prefills the members that start from its prefix cache one at a time, only their uncached tokens, and
    the others as one right-padded run."""

    members: tuple[RequestTracker, ...] = ()
    cached: tuple[int, ...] = ()  # each member's prompt tokens in the prefix cache (0: a miss)
    padded_rows: int = 0  # members prefilled together
    longest: int = 0  # their longest prompt
    tokens: int = 0  # their prompt tokens, summed
    hits: int = 0  # members that start from the prefix cache
    alone: int = 0  # their uncached prompt tokens
    reserved: int = 0  # the largest prompt + max_new_tokens
    forks: int = 0  # members forked from another's row: nothing computed (n choices of one prompt)

    @classmethod
    def of(cls, trackers: Iterable[RequestTracker]) -> _Group:
        """For the KV budget only (`reserved`): prefix cache hits are not looked up."""
        group = cls()
        for tracker in trackers:
            group = group.plus(tracker, 0)
        return group

    def plus(self, tracker: RequestTracker, cached: int) -> _Group:
        members, reserved = (*self.members, tracker), max(self.reserved, tracker.reserved_tokens)
        held = (*self.cached, cached)
        if cached:
            alone = self.alone + tracker.prompt_len - cached
            return replace(
                self, members=members, cached=held, hits=self.hits + 1, alone=alone, reserved=reserved
            )
        longest, tokens = max(self.longest, tracker.prompt_len), self.tokens + tracker.prompt_len
        return replace(
            self,
            members=members,
            cached=held,
            padded_rows=self.padded_rows + 1,
            longest=longest,
            tokens=tokens,
            reserved=reserved,
        )

    def fork(self, tracker: RequestTracker) -> _Group:
        """`tracker` forks a member's row: a row more, no token computed."""
        members, reserved = (*self.members, tracker), max(self.reserved, tracker.reserved_tokens)
        return replace(
            self, members=members, cached=(*self.cached, 0), reserved=reserved, forks=self.forks + 1
        )

    @property
    def prefill_tokens(self) -> int:
        """Token slots the prefill computes, padding included."""
        return self.padded_rows * self.longest + self.alone

    @property
    def padding_ratio(self) -> float:
        padded = self.padded_rows * self.longest
        return 1.0 - self.tokens / padded if padded else 0.0

    @property
    def computed(self) -> StepShape:
        """The record of a prefill of the whole group: the misses padded together, each hit's uncached part
        alone."""
        return StepShape(len(self.members), self.prefill_tokens, self.tokens + self.alone)


def _priority_then_arrival(tracker: RequestTracker) -> tuple[int, float]:
    return tracker.request.priority, tracker.times.arrival


def _without(state: RunnerState, victims: tuple[RequestTracker, ...]) -> RunnerState:
    """The state as it is once `victims` are preempted: they leave the running set (and, ranked below those
    they make room for, are not resumed in the same step)."""
    return replace(state, running=tuple(t for t in state.running if t not in victims))

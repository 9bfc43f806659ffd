"""The admission policy on its own: plans from trackers and a hand-set stand-in for the engine's reports.

No engine runs here; `View` is all the planner reads of one (serve/scheduling/engine_protocol.py's
`EngineView`), so each test sets exactly the engine state it is about.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from scheduler_fakes import EOS_ID, FakeEngine, fake, letter_tokenizer
from tokenizers import Tokenizer

from serve.engine.sampling import SamplingParams
from serve.scheduling.engine_protocol import BatchEngine, EngineView, StepKind
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.planner import Planner, RunnerState, StepPlan, StepShape
from serve.scheduling.request import GenerationRequest, RequestState, RequestTracker


@dataclass
class View:
    """What the planner reads of an engine, set by hand: prefix-cache hits by prompt, the prefills in
    progress (a chunked one, `staged_*`; one beside the decode steps, `background_*`), and the host memory of
    the preempted requests and of each running one's row (`swap_sizes`, 1 byte if not set)."""

    hits: dict[tuple[int, ...], int] = field(default_factory=dict)
    staged_id: str | None = None
    staged_done: int = 0
    background_ids: list[str] = field(default_factory=list)
    background_done: bool = False
    looked_up: list[tuple[int, ...]] = field(default_factory=list)
    lora_slots: int = 0
    swapped_bytes: int = 0
    swap_sizes: dict[str, int] = field(default_factory=dict)

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int:
        self.looked_up.append(tuple(prompt_ids))
        return self.hits.get(tuple(prompt_ids), 0)

    def swap_bytes(self, seq_id: str) -> int:
        return self.swap_sizes.get(seq_id, 1)


@functools.cache
def tokenizer() -> Tokenizer:
    return letter_tokenizer()


def prompt_of(length: int, start: int = 40) -> list[int]:
    return [start + (i % 50) for i in range(length)]


def queued(
    rid: str,
    length: int,
    max_new: int = 8,
    arrival: float = 0.0,
    start: int = 40,
    priority: int = 0,
    adapter: str = "",
) -> RequestTracker:
    request = GenerationRequest(
        rid,
        prompt_of(length, start),
        SamplingParams(),
        max_new,
        ignore_eos=True,
        priority=priority,
        adapter=adapter,
    )
    return RequestTracker(request, tokenizer(), EOS_ID, 10_000, arrival)


def decoding(
    rid: str,
    length: int,
    max_new: int = 30,
    produced: int = 1,
    arrival: float = 0.0,
    priority: int = 0,
    adapter: str = "",
) -> RequestTracker:
    """A running request past its prefill, with `produced` tokens (its context: length + produced)."""
    tracker = queued(rid, length, max_new, arrival=arrival, priority=priority, adapter=adapter)
    tracker.admit(0.0)
    letter = tokenizer().encode("a").ids[0]
    for _ in range(produced):
        tracker.accept(letter, -0.5, 0.0)
    return tracker


def limits(**kw: Any) -> SchedulerLimits:
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_batch_tokens", 10_000)
    return SchedulerLimits(**kw)


def plan(
    view: View,
    running: Sequence[RequestTracker] = (),
    waiting: Sequence[RequestTracker] = (),
    last_phase: StepKind | None = StepKind.DECODE,
    now: float = 0.0,
    **kw: Any,
) -> StepPlan:
    state = RunnerState(tuple(running), last_phase, now, tuple(waiting))
    return Planner(limits(**kw), view).plan(state)


def ids(trackers: Sequence[RequestTracker]) -> list[str]:
    return [t.request_id for t in trackers]


def test_nothing_to_do_is_an_idle_plan() -> None:
    got = plan(View())
    assert got.kind is StepKind.IDLE and got.admitted == () and got.decoded == ()


def test_a_plan_changes_nothing_it_reads() -> None:
    view = View()
    waiting = [queued("a", 5), queued("b", 6)]
    got = plan(view, waiting=waiting)
    assert got.kind is StepKind.PREFILL and got.admitted == tuple(waiting)
    assert all(t.state is RequestState.QUEUED for t in waiting)  # the runner admits them, not the planner
    assert view == View(looked_up=[tuple(prompt_of(5)), tuple(prompt_of(6))])


def test_decode_pads_every_row_to_the_longest_context() -> None:
    rows = [decoding("r1", 3, produced=2), decoding("r2", 9, produced=1)]
    got = plan(View(), running=rows)
    assert got.kind is StepKind.DECODE and got.decoded == tuple(rows)
    assert got.decode_sizes == StepShape(2, 2 * 10, 5 + 10)


def test_an_fcfs_head_that_does_not_fit_the_kv_budget_blocks_younger_ones() -> None:
    running = [decoding("r", 10, max_new=30)]  # reserves 40 slots
    head, young = queued("long", 40, max_new=20), queued("short", 4, max_new=4)  # 60 and 8
    # Two rows x the largest reservation: 2 x 60 > 100, while the short one alone would fit (2 x 40).
    got = plan(View(), running, [head, young], max_batch_tokens=100)
    assert got.kind is StepKind.DECODE and got.admitted == ()
    # Once the running one has left, the head goes first (the short one would need 2 x 60 as well).
    got = plan(View(), (), [head, young], max_batch_tokens=100)
    assert got.kind is StepKind.PREFILL and ids(got.group) == ["long"]


def test_requests_that_may_fill_their_context_reserve_whole_rows_and_a_batch_of_them_runs() -> None:
    # Without max_new_tokens a request may generate until its context is full: it reserves its whole row
    # (prompt + what the context leaves). The default budget, every row's context, takes a full batch.
    context = 64
    running = [decoding("r0", 10, max_new=context - 10)]
    waiting = [queued(f"w{i}", 5 + i, max_new=context - 5 - i) for i in range(3)]
    got = plan(View(), running, waiting, max_batch_size=4, max_batch_tokens=4 * context)
    assert got.kind is StepKind.PREFILL and ids(got.group) == ["w0", "w1", "w2"]
    # A budget of two contexts runs two such requests at once; the others wait, none is refused.
    got = plan(View(), running, waiting, max_batch_size=4, max_batch_tokens=2 * context)
    assert got.kind is StepKind.PREFILL and ids(got.group) == ["w0"]


def test_the_priority_policy_admits_the_lowest_priority_first_and_fcfs_ignores_it() -> None:
    # Joined in this order; one free row, so each plan admits the head alone.
    waiting = [queued("low", 4, arrival=0.0, priority=5), queued("high", 4, arrival=1.0, priority=-1)]
    got = plan(View(), (), waiting, max_batch_size=1, scheduling_policy="priority")
    assert ids(got.admitted) == ["high"]
    got = plan(View(), (), waiting, max_batch_size=1)  # fcfs, the default
    assert ids(got.admitted) == ["low"]


def test_equal_priorities_are_admitted_in_arrival_order_whatever_order_they_joined_in() -> None:
    # A request joins late when its constraint compiles; among equals its arrival still counts.
    waiting = [queued(rid, 4, arrival=at) for rid, at in (("late", 2.0), ("early", 1.0), ("later", 3.0))]
    got = plan(View(), (), waiting, max_batch_size=3, scheduling_policy="priority")
    assert ids(got.admitted) == ["early", "late", "later"]


def test_a_priority_head_that_does_not_fit_the_kv_budget_blocks_lower_ones() -> None:
    running = [decoding("r", 10, max_new=30)]  # reserves 40 slots
    urgent = queued("urgent", 40, max_new=20, arrival=1.0, priority=0)  # 60
    small = queued("small", 4, max_new=4, arrival=0.0, priority=1)  # 8: would fit, but it ranks below
    got = plan(View(), running, [small, urgent], max_batch_tokens=100, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and got.admitted == ()
    got = plan(View(), (), [small, urgent], max_batch_tokens=100, scheduling_policy="priority")
    assert ids(got.group) == ["urgent"]


def preempted(rid: str, arrival: float, priority: int, length: int = 4, adapter: str = "") -> RequestTracker:
    """A request swapped out after a token, back in the queue."""
    tracker = decoding(rid, length, arrival=arrival, priority=priority, adapter=adapter)
    tracker.preempt()
    return tracker


def full_rows() -> list[RequestTracker]:
    """Two busy rows: the lowest-ranked is "late" (priority 5, the later of two), then "early", then "mid"."""
    return [
        decoding("early", 4, arrival=0.0, priority=5),
        decoding("mid", 4, arrival=1.0, priority=1),
        decoding("late", 4, arrival=2.0, priority=5),
    ]


def test_a_more_urgent_request_preempts_the_lowest_ranked_running_one() -> None:
    urgent = queued("urgent", 4, arrival=3.0, priority=0)
    got = plan(View(), full_rows(), [urgent], max_batch_size=3, scheduling_policy="priority")
    assert ids(got.preempted) == ["late"]  # of the two at priority 5, the later arrival
    assert got.kind is StepKind.PREFILL and ids(got.admitted) == ["urgent"]
    two = [urgent, queued("urgent2", 4, arrival=4.0, priority=2)]
    got = plan(View(), full_rows(), two, max_batch_size=3, scheduling_policy="priority")
    assert ids(got.preempted) == ["late", "early"] and ids(got.admitted) == ["urgent", "urgent2"]


def test_a_waiting_request_preempts_only_those_it_strictly_outranks() -> None:
    # Priority 1 outranks the two at 5 but not "mid": one victim per waiting request that outranks one.
    waiting = [queued("a", 4, arrival=3.0, priority=1), queued("b", 4, arrival=4.0, priority=5)]
    got = plan(View(), full_rows(), waiting, max_batch_size=3, scheduling_policy="priority")
    assert ids(got.preempted) == ["late"] and ids(got.admitted) == ["a"]


def test_equal_priorities_and_the_fcfs_policy_never_preempt() -> None:
    rows = [decoding("r1", 4, priority=3), decoding("r2", 4, arrival=1.0, priority=3)]
    equal = plan(
        View(),
        rows,
        [queued("q", 4, arrival=2.0, priority=3)],
        max_batch_size=2,
        scheduling_policy="priority",
    )
    assert equal.kind is StepKind.DECODE and equal.preempted == () and equal.admitted == ()
    fcfs = plan(View(), rows, [queued("q", 4, arrival=2.0, priority=-9)], max_batch_size=2)
    assert fcfs.kind is StepKind.DECODE and fcfs.preempted == () and fcfs.admitted == ()


def test_no_preemption_while_a_row_is_free_or_right_after_a_prefill() -> None:
    urgent = queued("urgent", 4, arrival=3.0, priority=0)
    free = plan(View(), full_rows(), [urgent], max_batch_size=4, scheduling_policy="priority")
    assert free.preempted == () and ids(free.admitted) == ["urgent"]
    after = plan(
        View(), full_rows(), [urgent], StepKind.PREFILL, max_batch_size=3, scheduling_policy="priority"
    )
    assert after.kind is StepKind.DECODE and after.preempted == ()


def test_no_preemption_while_a_group_prefills_beside_the_decode_steps() -> None:
    # Its rows are the ones after the running ones, where a resumed request would go.
    rows = full_rows()
    urgent = queued("urgent", 4, arrival=3.0, priority=0)
    view = View(background_ids=["late"])
    got = plan(view, rows, [urgent], max_batch_size=3, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and got.preempted == () and ids(got.decoded) == ["early", "mid"]


def test_no_preemption_for_a_request_the_kv_budget_would_not_take_anyway() -> None:
    rows = [decoding("r1", 4, max_new=10, priority=5), decoding("r2", 4, max_new=10, priority=5)]  # 14 each
    big = queued("big", 40, max_new=20, arrival=3.0, priority=0)  # 2 rows x 60 > 100
    got = plan(View(), rows, [big], max_batch_size=2, max_batch_tokens=100, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and got.preempted == ()


def test_a_preempted_request_resumes_before_younger_equals_and_decodes_at_once() -> None:
    back = preempted("back", arrival=0.0, priority=1)
    young = queued("young", 4, arrival=5.0, priority=1)
    running = [decoding("r", 4, priority=0)]
    got = plan(View(), running, [young, back], max_batch_size=2, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and ids(got.resumed) == ["back"] and got.admitted == ()
    assert ids(got.decoded) == ["r", "back"] and got.decode_sizes == StepShape(2, 2 * 5, 5 + 5)
    # Ranked below a waiting request, it waits for it.
    urgent = queued("urgent", 4, arrival=6.0, priority=0)
    got = plan(View(), running, [back, urgent], max_batch_size=2, scheduling_policy="priority")
    assert ids(got.admitted) == ["urgent"] and got.resumed == ()


def test_a_preempted_request_outranking_a_running_one_takes_its_row_back() -> None:
    back = preempted("back", arrival=0.0, priority=0)
    running = [decoding("low", 4, arrival=1.0, priority=4)]
    got = plan(View(), running, [back], max_batch_size=1, scheduling_policy="priority")
    assert ids(got.preempted) == ["low"] and ids(got.resumed) == ["back"] and ids(got.decoded) == ["back"]


def test_preemption_keeps_the_preempted_within_swap_space() -> None:
    urgent = [queued("urgent", 4, arrival=3.0, priority=0), queued("urgent2", 4, arrival=4.0, priority=2)]
    view = View(swap_sizes={"late": 100, "early": 50})

    def preempting(swap_space: int, swapped: int = 0) -> StepPlan:
        view.swapped_bytes = swapped
        return plan(
            view, full_rows(), urgent, max_batch_size=3, scheduling_policy="priority", swap_space=swap_space
        )

    assert ids(preempting(150).preempted) == ["late", "early"]  # exactly at the cap
    one = preempting(149)  # "early" would pass it: "urgent2" waits for a row
    assert ids(one.preempted) == ["late"] and ids(one.admitted) == ["urgent"]
    assert ids(preempting(240, swapped=100).preempted) == ["late"]  # the ones swapped out already count
    for refused in (preempting(99), preempting(0)):  # 0: never preempt
        assert refused.kind is StepKind.DECODE and refused.preempted == () and refused.admitted == ()


def test_a_preempted_request_resumes_only_once_its_adapter_has_a_slot() -> None:
    back = preempted("back", arrival=0.0, priority=1, adapter="a")
    other = [decoding("b1", 4, priority=0, adapter="b")]  # holds the one slot
    got = plan(View(lora_slots=1), other, [back], max_batch_size=2, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and got.resumed == () and ids(got.decoded) == ["b1"]
    # Waiting for a slot, it holds back nobody who needs none.
    base = queued("base", 4, arrival=5.0, priority=1)
    got = plan(View(lora_slots=1), other, [back, base], max_batch_size=2, scheduling_policy="priority")
    assert got.resumed == () and ids(got.admitted) == ["base"]
    got = plan(View(lora_slots=1), [decoding("r", 4)], [back], max_batch_size=2, scheduling_policy="priority")
    assert ids(got.resumed) == ["back"] and ids(got.decoded) == ["r", "back"]  # b's request has left


def test_a_row_is_preempted_only_for_the_request_that_outranks_it() -> None:
    rows = [
        decoding("low", 4, arrival=0.0, priority=5, adapter="a"),
        decoding("mid", 4, arrival=1.0, priority=1),
    ]
    urgent = queued("urgent", 4, arrival=2.0, priority=0, adapter="b")
    equal = queued("equal", 4, arrival=3.0, priority=5)
    got = plan(View(lora_slots=1), rows, [urgent, equal], max_batch_size=2, scheduling_policy="priority")
    # Preempting "low" frees a's slot for "urgent": it takes the row.
    assert ids(got.preempted) == ["low"] and ids(got.admitted) == ["urgent"]
    # With "mid" on a, no slot frees for "urgent": the row would go to "equal", of "low"'s own priority.
    rows[1] = decoding("mid", 4, arrival=1.0, priority=1, adapter="a")
    got = plan(View(lora_slots=1), rows, [urgent, equal], max_batch_size=2, scheduling_policy="priority")
    assert got.kind is StepKind.DECODE and got.preempted == () and got.admitted == ()


def test_rows_freed_for_those_that_asked_may_go_to_any_of_them() -> None:
    rows = [
        decoding("v1", 4, arrival=0.0, priority=5, adapter="a"),
        decoding("v2", 4, arrival=1.0, priority=4),
        decoding("r", 4, arrival=2.0, priority=0, adapter="a"),  # holds a's slot
    ]
    u1 = queued("u1", 4, arrival=3.0, priority=0, adapter="b")  # asks for v1's row, but finds no slot
    u2 = queued("u2", 4, arrival=4.0, priority=1)  # asks for v2's
    equal = queued("equal", 4, arrival=5.0, priority=5)
    got = plan(View(lora_slots=1), rows, [u1, u2, equal], max_batch_size=3, scheduling_policy="priority")
    # Both rows freed, "equal" would take one: one is freed, the lowest-ranked's, for "u2".
    assert ids(got.preempted) == ["v1"] and ids(got.admitted) == ["u2"]


def test_padding_ratio_bounds_the_group() -> None:
    waiting = [queued(r, n) for r, n in (("a", 10), ("b", 20), ("c", 11), ("d", 18), ("e", 12))]
    got = plan(View(), waiting=waiting, max_padding_ratio=0.2)
    assert ids(got.group) == ["a", "c", "e"]  # b (2 x 20 for 30 tokens) and d would pad more than 20%
    assert got.prefill_sizes == StepShape(3, 3 * 12, 10 + 11 + 12)
    assert ids(plan(View(), waiting=waiting, max_padding_ratio=1.0).group) == ["a", "b", "c", "d"]


def test_max_prefill_tokens_splits_a_burst_and_a_larger_prompt_goes_alone() -> None:
    burst = [queued(f"q{i}", 8) for i in range(6)]
    first = plan(View(), waiting=burst, max_batch_size=8, max_prefill_tokens=24)
    assert first.kind is StepKind.PREFILL and ids(first.group) == ["q0", "q1", "q2"]
    assert first.prefill_sizes == StepShape(3, 24, 24)
    big = plan(View(), waiting=[queued("big", 40), *burst], max_prefill_tokens=24)
    assert ids(big.group) == ["big"] and big.prefill_sizes == StepShape(1, 40, 40)


def test_no_two_prefills_in_a_row_while_others_decode() -> None:
    running, waiting = [decoding("r", 4)], [queued("a", 5)]
    after_prefill = plan(View(), running, waiting, last_phase=StepKind.PREFILL)
    assert after_prefill.kind is StepKind.DECODE and ids(after_prefill.decoded) == ["r"]
    assert plan(View(), running, waiting, last_phase=StepKind.DECODE).kind is StepKind.PREFILL
    # Nobody is stalled when nothing else runs: prefills follow each other.
    assert plan(View(), (), waiting, last_phase=StepKind.PREFILL).kind is StepKind.PREFILL


def test_a_lone_long_prompt_is_prefilled_in_pieces_while_others_decode() -> None:
    r, late, other = decoding("r", 3), queued("late", 14), queued("other", 4)
    first = plan(View(), [r], [late, other], prefill_chunk_tokens=4)
    assert first.kind is StepKind.PREFILL and ids(first.group) == ["late"]  # 14 + 4 exceed the chunk
    assert (first.chunk, first.prefill_sizes) == (4, StepShape(1, 4, 4))  # the record shows one piece
    # The engine now holds it staged: the others decode between its pieces, and nobody else is admitted.
    view = View(staged_id="late", staged_done=4)
    between = plan(view, [r, late], [other], last_phase=StepKind.PREFILL, prefill_chunk_tokens=4)
    assert between.kind is StepKind.DECODE and ids(between.decoded) == ["r"]
    piece = plan(view, [r, late], [other], last_phase=StepKind.DECODE, prefill_chunk_tokens=4)
    assert piece.kind is StepKind.CONTINUE_PREFILL and ids(piece.group) == ["late"]
    assert piece.prefill_sizes == StepShape(1, 4, 4) and piece.admitted == ()
    view.staged_done = 12
    last = plan(view, [r, late], [other], prefill_chunk_tokens=4)
    assert last.prefill_sizes == StepShape(1, 2, 2)
    # Alone, the same prompt goes whole: there is no stall to bound.
    idle = plan(View(), (), [late], prefill_chunk_tokens=4)
    assert (idle.chunk, idle.prefill_sizes) == (0, StepShape(1, 14, 14))


def test_a_staged_prompt_continues_at_once_when_nothing_else_decodes() -> None:
    late = decoding("late", 14, produced=0)  # admitted, still prefilling
    view = View(staged_id="late", staged_done=4)
    got = plan(view, [late], last_phase=StepKind.PREFILL, prefill_chunk_tokens=4)
    assert got.kind is StepKind.CONTINUE_PREFILL


def test_arrivals_while_others_decode_are_split_to_fit_the_chunk() -> None:
    arrivals = [queued(f"a{i}", 6, start=10 * i) for i in range(3)]
    busy = plan(View(), [decoding("r", 3)], arrivals, prefill_chunk_tokens=8)
    assert ids(busy.group) == ["a0"] and busy.prefill_sizes == StepShape(1, 6, 6)
    idle = plan(View(), (), arrivals, prefill_chunk_tokens=8)
    assert ids(idle.group) == ["a0", "a1", "a2"] and idle.chunk == 0


def test_max_wait_holds_a_partial_group_while_others_decode() -> None:
    running = [decoding("r", 3)]
    b = queued("b", 4, arrival=1.0)
    held = plan(View(), running, [b], now=1.05, max_wait_seconds=0.1)
    assert held.kind is StepKind.DECODE and held.admitted == ()
    assert ids(plan(View(), running, [b], now=1.1, max_wait_seconds=0.1).group) == ["b"]  # waited enough
    assert ids(plan(View(), (), [b], now=1.05, max_wait_seconds=0.1).group) == ["b"]  # nobody to stall
    full = [b, queued("c", 4, arrival=1.04), queued("d", 4, arrival=1.04)]  # fills the free rows
    assert ids(plan(View(), running, full, now=1.05, max_wait_seconds=0.1).group) == ["b", "c", "d"]
    # Company that cannot join (padding) is no reason to wait: the group is as large as it gets.
    split = [b, queued("long", 40, arrival=1.04)]
    assert ids(plan(View(), running, split, now=1.05, max_wait_seconds=0.1).group) == ["b"]


def test_prefill_beside_decode_only_while_decoding_without_a_hit_or_a_chunk() -> None:
    r, a = decoding("r", 4, produced=2), queued("a", 6)
    on: dict[str, Any] = {"prefill_beside_decode": True, "prefill_chunk_tokens": 8}
    beside = plan(View(), [r], [a], **on)
    assert beside.kind is StepKind.BEGIN_BACKGROUND and beside.admitted == (a,)
    assert beside.prefill_sizes == StepShape(1, 6, 6)  # written when it is joined
    assert beside.decoded == (r,) and beside.decode_sizes == StepShape(1, 6, 6)  # r's context
    assert plan(View(), (), [a], **on).kind is StepKind.PREFILL  # nothing decodes: nothing to go beside
    hit = View(hits={tuple(a.request.prompt_ids): 3})
    assert plan(hit, [r], [a], **on).kind is StepKind.PREFILL
    chunked = plan(View(), [r], [queued("long", 20)], **on)
    assert chunked.kind is StepKind.PREFILL and chunked.chunk == 8
    assert plan(View(), [r], [a], prefill_chunk_tokens=8).kind is StepKind.PREFILL  # off by default


def test_a_prefix_cache_hit_runs_alone() -> None:
    h1, miss, h2 = queued("h1", 16), queued("m", 8, start=20), queued("h2", 16, start=41)
    view = View(hits={tuple(h1.request.prompt_ids): 13, tuple(h2.request.prompt_ids): 13})
    got = plan(view, waiting=[h1, miss, h2], max_prefill_tokens=12)
    # 3 uncached tokens beside an 8-token miss fit 12 (whole prompts would not); the second hit waits.
    assert ids(got.group) == ["h1", "m"] and got.cached == (13, 0)
    assert got.prefill_sizes == StepShape(2, 8 + 3, 8 + 3)
    assert ids(plan(view, waiting=[h1, h2]).group) == ["h1"]  # two hits never share a step


def test_a_prefill_beside_the_decode_steps_is_joined_when_its_run_is_over() -> None:
    r, a, waiting = decoding("r", 4), decoding("a", 6, produced=0), [queued("w", 5)]
    view = View(background_ids=["a"])
    began = StepShape(1, 6, 6)
    state = RunnerState((r, a), "decode", 0.0, tuple(waiting), began)
    planner = Planner(limits(prefill_beside_decode=True), view)
    assert planner.join(state) is None  # still running, and r decodes meanwhile
    meanwhile = planner.plan(state)
    assert meanwhile.kind is StepKind.DECODE and ids(meanwhile.decoded) == ["r"]  # one group at a time
    view.background_done = True
    assert planner.join(state) == StepPlan(StepKind.END_BACKGROUND, (a,), prefill_sizes=began)
    # With nothing else decoding the join waits for the run rather than idle.
    alone = RunnerState((a,), "decode", 0.0, (), began)
    view.background_done = False
    joined = planner.join(alone)
    assert joined is not None and joined.group == (a,)
    # A member that left meanwhile (cancelled) is not in the group it fails should the join fail.
    view.background_ids = ["gone", "a"]
    joined = planner.join(RunnerState((r, a), "decode", 0.0, (), began))
    assert joined is not None and ids(joined.group) == ["a"]
    assert Planner(limits(), View()).join(state) is None  # the engine has nothing beside the decode steps


def test_the_planner_needs_only_the_view_and_the_fakes_are_whole_engines() -> None:
    assert isinstance(View(), EngineView) and not isinstance(View(), BatchEngine)
    engine = FakeEngine(tokenizer())
    assert isinstance(engine, BatchEngine) and isinstance(fake(tokenizer()), BatchEngine)


@pytest.mark.parametrize("rows", [1, 4])
def test_no_admission_beyond_the_free_rows(rows: int) -> None:
    running = [decoding(f"r{i}", 3) for i in range(rows)]
    got = plan(View(), running, [queued(f"q{i}", 3) for i in range(4)])
    assert len(got.admitted) == 4 - rows and (rows < 4 or got.kind is StepKind.DECODE)


def forked(rid: str, parent: RequestTracker) -> RequestTracker:
    request = dataclasses.replace(parent.request, request_id=rid, fork_of=parent.request_id)
    return RequestTracker(request, tokenizer(), EOS_ID, 10_000, 0.0)


def test_forks_join_their_parents_group_at_no_prefill_cost() -> None:
    head = queued("a", 30)
    forks = [forked(f"a-{i}", head) for i in (1, 2)]
    # The prompt budget takes one 30-token prompt only: the forks compute nothing, so they come along.
    chosen = plan(View(), waiting=[head, *forks], max_prefill_tokens=30, max_batch_size=4)
    assert chosen.kind is StepKind.PREFILL and [t.request_id for t in chosen.group] == ["a", "a-1", "a-2"]
    assert chosen.prefill_sizes == StepShape(3, 30, 30)
    # Beside the decode steps they would need a run of their own: they go between decode steps instead.
    beside = plan(View(), running=[decoding("r", 5)], waiting=[head, *forks], prefill_beside_decode=True)
    assert beside.kind is StepKind.PREFILL
    # A fork whose parent is not in the group is prefilled as any other prompt.
    alone = plan(View(), waiting=[forks[0]], max_prefill_tokens=30)
    assert alone.prefill_sizes == StepShape(1, 30, 30)


# --- LoRA slots ---------------------------------------------------------------------------------------------


def test_the_batch_never_holds_more_adapters_than_slots_and_a_waiting_one_holds_back_nobody() -> None:
    running = [decoding("r", 3)]
    waiting = [
        queued("b1", 3, adapter="b"),
        queued("d1", 3, adapter="d"),
        queued("c1", 3, adapter="c"),  # b and d take both slots: it waits
        queued("b2", 3, adapter="b"),
        queued("base", 3),
    ]
    got = plan(View(lora_slots=2), running, waiting, max_batch_size=8)
    assert ids(got.admitted) == ["b1", "d1", "b2", "base"]
    assert ids(plan(View(lora_slots=3), running, waiting, max_batch_size=8).admitted) == ids(waiting)


def test_a_request_waiting_for_a_slot_lets_the_least_used_adapter_drain() -> None:
    running = [decoding("a1", 3, adapter="a"), decoding("a2", 3, adapter="a"), decoding("b1", 3, adapter="b")]
    waiting = [queued("c1", 3, adapter="c"), queued("b2", 3, adapter="b"), queued("a3", 3, adapter="a")]
    got = plan(View(lora_slots=2), running, waiting, max_batch_size=8)
    # b has the fewest running requests: none of its waiting ones is admitted, so its slot frees for c.
    assert ids(got.admitted) == ["a3"]
    after = plan(View(lora_slots=2), running[:2], waiting, max_batch_size=8)  # b1 finished
    assert ids(after.admitted) == ["c1"]  # c takes b's slot; now b2 waits, and a drains for it

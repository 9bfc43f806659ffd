"""What the scheduling layer needs of an engine and of a metrics sink: `serve.engine.engine.Engine` and
`serve.api.metrics.Metrics` satisfy them, and the tests' fakes do too, so the scheduler is tested without a
model. The planner reads only `EngineView`, so the admission policy is tested without an engine at all."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import tokenizers

if TYPE_CHECKING:
    from serve.engine.constraints import ConstraintCompiler, MaskStats
    from serve.engine.types import NewSequence, TokenOut


class StepKind(enum.StrEnum):
    """What a planned step asks of the engine; PREFILL and DECODE also name the phase of a step run (its
    record, its metrics label)."""

    IDLE = "idle"  # nothing: no row decodes and nobody may be admitted
    DECODE = "decode"  # one token for every row past its prefill
    PREFILL = "prefill"  # admit a group, prefill it between decode steps (a lone long prompt: its 1st piece)
    CONTINUE_PREFILL = "continue_prefill"  # the next piece of the prompt the engine prefills in chunks
    BEGIN_BACKGROUND = "begin_background"  # admit a group, prefill it beside the decode steps, and decode
    END_BACKGROUND = "end_background"  # join the group prefilled beside the decode steps


@runtime_checkable  # so tests can check that fakes and stand-ins honour it
class EngineView(Protocol):
    """What the planner (serve/scheduling/planner.py) reads of the engine to decide a step: its prefix cache,
    the prefills it has in progress, and the host memory preemption takes. Reads only: planning never
    changes the engine."""

    def cached_tokens(self, prompt_ids: Sequence[int], adapter: str = "") -> int: ...
    @property
    def lora_slots(self) -> int: ...  # LoRA adapters resident at once (0: none served)
    @property
    def staged_id(self) -> str | None: ...  # the sequence prefilled in chunks (None: none)
    @property
    def staged_done(self) -> int: ...  # its prompt tokens prefilled so far
    @property
    def background_ids(self) -> list[str]: ...  # the group prefilling beside the decode steps
    @property
    def background_done(self) -> bool: ...  # its run is over: joining it will not wait
    @property
    def swapped_bytes(self) -> int: ...  # host memory the preempted sequences hold
    def swap_bytes(self, seq_id: str) -> int: ...  # what swapped_bytes grows by if it is swapped out now


@runtime_checkable
class BatchEngine(EngineView, Protocol):
    """What the scheduler needs from `serve.engine.engine.Engine`: the view the planner decides on, the sizes
    that validate requests and report load, and the calls that run a plan."""

    @property
    def max_batch_size(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...  # every id that ends a generation, eos_token_id first
    @property
    def tokenizer(self) -> tokenizers.Tokenizer: ...
    @property
    def constraint_compiler(self) -> ConstraintCompiler: ...  # the model's, thread-safe, with its cache
    @property
    def mask_stats(self) -> MaskStats: ...  # what constrained rows' masks have cost so far (cumulative)
    def prefill(self, new: Sequence[NewSequence], chunk: int = 0) -> list[TokenOut]: ...
    def continue_prefill(self) -> list[TokenOut]: ...
    def begin_prefill(self, new: Sequence[NewSequence]) -> None: ...
    def end_prefill(self) -> tuple[list[TokenOut], float]: ...
    def decode(self) -> list[TokenOut]: ...
    def release(self, seq_ids: Iterable[str]) -> None: ...  # running or preempted
    def swap_out(self, seq_ids: Iterable[str]) -> None: ...  # preempt: rows to host memory, freed
    def swap_in(self, seq_ids: Sequence[str]) -> None: ...  # resume preempted ones after the running rows
    @property
    def batch_size(self) -> int: ...
    def kv_shape(self) -> tuple[int, ...]: ...


# Requests are counted by priority for the metrics within -bound..bound, the values beyond at its ends: the
# priority is the client's integer, and each value would otherwise be a series of its own.
PRIORITY_LABEL_BOUND = 10

PriorityCounts = dict[int, int]  # requests by their priority, clamped to the bound


def priority_counts(priorities: Iterable[int]) -> PriorityCounts:
    bound = PRIORITY_LABEL_BOUND
    return dict(Counter(min(max(p, -bound), bound) for p in priorities))


class EngineMetrics(Protocol):
    """The metric hooks the engine's side calls (serve.api.metrics.Metrics; in an engine process, a recorder
    whose calls the server's process replays)."""

    def on_admitted(self, queue_seconds: float) -> None: ...
    def on_first_token(self, ttft_seconds: float) -> None: ...
    def on_token(self, inter_token_seconds: float) -> None: ...
    def on_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, cached_prompt_tokens: int
    ) -> None: ...
    def on_step(self, phase: StepKind, batch_size: int, padding_ratio: float, seconds: float) -> None: ...
    def on_masks(self, masks: int, seconds: float, wait_seconds: float) -> None: ...
    def on_constraint_compiled(self, seconds: float) -> None: ...
    def on_speculated(self, proposed: int, accepted: int) -> None: ...
    def on_speculation_done(self, acceptance: float) -> None: ...
    def set_load(self, running: int, kv_used: int, kv_capacity: int) -> None: ...
    def set_priorities(self, waiting: PriorityCounts, running: PriorityCounts) -> None: ...
    def on_preempted(self, requests: int) -> None: ...
    def set_preempted_kv_bytes(self, kv_bytes: int) -> None: ...
    def on_adapter_request(self, adapter: str) -> None: ...
    def on_adapter_slots(self, loads: int, evictions: int) -> None: ...
    def set_lora_requests(self, max_lora: int, running: str, waiting: str) -> None: ...


class SchedulerMetrics(EngineMetrics, Protocol):
    """The metrics a scheduler on the server's side reports to: the engine's hooks, and the queue's length,
    read whenever the metrics are scraped (set between engine steps, it would go stale while a long step
    runs and miss the requests that arrived meanwhile)."""

    def watch_waiting(self, waiting: Callable[[], int]) -> None: ...

"""The batching limits the scheduler works within.

`BatchingKnobs` defines each knob once, with its bounds and its help: `SchedulerLimits` is built on it, and
so is the server's `ServerSettings` (serve/api/config.py), whose flags and `TEXTGEN_*` variables they become.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve.memory import parse_memory
from serve.scheduling.engine_protocol import BatchEngine

# The preempted requests' host copies share the host's memory with the weights and, on CPU, the KV cache
# itself (the demo's whole pod takes ~300 MiB). 1 GiB holds the demo's running batch many times over and a
# few full rows of a 373M-parameter model at 2,048 tokens (~400 MiB a row at fp32); vLLM's 4 GiB is host
# memory beside a GPU's, and would be most of a small CPU pod.
DEFAULT_SWAP_SPACE = 2**30


class BatchingKnobs(BaseModel):
    """The scheduler's knobs that an operator sets."""

    max_queue: int = Field(
        256, ge=1, le=1_000_000, description="waiting requests; more are refused at once (RESOURCE_EXHAUSTED)"
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="the order waiting requests are admitted in: fcfs (arrival) or priority (a request's "
        "priority, lower first, then arrival)",
    )
    swap_space: int = Field(
        DEFAULT_SWAP_SPACE,
        ge=0,
        description="host memory for the keys and values of requests preempted under the priority policy, "
        "e.g. 512MiB or 4GiB (a bare number: MiB); where preempting would take more, the urgent request "
        "waits for a row instead (0: never preempt)",
    )
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="KV slots (padding included: rows x largest prompt + max_new_tokens) for the running "
        "batch; default: all the cache",
    )
    # A prefill stalls every running stream for its whole duration, and on CPU its cost grows with its
    # tokens: 512 of them cost many decode steps (docs/benchmarks.md, "Latency under arrivals"). 512 still
    # takes the usual burst of 16 x 32-token prompts in one step.
    max_prefill_tokens: int = Field(512, ge=1, description="padded prompt tokens prefilled per engine step")
    # A prefill while others decode stalls them for its whole duration; bounded, each stall is at most one
    # piece long and decode steps run in between (the arrivals' first tokens come later instead).
    prefill_chunk_tokens: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="while other requests decode, the most prompt tokens a prefill step computes: "
        "arrivals are split over several steps and a longer prompt is prefilled in pieces of this many, "
        "with decode steps of the running streams in between (0: no bound but max_prefill_tokens; a piece "
        "is never one token, so 1 and 2 give pieces of 2 or 3)",
    )
    # A prefill between two decode steps stalls every stream for its whole length; beside them it shares the
    # cores and the streams slow down instead. Off by default: on 2 cores it took ITL p99 / p50 from ~3 to ~2
    # under arrivals, but the prefill ran 2x longer: first tokens 2-3x later, 0.84-1x tokens at saturation.
    prefill_beside_decode: bool = Field(
        False,
        description="while other requests decode, prefill arrivals on a thread of their own beside the "
        "decode steps, so the running streams slow down a little instead of stalling, and the arrivals' "
        "first tokens come later (prompts with a prefix-cache hit, and prompts chunked by "
        "prefill_chunk_tokens, still run between decode steps)",
    )
    # No wait by default: grouping arrivals saves little on CPU (prefill cost follows tokens) and turns
    # several small stalls of the running streams into one large one, which is what inter-token p99 sees.
    max_wait_seconds: float = Field(
        0.0,
        ge=0,
        le=60,
        description="how long a partial prefill group may wait for company while others decode",
    )
    max_padding_ratio: float = Field(
        0.25, ge=0.0, le=1.0, description="length bucketing: the most padding a prefill group may carry"
    )
    stream_interval_ms: float = Field(
        0.0,
        ge=0,
        le=10_000,
        description="a stream's tokens go out at most once per this many ms (0: every engine step); "
        "fewer, fuller messages for fast models",
    )

    @field_validator("swap_space", mode="before")
    @classmethod
    def _parse_swap_space(cls, value: object) -> object:
        # Flags and variables arrive as text; a number is bytes already (SchedulerLimits.of validates the
        # server's settings again).
        return parse_memory(value) if isinstance(value, str) else value


class SchedulerLimits(BatchingKnobs):
    """Batching limits. `None` means "as large as the engine allows" and is filled in by `resolve`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_batch_size: int | None = Field(
        default=None, ge=1, description="rows running at once (<= engine KV slots)"
    )
    step_history: int = Field(default=1024, ge=1, description="engine steps kept for inspection")

    @classmethod
    def of(cls, knobs: BatchingKnobs, max_batch_size: int | None = None) -> SchedulerLimits:
        """The limits that a model carrying the knobs (the server's settings) sets."""
        return cls(**knobs.model_dump(include=set(BatchingKnobs.model_fields)), max_batch_size=max_batch_size)

    @property
    def stream_interval_seconds(self) -> float:
        return self.stream_interval_ms / 1000

    def resolve(self, engine: BatchEngine) -> SchedulerLimits:
        """These limits with the engine's sizes filled in; ValueError when they exceed the engine."""
        rows = self.max_batch_size or engine.max_batch_size
        if rows > engine.max_batch_size:
            raise ValueError(f"max_batch_size {rows} exceeds the engine's {engine.max_batch_size} KV slots")
        return self.model_copy(
            update={
                "max_batch_size": rows,
                "max_batch_tokens": self.max_batch_tokens or rows * engine.capacity,
            }
        )

    @property
    def batch_size(self) -> int:
        if self.max_batch_size is None:
            raise RuntimeError("SchedulerLimits.resolve(engine) was not called")
        return self.max_batch_size

    @property
    def batch_tokens(self) -> int:
        if self.max_batch_tokens is None:
            raise RuntimeError("SchedulerLimits.resolve(engine) was not called")
        return self.max_batch_tokens

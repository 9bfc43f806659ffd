"""The messages between the server's process and its engine process, pickled over one `multiprocessing` pipe.

server -> engine: first the `EngineSpec` (the process is started before the server knows it, so that it
imports the engine's modules meanwhile), then `Submit`, `Cancel`, `UpdateAdapters` (load or unload a LoRA
adapter between two steps), `RejectWaiting` (the start of a drain: fail the queue), `Stop` (fail what still
runs, send it, exit).
engine -> server: once `Ready` or `Failed`, then a `StepOutput` after every pass of the engine loop that has
outcomes to deliver (step records and metric calls alone wait up to `engine_core.FLUSH_SECONDS` for
company), and an `AdaptersUpdated` for each `UpdateAdapters` once it is made or refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve.engine.types import EngineInfo, EngineSettings
from serve.errors import TextgenError
from serve.scheduling.adapters import AdapterUpdate, UpdateResult
from serve.scheduling.engine_protocol import BatchEngine
from serve.scheduling.handles import Outcome
from serve.scheduling.intake import SchedulerSnapshot, StepRecord
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.request import GenerationRequest

if TYPE_CHECKING:
    from serve.engine.engine import Engine

EngineWrap = Callable[["Engine"], BatchEngine]


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine process needs to build the engine the server would have built in-process."""

    bundle: Path  # its directory: the engine process loads it, each graph checked as it is opened
    engine: EngineSettings
    limits: SchedulerLimits
    log_level: str = "INFO"
    # Wraps the engine before the scheduler gets it (tests slow it down or make a step fail); picklable.
    wrap: EngineWrap | None = None
    cpus: frozenset[int] | None = None  # where the engine process runs (serve/process.py); None: anywhere


MetricCall = tuple[str, tuple[Any, ...]]  # an `EngineMetrics` method's name and its arguments


@dataclass(frozen=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True)
class Cancel:
    request_id: str


@dataclass(frozen=True)
class UpdateAdapters:
    update_id: int  # the server's, to match the reply
    update: AdapterUpdate


@dataclass(frozen=True)
class RejectWaiting:
    pass


@dataclass(frozen=True)
class Stop:
    pass


Command = Submit | Cancel | UpdateAdapters | RejectWaiting | Stop


@dataclass(frozen=True)
class Ready:
    """The engine is built and warmed up."""

    info: EngineInfo
    limits: SchedulerLimits  # resolved against the engine
    max_total_tokens: int
    snapshot: SchedulerSnapshot


@dataclass(frozen=True)
class Failed:
    """Building the engine failed; the error is the one to raise on the server's side."""

    error: Exception


@dataclass(frozen=True)
class StepOutput:
    """What one pass of the engine process's loop produced."""

    outcomes: list[Outcome]
    metric_calls: list[MetricCall]
    snapshot: SchedulerSnapshot
    steps: tuple[StepRecord, ...]  # the engine steps run since the previous output
    received: int  # submit commands the engine process has read so far


@dataclass(frozen=True)
class AdaptersUpdated:
    """The reply to `UpdateAdapters`: what it made (the adapters served after it), or the error that left
    them unchanged."""

    update_id: int
    result: UpdateResult | None
    error: TextgenError | None = None

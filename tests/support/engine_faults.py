"""Engine wrappers that make steps slow or fail on cue, for servers under test.

They are picklable (a frozen dataclass of a module on the tests' path), so they reach the engine process
(`EngineSpec.wrap`, serve/scheduling/messages.py) as well as an engine thread in the test's own process.
The cue is a running sequence's id, which is its request id: a test slows or fails exactly its own requests,
and the others around them run at full speed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from serve.engine.engine import Engine
from serve.engine.types import NewSequence
from serve.errors import EngineFailure


@dataclass(frozen=True)
class InjectedFaults:
    slow_seconds: float = 0.05  # each decode step sleeps this long first ...
    slow_prefix: str = "slow-"  # ... while a sequence whose id starts so runs ("": always)
    fail_prefix: str = "doomed"  # a decode step fails while `fail_rows` sequences whose ids start so run
    fail_rows: int = 1
    fail_prefill_prefix: str = "fails-to-join"  # a prefill fails when one of its sequences' ids starts so
    hold_prefix: str = "held-"  # a decode step waits while a sequence whose id starts so runs ...
    gate_dir: str = ""  # ... until the file gate_dir/<its id> exists ("": nothing is held)

    def __call__(self, engine: Engine) -> Engine:
        decode, prefill = engine.decode, engine.prefill

        def decode_with_faults() -> Any:
            running = engine.running_ids
            if sum(seq_id.startswith(self.fail_prefix) for seq_id in running) >= self.fail_rows:
                raise EngineFailure("injected ONNX Runtime failure")
            if any(seq_id.startswith(self.slow_prefix) for seq_id in running):
                time.sleep(self.slow_seconds)
            for seq_id in running:
                if self.gate_dir and seq_id.startswith(self.hold_prefix):
                    _wait_for(Path(self.gate_dir) / seq_id)
            return decode()

        def prefill_with_faults(new: Sequence[NewSequence], chunk: int = 0) -> Any:
            if self._fails(new):
                raise EngineFailure("injected ONNX Runtime failure")
            return prefill(new, chunk)

        def begin_prefill_with_faults(new: Sequence[NewSequence]) -> None:
            if not self._fails(new):
                return begin_prefill(new)
            session = engine.session  # the run on the prefill's own thread fails, as ONNX Runtime's would
            engine.session = SimpleNamespace(io_binding=session.io_binding, run_with_iobinding=_fail)
            try:
                return begin_prefill(new)
            finally:
                engine.session = session

        begin_prefill = engine.begin_prefill
        engine.decode = decode_with_faults  # type: ignore[method-assign]
        engine.prefill = prefill_with_faults  # type: ignore[method-assign]
        engine.begin_prefill = begin_prefill_with_faults  # type: ignore[method-assign]
        return engine

    def _fails(self, new: Sequence[NewSequence]) -> bool:
        return any(seq.seq_id.startswith(self.fail_prefill_prefix) for seq in new)


HOLD_LIMIT_SECONDS = 120.0  # a gate the test never opens fails the step rather than hanging the server


def _wait_for(gate: Path) -> None:
    """Block until `gate` exists: a test opens it on an event (such as the request's cancel)."""
    deadline = time.monotonic() + HOLD_LIMIT_SECONDS
    while not gate.exists():
        if time.monotonic() > deadline:
            raise EngineFailure(f"injected hold: {gate} was never opened")
        time.sleep(0.005)


def _fail(binding: object) -> None:
    raise EngineFailure("injected ONNX Runtime failure")

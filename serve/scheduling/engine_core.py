"""The engine process's side: build the engine, then run `BatchRunner` over it in a plain loop, serving the
commands that come over the pipe (serve/scheduling/messages.py). serve/scheduling/engine_client.py is the
server's side; together they are vLLM v1's engine core.

In one process, the engine thread's Python between two ONNX Runtime calls (sampling, stopping,
detokenization, step records) and the event loop's (a gRPC message per stream and token, tokenizing
prompts) take turns on one GIL, so every message the server writes can hold the next engine step back. Here
the child process runs the runner as the offline API does; the server's process keeps what faces the
clients: validation, the request handles, metrics. The child ignores SIGINT and SIGTERM (the server drains
it) and exits when the pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import logging
import pickle
import signal
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection

from serve.bundle import load_bundle
from serve.engine.engine import open_engine
from serve.errors import TextgenError
from serve.process import configure_logging, freeze_startup_objects, pin_process
from serve.scheduling.adapters import UpdateResult
from serve.scheduling.engine_protocol import PriorityCounts, StepKind
from serve.scheduling.handles import Outcome
from serve.scheduling.intake import Delivery, StepRecord, draining_error, outcomes
from serve.scheduling.messages import (
    AdaptersUpdated,
    Cancel,
    Command,
    EngineSpec,
    Failed,
    MetricCall,
    Ready,
    RejectWaiting,
    StepOutput,
    Stop,
    Submit,
    UpdateAdapters,
)
from serve.scheduling.runner import BatchRunner

log = logging.getLogger("textgen.engine_process")

# The longest step records and metric calls wait to go with outcomes. A small model's decode step is
# short, and unary requests have nothing to deliver in most steps: a message per step cost the engine
# process a share of its time (pickling, the pipe) and woke the server's event loop at every step
# (docs/benchmarks.md, "Stream pacing, threads and spinning").
FLUSH_SECONDS = 0.01
# How often the loop looks whether a constraint has compiled while nothing else is to be done (a compile
# is short, docs/benchmarks.md "Structured output"; the pipe cannot be woken by one).
COMPILE_POLL_SECONDS = 0.002


class MetricRecorder:
    """`EngineMetrics` that only records the calls, for the server's process to replay on its `Metrics`:
    a call costs a tuple here instead of a lock and a histogram bucket search between engine steps."""

    def __init__(self) -> None:
        self.calls: list[MetricCall] = []

    def on_admitted(self, queue_seconds: float) -> None:
        self.calls.append(("on_admitted", (queue_seconds,)))

    def on_first_token(self, ttft_seconds: float) -> None:
        self.calls.append(("on_first_token", (ttft_seconds,)))

    def on_token(self, inter_token_seconds: float) -> None:
        self.calls.append(("on_token", (inter_token_seconds,)))

    def on_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, cached_prompt_tokens: int
    ) -> None:
        self.calls.append(("on_finished", (reason, prompt_tokens, generation_tokens, cached_prompt_tokens)))

    def on_step(self, phase: StepKind, batch_size: int, padding_ratio: float, seconds: float) -> None:
        self.calls.append(("on_step", (phase, batch_size, padding_ratio, seconds)))

    def on_masks(self, masks: int, seconds: float, wait_seconds: float) -> None:
        self.calls.append(("on_masks", (masks, seconds, wait_seconds)))

    def on_constraint_compiled(self, seconds: float) -> None:
        self.calls.append(("on_constraint_compiled", (seconds,)))

    def on_speculated(self, proposed: int, accepted: int) -> None:
        self.calls.append(("on_speculated", (proposed, accepted)))

    def on_speculation_done(self, acceptance: float) -> None:
        self.calls.append(("on_speculation_done", (acceptance,)))

    def set_load(self, running: int, kv_used: int, kv_capacity: int) -> None:
        self.calls.append(("set_load", (running, kv_used, kv_capacity)))

    def set_priorities(self, waiting: PriorityCounts, running: PriorityCounts) -> None:
        self.calls.append(("set_priorities", (waiting, running)))

    def on_preempted(self, requests: int) -> None:
        self.calls.append(("on_preempted", (requests,)))

    def set_preempted_kv_bytes(self, kv_bytes: int) -> None:
        self.calls.append(("set_preempted_kv_bytes", (kv_bytes,)))

    def on_adapter_request(self, adapter: str) -> None:
        self.calls.append(("on_adapter_request", (adapter,)))

    def on_adapter_slots(self, loads: int, evictions: int) -> None:
        self.calls.append(("on_adapter_slots", (loads, evictions)))

    def set_lora_requests(self, max_lora: int, running: str, waiting: str) -> None:
        self.calls.append(("set_lora_requests", (max_lora, running, waiting)))

    def take(self) -> list[MetricCall]:
        calls, self.calls = self.calls, []
        return calls


def engine_main(conn: Connection) -> None:
    """The child's entry point: wait for the spec, build the engine, say so, then serve commands until told
    to stop. Its modules are imported by then: the server's process starts it before its own imports."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        spec: EngineSpec = conn.recv()
    except EOFError:  # the server's start-up failed before it needed an engine
        return
    configure_logging(spec.log_level)
    if spec.cpus is not None:
        pin_process(spec.cpus)  # before ONNX Runtime starts its threads, which inherit it
    recorder = MetricRecorder()
    try:
        engine = open_engine(load_bundle(spec.bundle), spec.engine)
        scheduled = spec.wrap(engine) if spec.wrap else engine
        runner = BatchRunner(scheduled, spec.limits.resolve(engine), recorder)
    except Exception as exc:
        conn.send(Failed(_picklable(exc)))
        return
    log.info("engine process: froze %d start-up objects", freeze_startup_objects())
    conn.send(Ready(engine.info, runner.limits, runner.max_total_tokens, runner.snapshot()))
    try:
        _EngineLoop(conn, runner, recorder).run()
    except (EOFError, BrokenPipeError):  # the server's process is gone: nobody is left to serve
        log.warning("the server closed the engine pipe; the engine process exits")


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.dumps(exc)
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


class _EngineLoop:
    def __init__(self, conn: Connection, runner: BatchRunner, recorder: MetricRecorder) -> None:
        self._conn = conn
        self._runner = runner
        self._recorder = recorder
        self._received = 0
        self._last_step: StepRecord | None = None
        self._steps: list[StepRecord] = []  # run since the last output
        self._sent_at = 0.0
        self._updates: list[tuple[int, Future[UpdateResult]]] = []  # made at the next step

    def run(self) -> None:
        self._send_now([])  # what the metrics were told while the runner was built (the LoRA slots)
        while True:
            if self._runner.idle:
                self._conn.poll(None)  # nothing to step: sleep until the server sends something
            elif not self._runner.ready:  # only constraints compiling: look again soon
                self._conn.poll(COMPILE_POLL_SECONDS)
            deliveries: list[Delivery] = []
            while self._conn.poll():
                command: Command = self._conn.recv()
                if isinstance(command, Stop):
                    self._send_now(outcomes(self._runner.abort(draining_error)))
                    return
                deliveries += self._command(command)
            if self._runner.ready:
                deliveries += self._runner.safe_step()
            self._send(deliveries)
            self._reply_updates()

    def _command(self, command: Command) -> list[Delivery]:
        if isinstance(command, Submit):
            self._received += 1
            request = command.request
            try:  # the server checked both already; this is the scheduler's own word
                self._runner.enqueue(self._runner.track(request))
            except TextgenError as exc:
                self._send_now([Outcome(request.request_id, exc)])
        elif isinstance(command, Cancel):
            self._runner.request_cancel(command.request_id)
        elif isinstance(command, UpdateAdapters):
            self._updates.append((command.update_id, self._runner.request_update(command.update)))
        elif isinstance(command, RejectWaiting):
            return self._runner.reject_waiting(draining_error)
        else:
            raise ValueError(f"unknown engine process command {command!r}")
        return []

    def _reply_updates(self) -> None:
        """Tell the server of each adapter update the step made (or refused); after the step's outcomes,
        so a request it ended is not seen running by the server when it hears of the update."""
        pending = []
        for update_id, future in self._updates:
            if not future.done():  # deferred: a group prefills beside the decode steps
                pending.append((update_id, future))
            elif (error := future.exception()) is not None:
                assert isinstance(error, TextgenError), error
                self._conn.send(AdaptersUpdated(update_id, None, error))
            else:
                self._conn.send(AdaptersUpdated(update_id, future.result()))
        self._updates = pending

    def _send(self, deliveries: list[Delivery]) -> None:
        step = self._runner.last_step
        if step is not None and step is not self._last_step:
            self._steps.append(step)
            self._last_step = step
        done = outcomes(deliveries)
        if done or self._runner.idle or time.monotonic() - self._sent_at >= FLUSH_SECONDS:
            self._send_now(done)

    def _send_now(self, done: list[Outcome]) -> None:
        calls = self._recorder.take()
        if not (done or calls or self._steps):
            return
        steps, self._steps = tuple(self._steps), []
        self._conn.send(StepOutput(done, calls, self._runner.snapshot(), steps, self._received))
        self._sent_at = time.monotonic()

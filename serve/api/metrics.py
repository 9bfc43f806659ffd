"""Prometheus metrics: what an operator needs to tell whether the service is healthy and fast.

One `Metrics` object owns every metric, registered on a `CollectorRegistry` passed in, so tests build isolated
instances and the server exposes exactly one registry on its own HTTP port (`start_http_server`).

The hooks are called from two places: the scheduler's engine thread (`on_admitted`, `on_first_token`,
`on_token`, `on_finished`, `on_step`, `on_masks`, `on_constraint_compiled`, `on_speculated`,
`on_speculation_done`, `set_load`, `set_priorities`, `on_preempted`, `set_preempted_kv_bytes`,
`on_adapter_request`, `on_adapter_slots`, `set_lora_requests`) and the front
ends (`on_request_done`, `on_constrained`, `set_ready`, `set_model_info`). prometheus_client's metrics are
thread-safe, so no locking is needed here. The queue's length is not a hook: the scheduler hands a function
(`watch_waiting`) that every scrape calls, so the gauge counts the requests that arrived during a long engine
step, and those whose constraint is still compiling.

Bucket choices (a quantile is only as precise as the buckets around it, and a quantile above the largest
finite bucket is reported as that bucket's bound, so the largest bucket must exceed the worst real value):
- Latencies that include queueing (TTFT, request duration, queue time) start at 1 ms (an idle server
  answers in milliseconds) and reach minutes: under overload a request waits for others' generations, and
  the longest generations of a context-length budget take minutes on CPU.
- Inter-token latency is one decode step seen by one request: ~1 ms for a tiny model, 9-35 ms for a 30M
  model at batch 16 on 2 CPU cores (measured for the KV-cache design), up to seconds on a starved machine.
  A step that gives a request several tokens (speculation) is observed once per token, each its share of
  the step's interval, so its accepted tokens are not ~0. Buckets are dense between 5 and 100 ms, where
  SLOs for streaming text sit.
- Step duration covers decode steps (as above) and prefill steps, which process whole prompts: up to 10 s.
- Token counts are exponential (powers of two) because prompt and generation lengths span orders of
  magnitude; they reach 65536, above any context length this service is built for.
- Batch size: every size up to 8, then powers of two up to 256 (the largest sensible `max_batch_size`).
- Padding ratio is a fraction in [0, 1]: 0 is its own bucket (decode steps have no padding), then 0.1 steps.
- A constraint's compile (llguidance) takes about a millisecond for a small schema, regex or choice list and
  is bounded by the compiler's limits; buckets reach 10 s. Token masks are counted as totals (masks, seconds
  computing them, seconds a step waited for them): their ratio is the mask cost per constrained token.
- Speculation is counted as vLLM's spec-decode metrics are (drafts, proposed tokens, accepted tokens) plus
  the tokens its steps emitted, as far as the request kept them: a step cut by its stop, EOS or token
  limit counts the tokens before the cut (serve/scheduling/delivery.py `_speculated`); a request's acceptance
  rate (accepted over proposed) is a fraction in 0.1 buckets.

Over 400 lines on purpose: every metric's name, help text, buckets and hook are defined here once, so a
dashboard, an alert or the inference gateway reads one list (tests/support/metric_refs.py checks them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

import grpc
import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from serve.process import resident_memory
from serve.scheduling.engine_protocol import PRIORITY_LABEL_BOUND, PriorityCounts

FINISH_REASONS = ("length", "eos", "stop", "context")
# Structured output's kinds (serve/engine/types.py ConstraintKind) and "tool": a call tool_choice forces.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "tool")
STEP_PHASES = ("prefill", "decode")
STATUS_CODES = frozenset(code.name for code in grpc.StatusCode)

QUEUEING_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536
BATCH_SIZE_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
PADDING_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ACCEPTANCE_BUCKETS = PADDING_RATIO_BUCKETS  # a fraction in [0, 1] as well
# A constraint's compile: ~1 ms for a small schema or regex, up to the compiler's limits (seconds).
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _check_label(kind: str, value: str, allowed: frozenset[str] | tuple[str, ...]) -> None:
    # Labels must stay a small bounded set: an unexpected value is a caller bug, not a new series.
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}: expected one of {', '.join(sorted(allowed))}")


def new_registry() -> CollectorRegistry:
    """A registry with the standard process, platform and GC collectors, like the default registry."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


# The Kubernetes Gateway API Inference Extension's endpoint picker reads a model server's queue and KV-cache
# use under vLLM's names unless told others (its model-server protocol; --total-queued-requests-metric and
# --kv-cache-usage-percentage-metric name textgen's instead): the same gauges again under those names (older
# pickers read gpu_cache_usage_perc, newer kv_cache_usage_perc). Alias -> the textgen gauge it repeats.
# Prometheus keeps ':' for recording rules, so `promtool check metrics` lints these four names.
WAITING = "textgen_requests_waiting"
GATEWAY_ALIASES = {
    "vllm:num_requests_waiting": WAITING,
    "vllm:num_requests_running": "textgen_requests_running",
    "vllm:kv_cache_usage_perc": "textgen_kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "textgen_kv_cache_usage_ratio",
}
# The picker routes a request for a LoRA adapter by this gauge, as vLLM exposes it: labels max_lora (the
# slots), running_lora_adapters and waiting_lora_adapters (comma-separated names); its value is the time the
# labels were set, and the picker reads the series with the latest value. textgen keeps that series alone
# (vLLM leaves the older ones behind), so the gauge does not grow a series per mix of adapters.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"


class Metrics:
    """Every `textgen_*` metric, on one registry (a fresh one with the standard collectors by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self._define_latencies()
        self._define_sizes()
        self._define_counters()
        self._define_gauges()

    def _define_latencies(self) -> None:
        reg = self.registry
        self.request_duration = Histogram(
            "textgen_request_duration_seconds",
            "Time from a request's arrival to its end (last token or error).",
            ["rpc"],
            buckets=QUEUEING_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "textgen_request_queue_seconds",
            "Time from a request's arrival to its admission into a batch.",
            buckets=QUEUEING_LATENCY_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "textgen_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=QUEUEING_LATENCY_BUCKETS,
            registry=reg,
        )
        self.inter_token = Histogram(
            "textgen_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request; a step that gives it several"
            " (speculation) is observed once per token, its interval divided among them.",
            buckets=INTER_TOKEN_BUCKETS,
            registry=reg,
        )
        self.step_duration = Histogram(
            "textgen_step_duration_seconds",
            "Duration of one engine step (a prefill beside the decode steps overlaps them).",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=reg,
        )
        self.constraint_compile = Histogram(
            "textgen_constraint_compile_seconds",
            "Time to compile one constraint with llguidance (the same constraint again is cached).",
            buckets=COMPILE_BUCKETS,
            registry=reg,
        )

    def _define_sizes(self) -> None:
        reg = self.registry
        self.prompt_tokens = Histogram(
            "textgen_request_prompt_tokens",
            "Prompt tokens per finished request.",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=reg,
        )
        self.generation_tokens = Histogram(
            "textgen_request_generation_tokens",
            "Generated tokens per finished request.",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=reg,
        )
        self.batch_size = Histogram(
            "textgen_batch_size",
            "Rows (sequences) in one engine step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=reg,
        )
        self.padding_ratio = Histogram(
            "textgen_batch_padding_ratio",
            "Padded token slots divided by all token slots of one engine step.",
            buckets=PADDING_RATIO_BUCKETS,
            registry=reg,
        )
        self.spec_acceptance = Histogram(
            "textgen_spec_decode_acceptance_rate",
            "Per finished request that speculated: proposed tokens accepted over proposed.",
            buckets=ACCEPTANCE_BUCKETS,
            registry=reg,
        )

    def _define_counters(self) -> None:
        reg = self.registry
        self.requests = Counter(
            "textgen_requests",
            "Requests by RPC and final gRPC status code.",
            ["rpc", "code"],
            registry=reg,
        )
        self.finished = Counter(
            "textgen_requests_finished",
            "Generations that ended normally, by why they stopped.",
            ["reason"],
            registry=reg,
        )
        self.prompt_tokens_total = Counter(
            "textgen_prompt_tokens",
            "Prompt tokens of finished generations.",
            registry=reg,
        )
        self.cached_prompt_tokens_total = Counter(
            "textgen_prompt_tokens_cached",
            "Prompt tokens of finished generations copied from the prefix cache instead of computed.",
            registry=reg,
        )
        self.generation_tokens_total = Counter(
            "textgen_generation_tokens",
            "Tokens generated by finished generations.",
            registry=reg,
        )
        self.constrained = Counter(
            "textgen_constrained_requests",
            "Requests with structured output accepted, by kind (tool: a call that tool_choice forces).",
            ["kind"],
            registry=reg,
        )
        self.constraint_masks = Counter(
            "textgen_constraint_masks",
            "Allowed-token masks computed: one per constrained sequence and engine step.",
            registry=reg,
        )
        self.constraint_mask_seconds = Counter(
            "textgen_constraint_mask_seconds",
            "Time spent computing allowed-token masks (beside ONNX Runtime's run of the step).",
            registry=reg,
        )
        self.constraint_mask_wait_seconds = Counter(
            "textgen_constraint_mask_wait_seconds",
            "Time engine steps waited for their masks after ONNX Runtime's run: the mask cost not hidden.",
            registry=reg,
        )
        self.spec_drafts = Counter(
            "textgen_spec_decode_drafts", "Speculating steps: proposals verified in one run.", registry=reg
        )
        self.spec_draft_tokens = Counter(
            "textgen_spec_decode_draft_tokens",
            "Tokens proposed by speculation (of a step cut by the request's end, the accepted ones it kept).",
            registry=reg,
        )
        self.spec_accepted_tokens = Counter(
            "textgen_spec_decode_accepted_tokens",
            "Proposed tokens sampling picked and the request kept (emitted without a step of their own).",
            registry=reg,
        )
        self.spec_emitted_tokens = Counter(
            "textgen_spec_decode_emitted_tokens",
            "Tokens emitted by speculating steps: the accepted ones and one sampled token per step.",
            registry=reg,
        )
        self.preemptions = Counter(
            "textgen_preemptions",
            "Running requests preempted for a more urgent one (priority policy): swapped out, resumed later.",
            registry=reg,
        )
        self.lora_requests = Counter(
            "textgen_lora_requests",
            "Requests admitted to a batch with a LoRA adapter, by the adapter's name.",
            ["adapter"],
            registry=reg,
        )
        self.lora_slot_loads = Counter(
            "textgen_lora_slot_loads",
            "LoRA adapters written into a slot (at start, when loaded, when a request needs one).",
            registry=reg,
        )
        self.lora_slot_evictions = Counter(
            "textgen_lora_slot_evictions",
            "Slot loads that evicted the least recently used adapter no running request held.",
            registry=reg,
        )
        # Known label values exist from the start, so rate() sees their first increment.
        for kind in CONSTRAINT_KINDS:
            self.constrained.labels(kind=kind)
        for reason in FINISH_REASONS:
            self.finished.labels(reason=reason)
        for phase in STEP_PHASES:
            self.step_duration.labels(phase=phase)

    def _define_gauges(self) -> None:
        reg = self.registry
        self.resident_memory = Gauge(
            "textgen_process_resident_memory_bytes",
            "Resident memory of each of the server's processes (VmRSS): the server, and the engine when it "
            "runs in a process of its own.",
            ["process"],
            registry=reg,
        )
        self.peak_resident_memory = Gauge(
            "textgen_process_peak_resident_memory_bytes",
            "The most resident memory each process has held since it started (VmHWM): start-up included, "
            "what a pod's memory limit must cover.",
            ["process"],
            registry=reg,
        )
        self.watch_process("server", "self")
        self.running = Gauge("textgen_requests_running", "Requests in the running batch.", registry=reg)
        self.waiting = Gauge(
            WAITING,
            "Requests queued: not yet admitted (their constraint compiling or not), or preempted to resume.",
            registry=reg,
        )
        self.kv_used = Gauge("textgen_kv_cache_slots_used", "KV-cache slots (rows) in use.", registry=reg)
        self.kv_capacity = Gauge(
            "textgen_kv_cache_slots_capacity", "KV-cache slots (rows) in all.", registry=reg
        )
        self.kv_usage = Gauge(
            "textgen_kv_cache_usage_ratio", "KV-cache slots in use over all, 0 to 1.", registry=reg
        )
        self.gateway = {
            name: Gauge(name, f"{source} under vLLM's name, for an inference gateway.", registry=reg)
            for name, source in GATEWAY_ALIASES.items()
        }
        bound = PRIORITY_LABEL_BOUND
        by_priority = f"by their priority (clamped to -{bound}..{bound}), as of the latest engine step."
        self.waiting_by_priority = Gauge(
            "textgen_requests_waiting_by_priority",
            f"Requests queued {by_priority}",
            ["priority"],
            registry=reg,
        )
        self.running_by_priority = Gauge(
            "textgen_requests_running_by_priority",
            f"Requests in the running batch {by_priority}",
            ["priority"],
            registry=reg,
        )
        # Priority 0, every request's default, exists from the start; the others from their first request.
        self._priorities_shown: dict[Gauge, set[int]] = {}
        for gauge in (self.waiting_by_priority, self.running_by_priority):
            gauge.labels(priority="0")
            self._priorities_shown[gauge] = {0}
        self.preempted_kv_bytes = Gauge(
            "textgen_preempted_kv_bytes",
            "Host memory holding the keys and values of preempted requests until they resume.",
            registry=reg,
        )
        self.lora_requests_info = Gauge(
            LORA_REQUESTS_INFO,
            "Running stats on lora requests.",  # vLLM's help text
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        self._lora_labels: tuple[str, str, str] | None = None  # the gauge's one series
        self.ready = Gauge("textgen_ready", "1 when the server accepts requests, else 0.", registry=reg)
        self.model_info = Info("textgen_model", "The model being served.", registry=reg)

    # Scheduler side (may be called from the engine thread).

    def on_admitted(self, queue_seconds: float) -> None:
        """Once per request, when it joins a batch: time since its arrival."""
        self.queue_time.observe(queue_seconds)

    def on_first_token(self, ttft_seconds: float) -> None:
        """Once per request, at its first generated token: time since its arrival."""
        self.ttft.observe(ttft_seconds)

    def on_token(self, inter_token_seconds: float) -> None:
        """For every generated token after a request's first: time since its previous token, or for the
        tokens one step gave a request together, that step's interval divided among them."""
        self.inter_token.observe(inter_token_seconds)

    def on_finished(
        self, reason: str, prompt_tokens: int, generation_tokens: int, cached_prompt_tokens: int
    ) -> None:
        """Once per generation that ended normally (length, eos, stop, context); failures count by code."""
        _check_label("finish reason", reason, FINISH_REASONS)
        self.finished.labels(reason=reason).inc()
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.prompt_tokens_total.inc(prompt_tokens)
        self.cached_prompt_tokens_total.inc(cached_prompt_tokens)
        self.generation_tokens_total.inc(generation_tokens)

    def on_step(self, phase: str, batch_size: int, padding_ratio: float, seconds: float) -> None:
        """Once per engine step (prefill or decode) with its rows, padded fraction and duration."""
        _check_label("step phase", phase, STEP_PHASES)
        self.step_duration.labels(phase=phase).observe(seconds)
        self.batch_size.observe(batch_size)
        self.padding_ratio.observe(padding_ratio)

    def on_masks(self, masks: int, seconds: float, wait_seconds: float) -> None:
        """After an engine step with constrained rows: masks made, their time, the step's wait for them."""
        self.constraint_masks.inc(masks)
        self.constraint_mask_seconds.inc(seconds)
        self.constraint_mask_wait_seconds.inc(wait_seconds)

    def on_constraint_compiled(self, seconds: float) -> None:
        """Once per compile (a cache miss that llguidance accepted)."""
        self.constraint_compile.observe(seconds)

    def on_speculated(self, proposed: int, accepted: int) -> None:
        """Once per speculating step of a request: tokens proposed, and how many of them were accepted."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(proposed)
        self.spec_accepted_tokens.inc(accepted)
        self.spec_emitted_tokens.inc(accepted + 1)

    def on_speculation_done(self, acceptance: float) -> None:
        """Once per finished request that speculated: its accepted over its proposed tokens."""
        self.spec_acceptance.observe(acceptance)

    def set_load(self, running: int, kv_used: int, kv_capacity: int) -> None:
        """After every engine step, so the gauges return to 0 when idle."""
        self.running.set(running)
        self.kv_used.set(kv_used)
        self.kv_capacity.set(kv_capacity)
        usage = kv_used / kv_capacity if kv_capacity else 0.0
        self.kv_usage.set(usage)
        values = {"textgen_requests_running": running, "textgen_kv_cache_usage_ratio": usage}
        for name, source in GATEWAY_ALIASES.items():
            if source in values:
                self.gateway[name].set(values[source])

    def set_priorities(self, waiting: PriorityCounts, running: PriorityCounts) -> None:
        """After an engine step that changed them: requests by priority; a priority no longer seen reads 0."""
        for gauge, counts in ((self.waiting_by_priority, waiting), (self.running_by_priority, running)):
            shown = self._priorities_shown[gauge]
            for priority in shown - counts.keys():
                gauge.labels(priority=str(priority)).set(0)
            for priority, count in counts.items():
                gauge.labels(priority=str(priority)).set(count)
            shown.update(counts)

    def on_preempted(self, requests: int) -> None:
        """After an engine step that preempted running requests."""
        self.preemptions.inc(requests)

    def set_preempted_kv_bytes(self, kv_bytes: int) -> None:
        """When the preempted requests' host memory changed."""
        self.preempted_kv_bytes.set(kv_bytes)

    def on_adapter_request(self, adapter: str) -> None:
        """Once per request with a LoRA adapter, when it joins a batch."""
        self.lora_requests.labels(adapter=adapter).inc()

    def on_adapter_slots(self, loads: int, evictions: int) -> None:
        """After an engine step (or an adapter update) that wrote adapters into slots: how many, and how
        many of them evicted another."""
        self.lora_slot_loads.inc(loads)
        self.lora_slot_evictions.inc(evictions)

    def set_lora_requests(self, max_lora: int, running: str, waiting: str) -> None:
        """When the adapters of running or waiting requests changed (comma-separated names): the gauge's
        one series gets them as labels and the current time as its value, the series before it goes."""
        labels = (str(max_lora), waiting, running)
        if self._lora_labels is not None and self._lora_labels != labels:  # one thread calls it: no race
            self.lora_requests_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self.lora_requests_info.labels(*labels).set_to_current_time()

    def watch_waiting(self, waiting: Callable[[], int]) -> None:
        """The queue's length (and its gateway alias) from `waiting`, which every scrape calls on its own
        thread: current while an engine step runs."""
        aliases = [self.gateway[name] for name, source in GATEWAY_ALIASES.items() if source == WAITING]
        for gauge in (self.waiting, *aliases):
            gauge.set_function(waiting)

    # Server side.

    def on_request_done(self, rpc: str, code: str, seconds: float) -> None:
        """Count a request once, with its final status code name (e.g. "OK", "CANCELLED")."""
        _check_label("status code", code, STATUS_CODES)
        self.requests.labels(rpc=rpc, code=code).inc()
        self.request_duration.labels(rpc=rpc).observe(seconds)

    def on_constrained(self, kind: str) -> None:
        """Once per request with structured output, when it is submitted."""
        _check_label("constraint kind", kind, CONSTRAINT_KINDS)
        self.constrained.labels(kind=kind).inc()

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def watch_process(self, name: str, pid: int | str) -> None:
        """Report process `pid`'s resident memory under `process=name`, read from /proc at each scrape."""
        self.resident_memory.labels(process=name).set_function(lambda: resident_memory(pid)[0])
        self.peak_resident_memory.labels(process=name).set_function(lambda: resident_memory(pid)[1])

    def set_model_info(self, model: str, dtype: str, quantization: str, provider: str) -> None:
        self.model_info.info(
            {"model": model, "dtype": dtype, "quantization": quantization, "provider": provider}
        )

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve this registry at http://addr:port/metrics from a daemon thread; port 0 picks a free port."""
        return prometheus_client.start_http_server(port, addr=addr, registry=self.registry)

    def exposition(self) -> str:
        """The text exposition format of everything in the registry (what /metrics returns)."""
        return prometheus_client.generate_latest(self.registry).decode()

"""The engine's steps and load: each step's duration, rows and padding; the running batch, the queue and
the KV cache's use (also under vLLM's names, for an inference gateway); requests by priority; preemption."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve.api.metrics.shapes import (
    BATCH_SIZE_BUCKETS,
    PADDING_RATIO_BUCKETS,
    STEP_BUCKETS,
    check_label,
)
from serve.scheduling.engine_protocol import PRIORITY_LABEL_BOUND, PriorityCounts

STEP_PHASES = ("prefill", "decode")

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


class StepMetrics:
    registry: CollectorRegistry

    def _define_steps(self) -> None:
        reg = self.registry
        self.step_duration = Histogram(
            "textgen_step_duration_seconds",
            "Duration of one engine step (a prefill beside the decode steps overlaps them).",
            ["phase"],
            buckets=STEP_BUCKETS,
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
        for phase in STEP_PHASES:  # known label values exist from the start, for rate()
            self.step_duration.labels(phase=phase)

    def on_step(self, phase: str, batch_size: int, padding_ratio: float, seconds: float) -> None:
        """Once per engine step (prefill or decode) with its rows, padded fraction and duration."""
        check_label("step phase", phase, STEP_PHASES)
        self.step_duration.labels(phase=phase).observe(seconds)
        self.batch_size.observe(batch_size)
        self.padding_ratio.observe(padding_ratio)


class LoadMetrics:
    registry: CollectorRegistry

    def _define_load(self) -> None:
        reg = self.registry
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
        self.preemptions = Counter(
            "textgen_preemptions",
            "Running requests preempted for a more urgent one (priority policy): swapped out, resumed later.",
            registry=reg,
        )
        self.preempted_kv_bytes = Gauge(
            "textgen_preempted_kv_bytes",
            "Host memory holding the keys and values of preempted requests until they resume.",
            registry=reg,
        )

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

    def watch_waiting(self, waiting: Callable[[], int]) -> None:
        """The queue's length (and its gateway alias) from `waiting`, which every scrape calls on its own
        thread: current while an engine step runs."""
        aliases = [self.gateway[name] for name, source in GATEWAY_ALIASES.items() if source == WAITING]
        for gauge in (self.waiting, *aliases):
            gauge.set_function(waiting)

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

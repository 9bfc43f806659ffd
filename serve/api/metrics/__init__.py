"""Prometheus metrics: what an operator needs to tell whether the service is healthy and fast.

One `Metrics` object owns every metric, registered on a `CollectorRegistry` passed in, so tests build isolated
instances and the server exposes exactly one registry on its own HTTP port (`start_http_server`). Its metrics
and hooks come in concepts, a module each: a request's life (requests.py), the engine's steps and load
(engine.py), structured output (constraints.py), speculation (speculation.py), LoRA adapters (lora.py) and the
server's processes (process.py); shapes.py holds the buckets, and why they are what they are. Every metric's
name, help text, buckets and hook are defined once, so a dashboard, an alert or the inference gateway reads
one list (tests/support/metric_refs.py checks them).

The hooks are called from two places: the scheduler's engine thread (`on_admitted`, `on_first_token`,
`on_token`, `on_finished`, `on_step`, `on_masks`, `on_constraint_compiled`, `on_speculated`,
`on_speculation_done`, `set_load`, `set_priorities`, `on_preempted`, `set_preempted_kv_bytes`,
`on_adapter_request`, `on_adapter_slots`, `set_lora_requests`) and the front
ends (`on_request_done`, `on_constrained`, `set_ready`, `set_model_info`). prometheus_client's metrics are
thread-safe, so no locking is needed here. The queue's length is not a hook: the scheduler hands a function
(`watch_waiting`) that every scrape calls, so the gauge counts the requests that arrived during a long engine
step, and those whose constraint is still compiling.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from serve.api.metrics.constraints import ConstraintMetrics
from serve.api.metrics.engine import GATEWAY_ALIASES, LoadMetrics, StepMetrics
from serve.api.metrics.lora import LORA_REQUESTS_INFO, LoraMetrics
from serve.api.metrics.process import ProcessMetrics
from serve.api.metrics.requests import RequestMetrics
from serve.api.metrics.speculation import SpeculationMetrics

# What the rest of the project reads: the metrics, and the names an inference gateway reads them by.
__all__ = ["GATEWAY_ALIASES", "LORA_REQUESTS_INFO", "Metrics", "new_registry"]


def new_registry() -> CollectorRegistry:
    """A registry with the standard process, platform and GC collectors, like the default registry."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


class Metrics(
    RequestMetrics,
    StepMetrics,
    LoadMetrics,
    ConstraintMetrics,
    SpeculationMetrics,
    LoraMetrics,
    ProcessMetrics,
):
    """Every `textgen_*` metric, on one registry (a fresh one with the standard collectors by default)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self._define_process()
        self._define_requests()
        self._define_steps()
        self._define_load()
        self._define_constraints()
        self._define_speculation()
        self._define_lora()

    def start_http_server(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Serve this registry at http://addr:port/metrics from a daemon thread; port 0 picks a free port."""
        return prometheus_client.start_http_server(port, addr=addr, registry=self.registry)

    def exposition(self) -> str:
        """The text exposition format of everything in the registry (what /metrics returns)."""
        return prometheus_client.generate_latest(self.registry).decode()

"""LoRA adapters: requests by adapter, slot loads and evictions, and vLLM's gauge of the adapters running
and waiting, which an inference gateway routes by."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# The picker routes a request for a LoRA adapter by this gauge, as vLLM exposes it: labels max_lora (the
# slots), running_lora_adapters and waiting_lora_adapters (comma-separated names); its value is the time the
# labels were set, and the picker reads the series with the latest value. textgen keeps that series alone
# (vLLM leaves the older ones behind), so the gauge does not grow a series per mix of adapters.
LORA_REQUESTS_INFO = "vllm:lora_requests_info"


class LoraMetrics:
    registry: CollectorRegistry

    def _define_lora(self) -> None:
        reg = self.registry
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
        self.lora_requests_info = Gauge(
            LORA_REQUESTS_INFO,
            "Running stats on lora requests.",  # vLLM's help text
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=reg,
        )
        self._lora_labels: tuple[str, str, str] | None = None  # the gauge's one series

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

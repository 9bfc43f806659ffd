"""The server itself: its processes' resident memory, whether it accepts requests, the model it serves."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Info

from serve.process import resident_memory


class ProcessMetrics:
    registry: CollectorRegistry

    def _define_process(self) -> None:
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
        self.ready = Gauge("textgen_ready", "1 when the server accepts requests, else 0.", registry=reg)
        self.model_info = Info("textgen_model", "The model being served.", registry=reg)

    def watch_process(self, name: str, pid: int | str) -> None:
        """Report process `pid`'s resident memory under `process=name`, read from /proc at each scrape."""
        self.resident_memory.labels(process=name).set_function(lambda: resident_memory(pid)[0])
        self.peak_resident_memory.labels(process=name).set_function(lambda: resident_memory(pid)[1])

    def set_ready(self, ready: bool) -> None:
        self.ready.set(1 if ready else 0)

    def set_model_info(self, model: str, dtype: str, quantization: str, provider: str) -> None:
        self.model_info.info(
            {"model": model, "dtype": dtype, "quantization": quantization, "provider": provider}
        )

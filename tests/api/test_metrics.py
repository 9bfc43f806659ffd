"""serve.api.metrics: values read back from the registry, naming conventions, promtool, the HTTP endpoint."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from metric_refs import promtool_input
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread

from serve.api.metrics import GATEWAY_ALIASES, Metrics
from serve.api.metrics.shapes import INTER_TOKEN_BUCKETS, QUEUEING_LATENCY_BUCKETS, TOKEN_COUNT_BUCKETS

# The families issue 7 asks for (the parser names counters without `_total` and info metrics with `_info`).
EXPECTED_FAMILIES = {
    "textgen_process_resident_memory_bytes",
    "textgen_process_peak_resident_memory_bytes",
    "textgen_request_duration_seconds",
    "textgen_request_queue_seconds",
    "textgen_time_to_first_token_seconds",
    "textgen_inter_token_latency_seconds",
    "textgen_request_prompt_tokens",
    "textgen_request_generation_tokens",
    "textgen_batch_size",
    "textgen_step_duration_seconds",
    "textgen_batch_padding_ratio",
    "textgen_requests",
    "textgen_requests_finished",
    "textgen_prompt_tokens",
    "textgen_prompt_tokens_cached",
    "textgen_generation_tokens",
    "textgen_requests_running",
    "textgen_requests_running_by_priority",
    "textgen_requests_waiting",
    "textgen_requests_waiting_by_priority",
    "textgen_kv_cache_slots_used",
    "textgen_kv_cache_slots_capacity",
    "textgen_kv_cache_usage_ratio",
    "textgen_model_info",
    "textgen_ready",
    # issue 28: structured output
    "textgen_constrained_requests",
    "textgen_constraint_compile_seconds",
    "textgen_constraint_masks",
    "textgen_constraint_mask_seconds",
    "textgen_constraint_mask_wait_seconds",
    # speculative decoding
    "textgen_spec_decode_drafts",
    "textgen_spec_decode_draft_tokens",
    "textgen_spec_decode_accepted_tokens",
    "textgen_spec_decode_emitted_tokens",
    "textgen_spec_decode_acceptance_rate",
    # request priority: preemption
    "textgen_preemptions",
    "textgen_preempted_kv_bytes",
    # LoRA adapters
    "textgen_lora_requests",
    "textgen_lora_slot_loads",
    "textgen_lora_slot_evictions",
}


@pytest.fixture
def metrics() -> Metrics:
    return Metrics(CollectorRegistry())


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def exercise(m: Metrics) -> None:
    """One observation through every hook, so every family has samples."""
    m.on_admitted(0.002)
    m.on_first_token(0.05)
    m.on_token(0.012)
    m.on_finished("eos", 7, 9, 4)
    m.on_step("prefill", 3, 0.25, 0.02)
    m.on_step("decode", 3, 0.0, 0.01)
    m.set_load(running=3, kv_used=3, kv_capacity=8)
    m.set_priorities({0: 1, -2: 1}, {0: 3})
    m.watch_waiting(lambda: 1)
    m.on_request_done("Generate", "OK", 0.4)
    m.set_ready(True)
    m.set_model_info("demo", "float32", "none", "CPUExecutionProvider")
    m.on_constrained("tool")
    m.on_masks(3, 0.0004, 0.0001)
    m.on_constraint_compiled(0.002)
    m.on_speculated(5, 3)
    m.on_speculation_done(0.6)
    m.on_preempted(2)
    m.set_preempted_kv_bytes(4096)
    m.on_adapter_request("sql")
    m.on_adapter_slots(2, 1)
    m.set_lora_requests(2, "sql", "poet")


def test_latency_histograms_count_and_sum(metrics: Metrics) -> None:
    queue, ttft, gaps = [0.001, 0.004, 0.5], [0.02, 0.3], [0.01, 0.011, 0.013, 0.2]
    for q in queue:
        metrics.on_admitted(q)
    for t in ttft:
        metrics.on_first_token(t)
    for g in gaps:
        metrics.on_token(g)
    for name, observed in [
        ("textgen_request_queue_seconds", queue),
        ("textgen_time_to_first_token_seconds", ttft),
        ("textgen_inter_token_latency_seconds", gaps),
    ]:
        assert value(metrics, f"{name}_count") == len(observed)
        assert value(metrics, f"{name}_sum") == pytest.approx(sum(observed))
    # 0.01 falls in le=0.01 (inclusive upper bound); 0.011 and 0.013 do not.
    assert value(metrics, "textgen_inter_token_latency_seconds_bucket", le="0.01") == 1
    assert value(metrics, "textgen_inter_token_latency_seconds_bucket", le="0.015") == 3


def test_finished_requests_count_tokens_and_reasons(metrics: Metrics) -> None:
    finished = [("length", 10, 32), ("eos", 5, 3), ("eos", 100, 1), ("stop", 1, 4), ("context", 60, 4)]
    for reason, prompt, generated in finished:
        metrics.on_finished(reason, prompt, generated, prompt // 2)
    assert value(metrics, "textgen_requests_finished_total", reason="eos") == 2
    assert value(metrics, "textgen_requests_finished_total", reason="length") == 1
    assert value(metrics, "textgen_prompt_tokens_total") == 176
    assert value(metrics, "textgen_prompt_tokens_cached_total") == 5 + 2 + 50 + 0 + 30
    assert value(metrics, "textgen_generation_tokens_total") == 44
    assert value(metrics, "textgen_request_prompt_tokens_count") == 5
    assert value(metrics, "textgen_request_prompt_tokens_sum") == 176
    assert value(metrics, "textgen_request_generation_tokens_sum") == 44
    # Token-count buckets are powers of two: 32 generated tokens is within le=32, 4 tokens within le=4.
    assert value(metrics, "textgen_request_generation_tokens_bucket", le="4.0") == 4


def test_constrained_requests_by_kind_and_what_their_masks_cost(metrics: Metrics) -> None:
    for kind in ("json_schema", "tool", "tool"):
        metrics.on_constrained(kind)
    assert value(metrics, "textgen_constrained_requests_total", kind="tool") == 2
    assert value(metrics, "textgen_constrained_requests_total", kind="regex") == 0  # exists before use
    metrics.on_masks(4, 0.002, 0.0005)
    metrics.on_masks(2, 0.001, 0.0)
    assert value(metrics, "textgen_constraint_masks_total") == 6
    assert value(metrics, "textgen_constraint_mask_seconds_total") == pytest.approx(0.003)
    assert value(metrics, "textgen_constraint_mask_wait_seconds_total") == pytest.approx(0.0005)
    metrics.on_constraint_compiled(0.0007)
    assert value(metrics, "textgen_constraint_compile_seconds_count") == 1
    assert value(metrics, "textgen_constraint_compile_seconds_bucket", le="0.001") == 1
    with pytest.raises(ValueError, match="unknown constraint kind 'xml'"):
        metrics.on_constrained("xml")


def test_unused_finish_reasons_exist_at_zero(metrics: Metrics) -> None:
    for reason in ("length", "eos", "stop", "context"):
        assert value(metrics, "textgen_requests_finished_total", reason=reason) == 0


def test_steps_by_phase(metrics: Metrics) -> None:
    metrics.on_step("prefill", 4, 0.5, 0.1)
    metrics.on_step("decode", 4, 0.0, 0.01)
    metrics.on_step("decode", 3, 0.0, 0.02)
    assert value(metrics, "textgen_step_duration_seconds_count", phase="decode") == 2
    assert value(metrics, "textgen_step_duration_seconds_sum", phase="decode") == pytest.approx(0.03)
    assert value(metrics, "textgen_step_duration_seconds_sum", phase="prefill") == pytest.approx(0.1)
    assert value(metrics, "textgen_batch_size_sum") == 11
    assert value(metrics, "textgen_batch_padding_ratio_bucket", le="0.0") == 2
    assert value(metrics, "textgen_batch_padding_ratio_sum") == pytest.approx(0.5)


def test_requests_counted_once_per_call_by_rpc_and_code(metrics: Metrics) -> None:
    done = [("Generate", "OK", 1.0), ("Generate", "OK", 2.0), ("GenerateStream", "CANCELLED", 0.5)]
    done += [("Generate", "RESOURCE_EXHAUSTED", 0.001)]
    for rpc, code, seconds in done:
        metrics.on_request_done(rpc, code, seconds)
    assert value(metrics, "textgen_requests_total", rpc="Generate", code="OK") == 2
    assert value(metrics, "textgen_requests_total", rpc="GenerateStream", code="CANCELLED") == 1
    assert value(metrics, "textgen_requests_total", rpc="Generate", code="RESOURCE_EXHAUSTED") == 1
    assert value(metrics, "textgen_request_duration_seconds_count", rpc="Generate") == 3
    assert value(metrics, "textgen_request_duration_seconds_sum", rpc="Generate") == pytest.approx(3.001)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m.on_finished("cancelled", 1, 1, 0), "unknown finish reason 'cancelled'"),
        (lambda m: m.on_step("verify", 1, 0.0, 0.1), "unknown step phase 'verify'"),
        (lambda m: m.on_request_done("Generate", "ok", 0.1), "unknown status code 'ok'"),
    ],
)
def test_unbounded_label_values_are_refused(metrics: Metrics, call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(metrics)


def test_gauges_follow_load_and_return_to_zero(metrics: Metrics) -> None:
    queue = [7]
    metrics.watch_waiting(lambda: queue[0])
    metrics.set_load(running=4, kv_used=4, kv_capacity=16)
    assert value(metrics, "textgen_requests_waiting") == 7
    assert value(metrics, "textgen_kv_cache_slots_capacity") == 16
    queue[0] = 0  # read at the scrape: no hook call in between
    metrics.set_load(running=0, kv_used=0, kv_capacity=16)
    for name in ("textgen_requests_running", "textgen_requests_waiting", "textgen_kv_cache_slots_used"):
        assert value(metrics, name) == 0


def test_requests_by_priority_and_a_priority_no_longer_seen_reads_zero(metrics: Metrics) -> None:
    waiting, running = "textgen_requests_waiting_by_priority", "textgen_requests_running_by_priority"
    assert value(metrics, waiting, priority="0") == value(metrics, running, priority="0") == 0
    metrics.set_priorities({-3: 2, 10: 1}, {0: 4})
    assert (value(metrics, waiting, priority="-3"), value(metrics, waiting, priority="10")) == (2, 1)
    assert value(metrics, running, priority="0") == 4
    metrics.set_priorities({10: 1}, {})
    assert (value(metrics, waiting, priority="-3"), value(metrics, running, priority="0")) == (0, 0)
    assert value(metrics, waiting, priority="10") == 1


def test_the_inference_gateways_names_repeat_the_load(metrics: Metrics) -> None:
    queue = [7]
    metrics.watch_waiting(lambda: queue[0])
    metrics.set_load(running=4, kv_used=4, kv_capacity=16)
    assert value(metrics, "textgen_kv_cache_usage_ratio") == 0.25
    assert value(metrics, "vllm:num_requests_waiting") == 7
    assert value(metrics, "vllm:num_requests_running") == 4
    assert value(metrics, "vllm:kv_cache_usage_perc") == value(metrics, "vllm:gpu_cache_usage_perc") == 0.25
    queue[0] = 0
    metrics.set_load(running=0, kv_used=0, kv_capacity=0)
    for name in GATEWAY_ALIASES:
        assert value(metrics, name) == 0
    promtool = shutil.which("promtool")
    if promtool is not None:  # the aliases are exactly what promtool's lint flags
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=metrics.exposition(), capture_output=True, text=True
        )
        flagged = {line.split()[0] for line in (lint.stdout + lint.stderr).splitlines() if "':'" in line}
        assert flagged == set(GATEWAY_ALIASES)


def test_ready_and_model_info(metrics: Metrics) -> None:
    assert value(metrics, "textgen_ready") == 0
    metrics.set_ready(True)
    assert value(metrics, "textgen_ready") == 1
    metrics.set_model_info("demo", "float32", "none", "CPUExecutionProvider")
    metrics.set_model_info("demo", "float16", "none", "CUDAExecutionProvider")
    labels = {
        "model": "demo",
        "dtype": "float16",
        "quantization": "none",
        "provider": "CUDAExecutionProvider",
    }
    assert value(metrics, "textgen_model_info", **labels) == 1
    # Setting it again replaces the series instead of adding a second one.
    infos = [s for f in text_string_to_metric_families(metrics.exposition()) for s in f.samples]
    assert [s.labels for s in infos if s.name == "textgen_model_info"] == [labels]


def test_instances_are_isolated() -> None:
    a, b = Metrics(CollectorRegistry()), Metrics(CollectorRegistry())
    a.on_admitted(1.0)
    assert value(b, "textgen_request_queue_seconds_count") == 0


def test_default_registry_has_standard_collectors() -> None:
    names = {f.name for f in text_string_to_metric_families(Metrics().exposition())}
    assert {"process_resident_memory_bytes", "python_gc_collections", "python_info"} <= names


def test_buckets_span_the_quantities() -> None:
    assert QUEUEING_LATENCY_BUCKETS[0] <= 0.001 and QUEUEING_LATENCY_BUCKETS[-1] >= 300
    assert INTER_TOKEN_BUCKETS[0] <= 0.001 and 2 <= INTER_TOKEN_BUCKETS[-1] <= 10
    assert TOKEN_COUNT_BUCKETS[0] == 1 and TOKEN_COUNT_BUCKETS[-1] >= 32768
    for buckets in (QUEUEING_LATENCY_BUCKETS, INTER_TOKEN_BUCKETS, TOKEN_COUNT_BUCKETS):
        assert list(buckets) == sorted(set(buckets))


def test_names_follow_prometheus_conventions(metrics: Metrics) -> None:
    exercise(metrics)
    # In text format 0.0.4 the `_created` timestamps of counters and histograms parse as separate families.
    families = [
        f
        for f in text_string_to_metric_families(metrics.exposition())
        if f.name.startswith("textgen_") and not f.name.endswith("_created")
    ]
    assert {f.name for f in families} == EXPECTED_FAMILIES
    for family in families:
        assert re.fullmatch(r"textgen_[a-z][a-z0-9_]*[a-z0-9]", family.name), family.name
        assert family.documentation, family.name
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {f"{family.name}_total", f"{family.name}_created"}
        if "duration" in family.name or "latency" in family.name or "time" in family.name:
            assert family.name.endswith("_seconds"), family.name
        for sample in family.samples:
            assert not {"request_id", "prompt", "id"} & set(sample.labels), sample


def test_promtool_check_metrics(metrics: Metrics) -> None:
    exercise(metrics)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool absent: install Debian's prometheus package (.ci/system-deps.sh does in CI)")
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=promtool_input(metrics.exposition()),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_http_endpoint_serves_the_registry(metrics: Metrics) -> None:
    metrics.set_ready(True)
    server, thread = metrics.start_http_server(0, addr="127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        assert "textgen_ready 1.0" in body.splitlines()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_each_process_reports_its_resident_memory_and_its_peak(metrics: Metrics) -> None:
    rss = value(metrics, "textgen_process_resident_memory_bytes", process="server")
    peak = value(metrics, "textgen_process_peak_resident_memory_bytes", process="server")
    assert (
        rss is not None and peak is not None and 10 * 2**20 < rss <= peak
    )  # a Python process with prometheus-client loaded holds more than 10 MiB
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    metrics.watch_process("engine", gone.pid)  # a process no longer there reads 0, not an error
    assert value(metrics, "textgen_process_resident_memory_bytes", process="engine") == 0


def test_a_server_reports_its_engine_process_memory(loop: LoopThread, tiny_bundle: Path) -> None:
    server = RunningServer(loop, loopback_settings(tiny_bundle))
    try:
        pid = server.model.scheduler.pid  # type: ignore[attr-defined]
        engine = server.metric("textgen_process_resident_memory_bytes", process="engine")
        status = Path(f"/proc/{pid}/status").read_text()
        rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024
        assert engine == pytest.approx(rss, rel=0.2)
        assert server.metric("textgen_process_peak_resident_memory_bytes", process="engine") >= engine
    finally:
        loop.run(server.server.stop())


def test_adapters_are_counted_and_the_gateway_reads_them_as_from_vllm(metrics: Metrics) -> None:
    """textgen's per-adapter and slot counters, and vLLM's lora_requests_info: its labels the adapters of
    running and waiting requests, its value the time they changed, one series at a time."""
    for adapter in ("sql", "sql", "poet"):
        metrics.on_adapter_request(adapter)
    metrics.on_adapter_slots(3, 0)
    metrics.on_adapter_slots(1, 1)
    assert value(metrics, "textgen_lora_requests_total", adapter="sql") == 2
    assert value(metrics, "textgen_lora_requests_total", adapter="poet") == 1
    assert value(metrics, "textgen_lora_slot_loads_total") == 4
    assert value(metrics, "textgen_lora_slot_evictions_total") == 1
    before = time.time()
    metrics.set_lora_requests(2, "sql,poet", "chef")
    first = {"max_lora": "2", "running_lora_adapters": "sql,poet", "waiting_lora_adapters": "chef"}
    assert before <= (value(metrics, "vllm:lora_requests_info", **first) or 0) <= time.time()
    metrics.set_lora_requests(2, "", "")
    idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert value(metrics, "vllm:lora_requests_info", **first) is None
    assert (value(metrics, "vllm:lora_requests_info", **idle) or 0) >= before

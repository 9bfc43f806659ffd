"""Issue 7 end to end: the metrics of a real server after real gRPC traffic, checked against what the clients
saw, by `promtool check metrics`, against the deploy files, and through a real Prometheus server's query API.

The traffic is one fixed mix (`send_traffic`): Generate and GenerateStream calls of known prompt and output
lengths, two INVALID_ARGUMENT calls and one stream the client cancels after its first token. Every figure
the tests expect comes from the clients' side of those calls (status codes, usage, timings), not the server.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from engine_faults import InjectedFaults
from metric_refs import missing_metrics, promtool_input
from prometheus_client.parser import text_string_to_metric_families
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, rpc_error

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

# Token-id prompts, so their lengths are known before the server answers, with the tokens each asks for.
GENERATE_CALLS = [([5, 6, 7], 4), ([8] * 7, 6), (list(range(20, 32)), 9)]
STREAM_CALL = ([9, 10], 5)
CANCELLED_MAX_NEW_TOKENS = 30
# Request content that must never reach the metrics port (labels are bounded; no request ids or prompts).
SECRET_PROMPT = "zebra quartz lantern 7731"
SECRET_REQUEST_ID = "confidential-request-4711"
IDLE_GAUGES = ("textgen_requests_running", "textgen_requests_waiting", "textgen_kv_cache_slots_used")
TTFT_P99 = "histogram_quantile(0.99, rate(textgen_time_to_first_token_seconds_bucket[1m]))"


# --- what the clients saw -----------------------------------------------------------------------------------


@dataclass
class Ledger:
    """The client side of the traffic: every call's rpc and final code, and the usage of finished calls."""

    codes: Counter[tuple[str, str]] = field(default_factory=Counter)
    usages: list[pb.Usage] = field(default_factory=list)
    generate_ttfts: list[float] = field(default_factory=list)  # as reported in GenerateResponse
    cancelled_tokens: int = 0  # tokens the cancelled streams' clients received before cancelling

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    def by_rpc(self) -> Counter[str]:
        calls: Counter[str] = Counter()
        for (rpc, _code), n in self.codes.items():
            calls[rpc] += n
        return calls

    def finished(self, rpc: str, usage: pb.Usage) -> None:
        self.codes[rpc, "OK"] += 1
        self.usages.append(usage)


def by_ids(ids: list[int], max_new_tokens: int, **fields: Any) -> pb.GenerateRequest:
    # ignore_eos: the output length is exactly max_new_tokens, whatever the random weights predict.
    stopping = pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stopping=stopping, **fields)


def _successful_calls(stub: pb_grpc.TextGenerationStub, ledger: Ledger) -> None:
    for ids, n in GENERATE_CALLS:
        response = stub.Generate(by_ids(ids, n))
        assert response.usage == pb.Usage(prompt_tokens=len(ids), completion_tokens=n)
        ledger.finished("Generate", response.usage)
        ledger.generate_ttfts.append(response.time_to_first_token_seconds)
    ids, n = STREAM_CALL
    *body, last = stub.GenerateStream(by_ids(ids, n))
    assert sum(len(part.token_ids) for part in body) == n
    assert last.usage == pb.Usage(prompt_tokens=len(ids), completion_tokens=n)
    ledger.finished("GenerateStream", last.usage)
    secret = pb.GenerateRequest(
        text=SECRET_PROMPT,
        request_id=SECRET_REQUEST_ID,
        stopping=pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True),
    )
    *_, last = stub.GenerateStream(secret)
    assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens > 0
    ledger.finished("GenerateStream", last.usage)


def _invalid_calls(stub: pb_grpc.TextGenerationStub, ledger: Ledger) -> None:
    no_input = pb.GenerateRequest()
    negative_temperature = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1))
    for rpc, call in [
        ("Generate", lambda: stub.Generate(no_input)),
        ("GenerateStream", lambda: stub.GenerateStream(negative_temperature)),
    ]:
        code = rpc_error(call).code()
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        ledger.codes[rpc, code.name] += 1


def _cancelled_stream(stub: pb_grpc.TextGenerationStub, running: RunningServer, ledger: Ledger) -> None:
    # Its slowed decode (InjectedFaults) keeps it generating while the client cancels after its first token.
    call = stub.GenerateStream(by_ids([11, 12, 13], CANCELLED_MAX_NEW_TOKENS, request_id="slow-cancelled"))
    first = next(call)
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    running.wait_idle()
    ledger.codes["GenerateStream", "CANCELLED"] += 1
    ledger.cancelled_tokens += len(first.token_ids)


def send_traffic(running: RunningServer) -> Ledger:
    """The fixed mix of calls, on a channel of its own; returns what the clients saw."""
    ledger = Ledger()
    with grpc.insecure_channel(running.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        _successful_calls(stub, ledger)
        _invalid_calls(stub, ledger)
        _cancelled_stream(stub, running, ledger)
    running.wait_idle()
    return ledger


# --- the scrape ---------------------------------------------------------------------------------------------


class Scrape:
    """One text exposition from the metrics port, with its samples looked up by name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        return {frozenset(s.labels.items()): s.value for s in self.samples if s.name == name}

    def value(self, name: str, **labels: str) -> float:
        found = self.series(name).get(frozenset(labels.items()))
        assert found is not None, f"no sample {name}{labels} in the scrape"
        return found

    def total(self, name: str) -> float:
        return sum(self.series(name).values())


def scrape(running: RunningServer) -> Scrape:
    url = f"http://127.0.0.1:{running.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        return Scrape(response.read().decode())


def settled_scrape(running: RunningServer, requests: int, timeout: float = 10.0) -> Scrape:
    """The first scrape that counts `requests` requests with the load gauges at zero, or the last one taken
    when `timeout` passes (the tests' assertions then say what differs).

    Waiting is needed: a call's status reaches the client a moment before or after the server counts it,
    and the gauges are set by the engine thread just after the scheduler reports it is idle."""
    deadline = time.monotonic() + timeout
    while True:
        taken = scrape(running)
        counted = taken.total("textgen_requests_total") == requests
        idle = all(taken.value(gauge) == 0 for gauge in IDLE_GAUGES)
        if (counted and idle) or time.monotonic() > deadline:
            return taken
        time.sleep(0.02)


@contextlib.contextmanager
def serving(loop: LoopThread, bundle: Path) -> Iterator[RunningServer]:
    running = RunningServer(loop, loopback_settings(bundle, max_batch_size=4), InjectedFaults())
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def server(loop: LoopThread, tiny_bundle: Path) -> Iterator[RunningServer]:
    with serving(loop, tiny_bundle) as running:
        yield running


@pytest.fixture(scope="module")
def traffic(server: RunningServer) -> tuple[Ledger, Scrape]:
    ledger = send_traffic(server)
    return ledger, settled_scrape(server, ledger.total)


# --- part 1: the live scrape --------------------------------------------------------------------------------


def test_promtool_accepts_the_live_scrape(traffic: tuple[Ledger, Scrape]) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool absent: install Debian's prometheus package (.ci/system-deps.sh does in CI)")
    _ledger, taken = traffic
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=promtool_input(taken.text),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_deploy_files_reference_only_live_metrics(traffic: tuple[Ledger, Scrape]) -> None:
    _ledger, taken = traffic
    assert missing_metrics(taken.text) == {}


def test_each_request_is_counted_once_by_rpc_and_code(traffic: tuple[Ledger, Scrape]) -> None:
    ledger, taken = traffic
    series = taken.series("textgen_requests_total")
    counted = {(dict(key)["rpc"], dict(key)["code"]): value for key, value in series.items()}
    assert counted == {key: float(n) for key, n in ledger.codes.items()}
    for rpc, n in ledger.by_rpc().items():
        assert taken.value("textgen_request_duration_seconds_count", rpc=rpc) == n


def test_ttft_and_queue_time_are_observed_once_per_request_that_produced_a_token(
    traffic: tuple[Ledger, Scrape],
) -> None:
    ledger, taken = traffic
    produced = len(ledger.usages) + ledger.codes["GenerateStream", "CANCELLED"]
    assert taken.value("textgen_time_to_first_token_seconds_count") == produced
    assert taken.value("textgen_request_queue_seconds_count") == produced  # refused calls never queue
    # The server times TTFT once, for the response and the histogram alike.
    assert taken.value("textgen_time_to_first_token_seconds_sum") >= sum(ledger.generate_ttfts) - 1e-6


def test_inter_token_latency_is_observed_between_consecutive_tokens(traffic: tuple[Ledger, Scrape]) -> None:
    ledger, taken = traffic
    finished_gaps = sum(u.completion_tokens - 1 for u in ledger.usages)
    # The cancelled stream generated at least what its client received and at most what it asked for.
    cancelled = ledger.codes["GenerateStream", "CANCELLED"]
    low = finished_gaps + ledger.cancelled_tokens - cancelled
    high = finished_gaps + cancelled * (CANCELLED_MAX_NEW_TOKENS - 1)
    assert low <= taken.value("textgen_inter_token_latency_seconds_count") <= high


def test_token_totals_match_the_usage_clients_received(traffic: tuple[Ledger, Scrape]) -> None:
    ledger, taken = traffic
    prompt = sum(u.prompt_tokens for u in ledger.usages)
    generated = sum(u.completion_tokens for u in ledger.usages)
    assert taken.value("textgen_prompt_tokens_total") == prompt
    assert taken.value("textgen_generation_tokens_total") == generated
    assert taken.value("textgen_request_prompt_tokens_sum") == prompt
    assert taken.value("textgen_request_generation_tokens_sum") == generated
    assert taken.value("textgen_request_prompt_tokens_count") == len(ledger.usages)
    # Only normal ends are finishes; every one here stopped at max_new_tokens.
    finished = {dict(k)["reason"]: v for k, v in taken.series("textgen_requests_finished_total").items()}
    assert finished == {"length": len(ledger.usages), "eos": 0, "stop": 0, "context": 0}


def test_gauges_are_zero_when_idle_and_ready_is_one(
    traffic: tuple[Ledger, Scrape], server: RunningServer
) -> None:
    _ledger, taken = traffic
    for gauge in IDLE_GAUGES:
        assert taken.value(gauge) == 0, gauge
    assert taken.value("textgen_kv_cache_slots_capacity") == server.model.info.max_batch_size
    assert taken.value("textgen_ready") == 1


def test_the_metrics_port_exposes_no_request_content(traffic: tuple[Ledger, Scrape]) -> None:
    _ledger, taken = traffic
    assert SECRET_PROMPT not in taken.text
    assert SECRET_REQUEST_ID not in taken.text
    assert "zebra" not in taken.text  # not even a fragment of the prompt


# --- part 2: a real Prometheus ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """A Prometheus server process scraping one target every second, queried over its HTTP API."""

    def __init__(self, binary: str, target: str, directory: Path) -> None:
        config = directory / "prometheus.yml"
        job = {
            "job_name": "textgen",
            "scrape_interval": "1s",
            "scrape_timeout": "1s",  # may not exceed the interval
            "static_configs": [{"targets": [target]}],
        }
        config.write_text(json.dumps({"scrape_configs": [job]}))  # JSON is YAML
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = directory / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self._log_tail()}")
            # Refused until it listens; 503 (an HTTPError, so an OSError) until it is ready.
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"prometheus was not ready in {timeout} s:\n{self._log_tail()}")

    def query(self, expr: str) -> list[float]:
        """The values of an instant query's result vector, evaluated now."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
        assert answer["status"] == "success", answer
        assert answer["data"]["resultType"] == "vector", answer
        return [float(item["value"][1]) for item in answer["data"]["result"]]

    def one(self, expr: str) -> float:
        values = self.query(expr)
        assert len(values) == 1, f"{expr} returned {values}"
        return values[0]

    def wait_for_scrape_after(self, since: float, timeout: float = 15.0) -> None:
        """Until Prometheus holds a scrape of the target that began after `since` (Unix seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            latest = self.query("timestamp(textgen_ready)")
            if latest and latest[0] > since:
                return
            time.sleep(0.2)
        raise AssertionError(f"no scrape after {since} within {timeout} s:\n{self._log_tail()}")


@contextlib.contextmanager
def prometheus(target: str, directory: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus absent: install Debian's prometheus package (.ci/system-deps.sh does in CI)")
    server = Prometheus(binary, target, directory)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_a_real_prometheus_scrapes_and_answers_queries(
    loop: LoopThread, tiny_bundle: Path, tmp_path: Path
) -> None:
    # A server of its own, so its counters hold exactly this test's traffic.
    with serving(loop, tiny_bundle) as running:
        target = f"127.0.0.1:{running.server.metrics_port}"
        with prometheus(target, tmp_path) as prom:
            # A scrape before the traffic, so rate() over the window sees the counters increase.
            prom.wait_for_scrape_after(0.0)
            ledger = send_traffic(running)
            settled_scrape(running, ledger.total)
            prom.wait_for_scrape_after(time.time())
            assert prom.one("up") == 1
            assert prom.one("count_over_time(textgen_ready[1m])") >= 2
            p99 = prom.one(TTFT_P99)
            assert math.isfinite(p99) and p99 > 0, p99
            assert prom.one("sum(textgen_requests_total)") == ledger.total
            cancelled = prom.one('sum(textgen_requests_total{code="CANCELLED"})')
            assert cancelled == ledger.codes["GenerateStream", "CANCELLED"]

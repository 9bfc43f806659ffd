"""`textgen-bench`: a gRPC load generator for a running textgen server, reporting like `vllm bench serve`.

    textgen-bench --target localhost:50051 --concurrency 16 --num-requests 128 --max-new-tokens 128 \\
        --ignore-eos --output results.json --metrics-url http://localhost:8000/metrics

Every request is a `GenerateStream` call (the client timestamps each streamed message that carries tokens),
or with `--rpc unary` a `Generate` call (one reply: throughput and end-to-end latency, no TTFT or ITL), or
with `--rpc http --http-target HOST:PORT` a streamed OpenAI `/v1/completions` call on the server's HTTP API
(each SSE chunk timed as a message; a lean client of its own on raw asyncio streams with keep-alive
connections, so the client's cost does not decide the figure; `--target` still serves GetModelInfo and
Tokenize).
Definitions (those of vLLM's benchmark, so figures compare):
- TTFT: from sending the request to the first message with a token.
- TPOT: per request, (end-to-end latency - TTFT) / (output tokens - 1); requests with one token have none.
- ITL: every gap between consecutive token-bearing messages, pooled over all requests.
- E2EL: from sending the request to the end of its stream.
Throughputs divide by the benchmark's wall time (first request sent to last stream ended).

Load shapes: closed loop (`--concurrency` clients, each sends its next request when the last ends) or open
loop (`--request-rate`, Poisson arrivals; `--concurrency` then caps requests in flight). A request is sent
when the load shape lets it through (its arrival; with a cap, when a place frees), and a duration-bound run
lets nothing through after its end. Prompts are random
token ids (`--dataset synthetic`, sent as `token_ids`) or text windows from the Python stdlib sources
(`--dataset corpus`, sent as `text`, cut to length with the server's Tokenize RPC).

LoRA adapters: `--models a,b,c,d` spreads the requests over adapters the server loaded (`textgen-serve
--lora`), round-robin, each naming one in the gRPC `adapter` field or the OpenAI `model` field (an empty
name, as in `a,,b`: the base model). The lora scenario drives llama-server's adapters the same way, through
its per-request `lora` field (LoadConfig.adapter_field).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import sysconfig
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, TypeVar

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.cpus import pinned
from bench.report import write_json
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.process import check_cpus, parse_cpu_list

Dataset = Literal["synthetic", "corpus"]
Rpc = Literal["stream", "unary", "http"]
# Where an HTTP request names its LoRA adapter: OpenAI's `model` (textgen), or llama-server's per-request
# `lora` list, the name being the adapter's index in the server's --lora order
AdapterField = Literal["model", "lora"]
T = TypeVar("T")
# The server's name of each, as its request counter labels it.
RPC_NAMES: dict[str, str] = {"stream": "GenerateStream", "unary": "Generate", "http": "/v1/completions"}
# Duration-bound runs cycle through this many prepared prompts.
DURATION_PROMPT_POOL = 256
# Characters per token to start from when cutting corpus text; corrected by tokenizing.
CHARS_PER_TOKEN_GUESS = 4


@dataclass(frozen=True)
class LoadConfig:
    target: str
    concurrency: int | None = None  # closed loop: clients (default 1); open loop: cap on requests in flight
    request_rate: float | None = None  # requests/s, Poisson arrivals; None: closed loop
    num_requests: int | None = 64
    duration: float | None = None  # seconds; replaces num_requests
    input_len: int = 32
    input_len_spread: float = 0.0  # prompt length uniform in input_len * [1 - spread, 1 + spread]
    max_new_tokens: int = 128
    output_len_spread: float = 0.0
    ignore_eos: bool = False
    dataset: Dataset = "synthetic"
    temperature: float = 0.0
    seed: int = 0
    timeout: float = 600.0  # per request, seconds
    percentiles: tuple[float, ...] = (99.0,)
    progress: bool = True
    rpc: Rpc = "stream"
    cpus: tuple[int, ...] | None = None  # the load generator's CPUs (off the engine's); None: anywhere
    http_target: str | None = None  # HOST:PORT of the HTTP API (rpc "http")
    models: tuple[str, ...] = ()  # LoRA adapters the requests name in turn ("": the base model); (): none
    adapter_field: AdapterField = "model"

    def __post_init__(self) -> None:
        if (self.num_requests is None) == (self.duration is None):
            raise ValueError("give exactly one of num_requests and duration")
        checks = {
            "concurrency": self.concurrency is None or self.concurrency >= 1,
            "request_rate": self.request_rate is None or self.request_rate > 0,
            "num_requests": self.num_requests is None or self.num_requests >= 1,
            "duration": self.duration is None or self.duration > 0,
            "input_len": self.input_len >= 1,
            "max_new_tokens": self.max_new_tokens >= 1,
            "input_len_spread": 0.0 <= self.input_len_spread < 1.0,
            "output_len_spread": 0.0 <= self.output_len_spread < 1.0,
            "timeout": self.timeout > 0,
            "percentiles": all(0.0 < p < 100.0 for p in self.percentiles),
            "rpc": self.rpc in RPC_NAMES,
            "cpus": self.cpus is None or bool(self.cpus),
            "http_target": (self.rpc == "http") == (self.http_target is not None),
            "adapter_field": self.adapter_field == "model"
            or all(name == "" or name.isdigit() for name in self.models),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid load settings: {', '.join(bad)} (see textgen-bench --help)")

    @property
    def closed_loop(self) -> bool:
        return self.request_rate is None


# --- the workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    text: str | None
    token_ids: tuple[int, ...]
    max_new_tokens: int

    def message(self, request_id: str, config: LoadConfig, adapter: str = "") -> pb.GenerateRequest:
        stopping = pb.StoppingCriteria(max_new_tokens=self.max_new_tokens, ignore_eos=config.ignore_eos)
        sampling = pb.SamplingParams(temperature=config.temperature)
        if config.temperature > 0:
            sampling.seed = config.seed
        if self.text is not None:
            return pb.GenerateRequest(
                request_id=request_id, text=self.text, sampling=sampling, stopping=stopping, adapter=adapter
            )
        return pb.GenerateRequest(
            request_id=request_id,
            token_ids=pb.TokenIds(ids=self.token_ids),
            sampling=sampling,
            stopping=stopping,
            adapter=adapter,
        )


def sample_length(mean: int, spread: float, rng: random.Random) -> int:
    low, high = max(1, round(mean * (1 - spread))), max(1, round(mean * (1 + spread)))
    return rng.randint(low, high)


def synthetic_ids(length: int, vocab_size: int, eos_token_id: int, rng: random.Random) -> tuple[int, ...]:
    """Uniform random ids, EOS excluded (a prompt made of EOS tokens is not a realistic input)."""
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(vocab_size)
        if token != eos_token_id:
            ids.append(token)
    return tuple(ids)


def stdlib_texts(limit_files: int = 200) -> list[str]:
    """The Python stdlib's own sources: text that is on every machine that runs this tool."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py"))[:limit_files]:
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > 4096:
            texts.append(text)
    if not texts:
        raise RuntimeError(f"no Python sources found under {root} for --dataset corpus")
    return texts


def corpus_window(texts: Sequence[str], chars: int, rng: random.Random) -> str:
    text = texts[rng.randrange(len(texts))]
    chars = min(chars, len(text))
    start = rng.randrange(len(text) - chars + 1)
    return text[start : start + chars]


def cut_to_tokens(text: str, length: int, count_tokens: Callable[[str], int]) -> str:
    """The longest prefix of `text` found, by proportional cuts, that has at most `length` tokens."""
    tokens = count_tokens(text)
    while tokens > length and len(text) > 1:
        text = text[: max(1, min(len(text) - 1, len(text) * length // tokens))]
        tokens = count_tokens(text)
    return text


def build_prompts(
    config: LoadConfig, count: int, info: pb.ModelInfo, count_tokens: Callable[[str], int]
) -> list[Prompt]:
    rng = random.Random(config.seed)
    texts = stdlib_texts() if config.dataset == "corpus" else []
    prompts = []
    for _ in range(count):
        length = sample_length(config.input_len, config.input_len_spread, rng)
        new_tokens = sample_length(config.max_new_tokens, config.output_len_spread, rng)
        if config.dataset == "corpus":
            window = corpus_window(texts, length * CHARS_PER_TOKEN_GUESS, rng)
            prompts.append(Prompt(cut_to_tokens(window, length, count_tokens), (), new_tokens))
        else:
            ids = synthetic_ids(length, info.vocab_size, info.eos_token_id, rng)
            prompts.append(Prompt(None, ids, new_tokens))
    return prompts


# --- one request -------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `start` relative to the benchmark's start."""

    request_id: str
    start: float
    success: bool = False
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage message
    output_tokens: int = 0  # token ids received
    token_ids: list[int] = field(default_factory=list)  # streamed: the ids received, in order
    finish_reason: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def record_json(record: RequestRecord) -> dict[str, object]:
    """A record as the output file keeps it: its timings and counts, with TPOT, without the token ids."""
    fields = {name: value for name, value in asdict(record).items() if name != "token_ids"}
    return fields | {"tpot": record.tpot}


async def send(
    stub: pb_grpc.TextGenerationStub | None,
    message: pb.GenerateRequest,
    origin: float,
    sent: float,
    timeout: float,
    rpc: Rpc = "stream",
    http: HttpConnections | None = None,
    adapter_field: AdapterField = "model",
) -> RequestRecord:
    """`sent` is when the load shape issued the request (its arrival), not when this task got to run."""
    record = RequestRecord(request_id=message.request_id, start=sent - origin)
    if http is not None:
        try:
            await asyncio.wait_for(
                http.stream(completion_body(message, adapter_field), sent, record), timeout
            )
            record.success = True
        except (HttpFailure, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.latency = time.perf_counter() - sent
        return record
    assert stub is not None, "a gRPC call needs the server's stub"
    try:
        if rpc == "stream":
            await _read_stream(stub.GenerateStream(message, timeout=timeout), sent, record)
        else:  # the client sees the completion only at the end: no TTFT, no ITL
            reply = await stub.Generate(message, timeout=timeout)
            record.output_tokens = len(reply.token_ids)
            _read_usage(reply, record)
        record.success = True
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    record.latency = time.perf_counter() - sent
    return record


async def _read_stream(
    replies: AsyncIterator[pb.GenerateStreamResponse], sent: float, record: RequestRecord
) -> None:
    last: float | None = None
    async for reply in replies:
        now = time.perf_counter()
        if reply.token_ids:
            if last is None:
                record.ttft = now - sent
            else:
                record.itl.append(now - last)
            last = now
            record.output_tokens += len(reply.token_ids)
            record.token_ids.extend(reply.token_ids)
        if reply.HasField("usage"):
            _read_usage(reply, record)


class HttpConnections:
    """Keep-alive HTTP/1.1 connections to the server's HTTP API, one per request in flight at most, and a
    reader of OpenAI's streamed completions on raw asyncio streams (chunked transfer encoding, SSE)."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.host, self.port = host.strip("[]") or "127.0.0.1", int(port)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection, and whether it is a kept one (which the server may have closed since)."""
        if self._idle:
            return (*self._idle.pop(), True)
        return (*await asyncio.open_connection(self.host, self.port), False)

    def close(self) -> None:
        for _reader, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def stream(self, body: bytes, sent: float, record: RequestRecord) -> None:
        reader, writer, kept = await self._connection()
        reusable = False
        try:
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-Request-Id: {record.request_id}\r\n\r\n"
            ).encode()
            writer.write(head + body)
            status = await reader.readline()
            if not status and kept:  # the server closed the kept connection (llama-server may): a fresh one
                writer.close()
                reader, writer = await asyncio.open_connection(self.host, self.port)
                writer.write(head + body)
                status = await reader.readline()
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            code = int(status.split()[1])
            if code != 200:
                length = int(headers.get("content-length", "0"))
                text = (await reader.readexactly(length)).decode() if length else ""
                raise HttpFailure(f"HTTP {code}: {text[:200]}")
            await self._read_events(reader, sent, record)
            reusable = headers.get("connection", "").lower() != "close"
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    @staticmethod
    async def _read_events(reader: asyncio.StreamReader, sent: float, record: RequestRecord) -> None:
        last: float | None = None
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                await reader.readline()  # the chunked body's last CRLF
                return
            pending += await reader.readexactly(size)
            await reader.readexactly(2)
            now = time.perf_counter()
            *events, pending = pending.split(b"\n\n")
            for event in events:
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    raise HttpFailure(chunk["error"]["message"])
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    if choice.get("finish_reason") is not None:
                        record.finish_reason = choice["finish_reason"]
                        continue
                    if last is None:  # every chunk but the last carries the tokens of one step or more
                        record.ttft = now - sent
                    else:
                        record.itl.append(now - last)
                    last = now


class HttpFailure(Exception):
    pass


def completion_body(message: pb.GenerateRequest, adapter_field: AdapterField = "model") -> bytes:
    """The OpenAI /v1/completions body of a GenerateRequest, streamed with usage, naming its adapter (if any)
    in `adapter_field`."""
    body: dict[str, object] = {
        "prompt": message.text if message.WhichOneof("input") == "text" else list(message.token_ids.ids),
        "max_tokens": message.stopping.max_new_tokens,
        "temperature": message.sampling.temperature,
        "ignore_eos": message.stopping.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if message.sampling.HasField("seed"):
        body["seed"] = message.sampling.seed
    if message.adapter:
        body[adapter_field] = (
            message.adapter if adapter_field == "model" else [{"id": int(message.adapter), "scale": 1.0}]
        )
    return json.dumps(body).encode()


def _read_usage(reply: pb.GenerateResponse | pb.GenerateStreamResponse, record: RequestRecord) -> None:
    record.prompt_tokens = reply.usage.prompt_tokens
    record.finish_reason = pb.FinishReason.Name(reply.finish_reason)


# --- load shapes -------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float


class _Issued(NamedTuple):
    message: pb.GenerateRequest
    at: float  # the time.perf_counter() the plan issued it at: before the end of a duration-bound run


_Issue = Callable[[pb.GenerateRequest, float], "asyncio.Future[RequestRecord]"]


class _Plan:
    """Hands out requests until the count is reached or the duration has passed."""

    def __init__(self, config: LoadConfig, prompts: list[Prompt], origin: float) -> None:
        self._config = config
        self._prompts = prompts
        self._end = None if config.duration is None else origin + config.duration
        self._issued = 0

    def next(self) -> _Issued | None:
        if self._config.num_requests is not None and self._issued >= self._config.num_requests:
            return None
        now = time.perf_counter()  # a request's start is this check's time, never past the end
        if self._end is not None and now >= self._end:
            return None
        prompt = self._prompts[self._issued % len(self._prompts)]
        models = self._config.models
        adapter = models[self._issued % len(models)] if models else ""
        self._issued += 1
        return _Issued(prompt.message(f"bench-{self._issued - 1}", self._config, adapter), now)


async def _closed_loop(plan: _Plan, clients: int, issue: _Issue) -> list[RequestRecord]:
    async def client() -> list[RequestRecord]:
        done = []
        while (issued := plan.next()) is not None:
            done.append(await issue(*issued))
        return done

    per_client = await asyncio.gather(*(client() for _ in range(clients)))
    return [record for records in per_client for record in records]


async def _open_loop(
    plan: _Plan,
    rate: float,
    cap: int | None,
    rng: random.Random,
    issue: _Issue,
) -> list[RequestRecord]:
    limit = asyncio.Semaphore(cap) if cap is not None else None

    async def bounded(issued: _Issued) -> RequestRecord:
        if limit is None:
            return await issue(*issued)
        async with limit:  # a request waiting for a free place starts when it gets one
            return await issue(issued.message, time.perf_counter())

    tasks = []
    issued = plan.next()
    while issued is not None:
        tasks.append(asyncio.ensure_future(bounded(issued)))
        issued = plan.next()
        if issued is not None:  # no gap after the last arrival: it would only lengthen the run
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def run_load(
    config: LoadConfig, stub: pb_grpc.TextGenerationStub | None, prompts: list[Prompt]
) -> RunResult:
    """The load over gRPC (`stub`), or over HTTP (`config.http_target`; then `stub` may be None: any
    OpenAI-compatible server)."""
    total = config.num_requests
    bar = tqdm(total=total, unit="req", disable=not config.progress, file=sys.stderr, leave=False)
    origin = time.perf_counter()
    plan = _Plan(config, prompts, origin)

    http = HttpConnections(config.http_target) if config.http_target is not None else None

    def issue(message: pb.GenerateRequest, sent: float) -> asyncio.Future[RequestRecord]:
        future = asyncio.ensure_future(
            send(stub, message, origin, sent, config.timeout, config.rpc, http, config.adapter_field)
        )
        future.add_done_callback(lambda _f: bar.update(1))
        return future

    if config.closed_loop:
        records = await _closed_loop(plan, config.concurrency or 1, issue)
    else:
        assert config.request_rate is not None
        rng = random.Random(config.seed + 1)
        records = await _open_loop(plan, config.request_rate, config.concurrency, rng, issue)
    duration = time.perf_counter() - origin
    bar.close()
    if http is not None:
        http.close()
    records.sort(key=lambda r: r.start)
    return RunResult(records, duration)


# --- statistics --------------------------------------------------------------------------------------------


def distribution(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median and the given percentiles of `values_s` (seconds), in milliseconds; NaN when empty."""
    values = np.asarray(values_s, dtype=np.float64) * 1e3
    extra = [p for p in percentiles if p != 50.0]  # the 50th is the median, reported anyway
    out = {"mean": math.nan, "median": math.nan} | {_pname(p): math.nan for p in extra}
    if values.size:
        out["mean"] = float(values.mean())
        out["median"] = float(np.median(values))
        for p in extra:
            out[_pname(p)] = float(np.percentile(values, p))
    return out


def _pname(p: float) -> str:
    return f"p{p:g}"


def summarize(result: RunResult, percentiles: Sequence[float]) -> dict[str, object]:
    ok = [r for r in result.records if r.success]
    inputs = sum(r.prompt_tokens for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    duration = result.duration
    return {
        "successful_requests": len(ok),
        "failed_requests": len(result.records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": distribution([gap for r in ok for gap in r.itl], percentiles),
        "e2el_ms": distribution([r.latency for r in ok], percentiles),
    }


SECTIONS = (
    ("ttft_ms", "Time to First Token", "TTFT"),
    ("tpot_ms", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl_ms", "Inter-token Latency", "ITL"),
    ("e2el_ms", "End-to-end Latency", "E2EL"),
)


def format_report(summary: dict[str, object], title: str = "Serving Benchmark Result") -> str:
    width = 50

    def line(label: str, value: object) -> str:
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<40}{shown:>10}"

    rows = [
        f"{' ' + title + ' ':=^{width}}",
        line("Successful requests:", summary["successful_requests"]),
        line("Failed requests:", summary["failed_requests"]),
        line("Benchmark duration (s):", summary["duration_s"]),
        line("Total input tokens:", summary["total_input_tokens"]),
        line("Total generated tokens:", summary["total_output_tokens"]),
        line("Request throughput (req/s):", summary["request_throughput"]),
        line("Output token throughput (tok/s):", summary["output_throughput"]),
        line("Total token throughput (tok/s):", summary["total_token_throughput"]),
    ]
    for key, heading, short in SECTIONS:
        rows.append(f"{heading:-^{width}}")
        stats = summary[key]
        assert isinstance(stats, dict)
        for stat, value in stats.items():
            label = stat.capitalize() if stat in ("mean", "median") else stat.upper()
            rows.append(line(f"{label} {short} (ms):", value))
    rows.append("=" * width)
    return "\n".join(rows)


# --- the server's own figures ------------------------------------------------------------------------------


def server_samples(rpc: Rpc) -> dict[str, tuple[str, dict[str, str]]]:
    """figure -> (sample name, labels that must match) for a run of `rpc` calls."""
    name = RPC_NAMES[rpc]
    return {
        "requests": ("textgen_requests_total", {"rpc": name}),
        "ok": ("textgen_requests_total", {"rpc": name, "code": "OK"}),
        "ttft_sum": ("textgen_time_to_first_token_seconds_sum", {}),
        "ttft_count": ("textgen_time_to_first_token_seconds_count", {}),
        "generation_tokens": ("textgen_generation_tokens_total", {}),
        "decode_steps": ("textgen_step_duration_seconds_count", {"phase": "decode"}),
        "decode_seconds": ("textgen_step_duration_seconds_sum", {"phase": "decode"}),
        "prefill_steps": ("textgen_step_duration_seconds_count", {"phase": "prefill"}),
        "prefill_seconds": ("textgen_step_duration_seconds_sum", {"phase": "prefill"}),
    }


def parse_server_figures(exposition: str, rpc: Rpc = "stream") -> dict[str, float]:
    """Sums of the server_samples over the series whose labels match, from Prometheus text format."""
    samples = server_samples(rpc)
    figures = dict.fromkeys(samples, 0.0)
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            for key, (name, labels) in samples.items():
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    figures[key] += sample.value
    return figures


def scrape(url: str, rpc: Rpc) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_server_figures(response.read().decode("utf-8"), rpc)


def scrape_after(
    url: str, rpc: Rpc, before: dict[str, float], requests: int, patience: float = 2.0
) -> dict[str, float]:
    """The server's figures once it has counted `requests` more calls, or after `patience` seconds.

    The server counts a call when its handler returns, which can be just after the client has read the
    last message, so the scrape that follows a run may come a moment too early.
    """
    deadline = time.monotonic() + patience
    while True:
        after = scrape(url, rpc)
        counted = after["requests"] - before["requests"]
        if counted >= requests or time.monotonic() >= deadline:
            return after
        time.sleep(0.05)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in before}


@dataclass(frozen=True)
class Check:
    name: str
    client: float
    server: float
    ok: bool


def compare_with_server(
    before: dict[str, float], after: dict[str, float], result: RunResult, rpc: Rpc = "stream"
) -> list[Check]:
    """The server's own counts and TTFT over the run against the client's (no other traffic assumed)."""
    delta = _delta(before, after)
    ok = [r for r in result.records if r.success]
    # A unary client sees no first token: the server's TTFT can only be checked against the whole call.
    streamed = rpc in ("stream", "http")
    client_first = [r.ttft for r in ok if r.ttft is not None] if streamed else [r.latency for r in ok]
    client_first_mean = float(np.mean(client_first)) if client_first else math.nan
    server_ttft_mean = delta["ttft_sum"] / delta["ttft_count"] if delta["ttft_count"] else math.nan
    output_tokens = sum(r.output_tokens for r in ok)
    return [
        Check(
            f"requests ({RPC_NAMES[rpc]})",
            len(result.records),
            delta["requests"],
            delta["requests"] == len(result.records),
        ),
        Check("successful requests (code OK)", len(ok), delta["ok"], delta["ok"] == len(ok)),
        Check(
            "generated tokens",
            output_tokens,
            delta["generation_tokens"],
            delta["generation_tokens"] == output_tokens,
        ),
        # The server's clock starts when the request arrives and stops before the token crosses the network.
        Check(
            "mean TTFT (s): server <= client" + ("" if streamed else " latency"),
            client_first_mean,
            server_ttft_mean,
            server_ttft_mean <= client_first_mean,
        ),
    ]


@dataclass(frozen=True)
class EngineSteps:
    """What the server's engine did during the run, from its step histograms (no other traffic assumed):
    where served throughput goes — engine steps, how full they ran, and the time between them."""

    duration: float  # seconds, the client's run
    decode_steps: int
    decode_seconds: float
    prefill_steps: int  # a prompt prefilled in chunks counts one step per piece
    prefill_seconds: float
    sequences: int  # started (first tokens)
    tokens: int  # generated

    @property
    def decode_ms(self) -> float:
        """Mean milliseconds a decode step."""
        return self.decode_seconds / self.decode_steps * 1e3 if self.decode_steps else math.nan

    @property
    def prefill_ms(self) -> float:
        """Mean milliseconds a prefill step (or piece)."""
        return self.prefill_seconds / self.prefill_steps * 1e3 if self.prefill_steps else math.nan

    @property
    def decode_rows(self) -> float:
        """Mean sequences per decode step: every token after a sequence's first comes from one."""
        return (self.tokens - self.sequences) / self.decode_steps if self.decode_steps else math.nan

    @property
    def prefill_rows(self) -> float:
        """Mean sequences started per prefill step."""
        return self.sequences / self.prefill_steps if self.prefill_steps else math.nan

    @property
    def busy(self) -> float:
        """Share of the run the engine spent inside steps (a prefill beside decode steps overlaps them and
        counts too, so this can pass 1)."""
        return (self.decode_seconds + self.prefill_seconds) / self.duration

    @property
    def between_ms(self) -> float:
        """Milliseconds per step spent outside engine steps (hand-off, admission, waiting for work or CPU)."""
        steps = self.decode_steps + self.prefill_steps
        idle = self.duration - self.decode_seconds - self.prefill_seconds
        return idle / steps * 1e3 if steps else math.nan


def engine_steps(before: dict[str, float], after: dict[str, float], duration: float) -> EngineSteps:
    delta = _delta(before, after)
    return EngineSteps(
        duration=duration,
        decode_steps=round(delta["decode_steps"]),
        decode_seconds=delta["decode_seconds"],
        prefill_steps=round(delta["prefill_steps"]),
        prefill_seconds=delta["prefill_seconds"],
        sequences=round(delta["ttft_count"]),
        tokens=round(delta["generation_tokens"]),
    )


def format_steps(steps: EngineSteps) -> str:
    return "\n".join(
        [
            f"{' Server engine steps ':=^78}",
            f"{'Decode steps:':<40}{steps.decode_steps:<10} "
            f"{steps.decode_ms:.2f} ms mean, {steps.decode_rows:.2f} rows",
            f"{'Prefill steps:':<40}{steps.prefill_steps:<10} "
            f"{steps.prefill_ms:.2f} ms mean, {steps.prefill_rows:.2f} sequences",
            f"{'Engine busy (share of the run):':<40}{steps.busy:.2f}",
            f"{'Between steps (ms per step):':<40}{steps.between_ms:.2f}",
        ]
    )


def format_checks(checks: Sequence[Check]) -> str:
    rows = [f"{' Server metrics vs client ':=^78}", f"{'check':<36}{'client':>14}{'server':>14}{'':>4}result"]
    for check in checks:
        rows.append(
            f"{check.name:<36}{check.client:>14.6g}{check.server:>14.6g}"
            f"    {'ok' if check.ok else 'MISMATCH'}"
        )
    return "\n".join(rows)


# --- putting it together -----------------------------------------------------------------------------------


@dataclass
class BenchmarkOutput:
    config: LoadConfig
    model: dict[str, object]
    summary: dict[str, object]
    records: list[RequestRecord]
    checks: list[Check] = field(default_factory=list)
    steps: EngineSteps | None = None

    def steps_json(self) -> dict[str, float] | None:
        if self.steps is None:
            return None
        derived = [name for name, value in vars(EngineSteps).items() if isinstance(value, property)]
        return asdict(self.steps) | {name: getattr(self.steps, name) for name in derived}

    def to_json(self) -> dict[str, object]:
        return {
            "config": asdict(self.config),
            "model": self.model,
            "summary": self.summary,
            "server_checks": [asdict(c) for c in self.checks],
            "server_steps": self.steps_json(),
            "records": [record_json(r) for r in self.records],
        }


async def benchmark(config: LoadConfig, metrics_url: str | None = None) -> BenchmarkOutput:
    """Prepare the prompts, run the load, and (with `metrics_url`) compare with the server's metrics."""
    cpus = None if config.cpus is None else frozenset(config.cpus)
    if cpus is not None:
        check_cpus(cpus, "cpus")
    with pinned(cpus):
        return await _benchmark(config, metrics_url)


async def _benchmark(config: LoadConfig, metrics_url: str | None) -> BenchmarkOutput:
    async with grpc.aio.insecure_channel(config.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        prompts = await _prepare(config, stub, info)
        before = await asyncio.to_thread(scrape, metrics_url, config.rpc) if metrics_url else None
        result = await run_load(config, stub, prompts)
        checks, steps = [], None
        if metrics_url and before is not None:
            count = len(result.records)
            after = await asyncio.to_thread(scrape_after, metrics_url, config.rpc, before, count)
            checks = compare_with_server(before, after, result, config.rpc)
            steps = engine_steps(before, after, result.duration)
    model = {"name": info.model_name, "vocab_size": info.vocab_size, "max_batch_size": info.max_batch_size}
    summary = summarize(result, config.percentiles)
    return BenchmarkOutput(config, model, summary, result.records, checks, steps)


async def _prepare(config: LoadConfig, stub: pb_grpc.TextGenerationStub, info: pb.ModelInfo) -> list[Prompt]:
    count = config.num_requests or DURATION_PROMPT_POOL
    if config.dataset == "synthetic":
        return build_prompts(config, count, info, _no_tokenizer)
    # Tokenize is a blocking helper for build_prompts: run it on a private channel from a worker thread.
    with grpc.insecure_channel(config.target) as channel:
        sync_stub = pb_grpc.TextGenerationStub(channel)

        def count_tokens(text: str) -> int:
            return len(sync_stub.Tokenize(pb.TokenizeRequest(text=text), timeout=30).ids)

        return await asyncio.to_thread(build_prompts, config, count, info, count_tokens)


def _no_tokenizer(text: str) -> int:
    raise AssertionError("synthetic prompts are never tokenized")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Load-test a textgen gRPC server; reports as `vllm bench serve` does.",
    )
    p.add_argument("--target", default="localhost:50051", help="server HOST:PORT")
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="closed loop: clients (default 1); with --request-rate: the most requests in flight",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: requests per second, Poisson arrivals (default: closed loop)",
    )
    amount = p.add_mutually_exclusive_group()
    amount.add_argument("--num-requests", type=int, default=None, help="requests to send (default 64)")
    amount.add_argument("--duration", type=float, default=None, help="send requests for this many seconds")
    p.add_argument(
        "--dataset",
        choices=("synthetic", "corpus"),
        default="synthetic",
        help="random token ids, or text from the Python stdlib sources",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (mean)")
    p.add_argument(
        "--input-len-spread", type=float, default=0.0, help="prompt length uniform in input_len * [1-s, 1+s]"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="max_new_tokens per request (mean)")
    p.add_argument(
        "--output-len-spread",
        type=float,
        default=0.0,
        help="max_new_tokens uniform in max_new_tokens * [1-s, 1+s]",
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_new_tokens per request")
    p.add_argument(
        "--rpc",
        choices=tuple(RPC_NAMES),
        default="stream",
        help="stream: GenerateStream, timed per message; unary: Generate, one reply per request; http: "
        "OpenAI's streamed /v1/completions on --http-target, timed per SSE chunk",
    )
    p.add_argument("--http-target", default=None, help="HOST:PORT of the server's HTTP API (--rpc http)")
    p.add_argument(
        "--models",
        type=model_names,
        default=(),
        help="comma-separated LoRA adapters the requests name in turn, round-robin ('' in the list: the "
        "base model), as the gRPC adapter or the OpenAI model field",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths, arrivals and sampling")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--percentiles", default="99", help="comma-separated percentiles to report, e.g. 50,90,99")
    p.add_argument(
        "--metrics-url",
        default=None,
        help="the server's Prometheus endpoint (http://HOST:PORT/metrics): compare its figures",
    )
    p.add_argument("--output", type=Path, default=None, help="write summary and per-request records (JSON)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--cpus",
        type=usage_checked(parse_cpu_list),
        default=None,
        help="run on these CPUs only (a Linux CPU list, 0-3,6): off a server's --engine-cpus on this machine",
    )
    return p


def usage_checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: its ValueError becomes a usage error that keeps the message (argparse
    would say only "invalid value")."""

    def checked(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return checked


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    num_requests = args.num_requests if args.num_requests is not None or args.duration is not None else 64
    return LoadConfig(
        target=args.target,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        num_requests=num_requests,
        duration=args.duration,
        input_len=args.input_len,
        input_len_spread=args.input_len_spread,
        max_new_tokens=args.max_new_tokens,
        output_len_spread=args.output_len_spread,
        ignore_eos=args.ignore_eos,
        dataset=args.dataset,
        temperature=args.temperature,
        seed=args.seed,
        timeout=args.timeout,
        percentiles=tuple(float(p) for p in args.percentiles.split(",") if p.strip()),
        progress=not args.no_progress,
        rpc=args.rpc,
        cpus=None if args.cpus is None else tuple(sorted(args.cpus)),
        http_target=args.http_target,
        models=args.models,
    )


def model_names(text: str) -> tuple[str, ...]:
    """`--models a,b,,c`: the names in order, an empty one the base model."""
    return tuple(name.strip() for name in text.split(","))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if config.cpus is not None:
            check_cpus(frozenset(config.cpus), "--cpus")
    except ValueError as exc:
        parser().error(str(exc))
    try:
        output = asyncio.run(benchmark(config, args.metrics_url))
    except grpc.RpcError as exc:
        print(
            f"textgen-bench: cannot reach {config.target}: {exc.code().name}: {exc.details()}",
            file=sys.stderr,
        )
        return 1
    print(format_report(output.summary))
    if output.checks:
        print(format_checks(output.checks))
    if output.steps is not None:
        print(format_steps(output.steps))
    if args.output is not None:
        write_json(args.output, output.to_json())
        print(f"records written to {args.output}")
    # Failed requests are a result (an overload test expects some); nothing served or a mismatch is not.
    broken = output.summary["successful_requests"] == 0 or not all(c.ok for c in output.checks)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())

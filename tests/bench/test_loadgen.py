"""The load generator: its statistics on hand-made records, and a few-request smoke run on a real server."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from bench import loadgen, naive_server
from bench.loadgen import (
    LoadConfig,
    RequestRecord,
    RunResult,
    benchmark,
    compare_with_server,
    completion_body,
    cut_to_tokens,
    distribution,
    engine_steps,
    format_report,
    format_steps,
    main,
    model_names,
    parse_server_figures,
    summarize,
    synthetic_ids,
)
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ServerSettings

# --- statistics on hand-made records ---------------------------------------------------------------------


def record(ttft: float, itl: list[float], prompt: int = 10, start: float = 0.0) -> RequestRecord:
    """A successful request whose first token came after `ttft` and the others `itl` apart."""
    return RequestRecord(
        request_id=f"r{start}",
        start=start,
        success=True,
        prompt_tokens=prompt,
        output_tokens=1 + len(itl),
        ttft=ttft,
        itl=list(itl),
        latency=ttft + sum(itl),
    )


def test_tpot_excludes_the_first_token() -> None:
    r = record(ttft=0.5, itl=[0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((r.latency - 0.5) / 3)
    assert r.tpot == pytest.approx(0.2)
    assert record(ttft=0.5, itl=[]).tpot is None  # one token: no time per output token


def test_distribution_is_in_milliseconds_with_interpolated_percentiles() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    stats = distribution(values, (50.0, 99.0))
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)  # linear interpolation between 99 and 100
    assert math.isnan(distribution([], (99.0,))["p99"])


def read_stream(messages: list[list[int]]) -> RequestRecord:
    """A record of a stream whose messages carry these token ids."""

    async def replies() -> AsyncIterator[pb.GenerateStreamResponse]:
        for ids in messages:
            yield pb.GenerateStreamResponse(token_ids=ids)

    record = RequestRecord(request_id="r", start=0.0)
    asyncio.run(loadgen._read_stream(replies(), 0.0, record))
    return record


def test_a_stream_gives_one_inter_token_gap_per_message_after_the_first() -> None:
    spread = read_stream([[1], [2], [3, 4]])
    assert spread.ttft is not None and len(spread.itl) == 2 and spread.output_tokens == 4
    # A busy client may read a whole answer as one message: a TTFT, and no gap to measure.
    together = read_stream([[1, 2, 3, 4, 5]])
    assert together.ttft is not None and together.itl == [] and together.output_tokens == 5


def test_summary_pools_itl_but_averages_tpot_per_request() -> None:
    fast = record(ttft=0.1, itl=[0.01] * 9, prompt=5)  # 10 tokens
    slow = record(ttft=0.3, itl=[0.1], prompt=7, start=1.0)  # 2 tokens
    failed = RequestRecord(request_id="bad", start=0.5, error="UNAVAILABLE: gone", latency=0.2)
    summary = summarize(RunResult([fast, slow, failed], duration=2.0), (99.0,))
    assert summary["successful_requests"] == 2 and summary["failed_requests"] == 1
    assert summary["total_input_tokens"] == 12 and summary["total_output_tokens"] == 12
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx(6.0)
    assert summary["total_token_throughput"] == pytest.approx(12.0)
    # TPOT: mean of the two requests' own figures (10 ms and 100 ms), not of their ten gaps.
    assert summary["tpot_ms"]["mean"] == pytest.approx(55.0)
    # ITL: the ten gaps pooled, nine of 10 ms and one of 100 ms.
    assert summary["itl_ms"]["mean"] == pytest.approx(19.0)
    assert summary["itl_ms"]["median"] == pytest.approx(10.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["e2el_ms"]["mean"] == pytest.approx((0.19 + 0.4) / 2 * 1e3)
    report = format_report(summary)
    assert "Failed requests:" in report and "P99 ITL (ms):" in report and "Median TPOT (ms):" in report


EXPOSITION = """\
# TYPE textgen_requests counter
textgen_requests_total{{rpc="GenerateStream",code="OK"}} {ok}
textgen_requests_total{{rpc="GenerateStream",code="CANCELLED"}} {cancelled}
textgen_requests_total{{rpc="Generate",code="OK"}} 100.0
# TYPE textgen_time_to_first_token_seconds histogram
textgen_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_count}
textgen_time_to_first_token_seconds_count {ttft_count}
textgen_time_to_first_token_seconds_sum {ttft_sum}
# TYPE textgen_generation_tokens counter
textgen_generation_tokens_total {tokens}
"""


def exposition(ok: int, cancelled: int, ttft_count: int, ttft_sum: float, tokens: int) -> str:
    return EXPOSITION.format(
        ok=ok, cancelled=cancelled, ttft_count=ttft_count, ttft_sum=ttft_sum, tokens=tokens
    )


def test_server_figures_sum_matching_series_only() -> None:
    figures = parse_server_figures(exposition(3, 1, 4, 0.4, 40))
    assert figures["requests"] == 4 and figures["ok"] == 3  # the unary Generate is not counted
    assert figures["ttft_count"] == 4 and figures["ttft_sum"] == pytest.approx(0.4)
    assert figures["generation_tokens"] == 40
    unary = parse_server_figures(exposition(3, 1, 4, 0.4, 40), rpc="unary")
    assert unary["requests"] == unary["ok"] == 100  # only the unary Generate series


STEPS = """\
# TYPE textgen_step_duration_seconds histogram
textgen_step_duration_seconds_count{{phase="decode"}} {decode}
textgen_step_duration_seconds_sum{{phase="decode"}} {decode_s}
textgen_step_duration_seconds_count{{phase="prefill"}} {prefill}
textgen_step_duration_seconds_sum{{phase="prefill"}} {prefill_s}
"""


def test_engine_steps_show_where_the_run_went() -> None:
    def scraped(decode: int, decode_s: float, prefill: int, prefill_s: float, first: int, tokens: int) -> str:
        steps = STEPS.format(decode=decode, decode_s=decode_s, prefill=prefill, prefill_s=prefill_s)
        return exposition(0, 0, first, 0.0, tokens) + steps

    before = parse_server_figures(scraped(50, 1.0, 5, 0.5, 10, 100))
    after = parse_server_figures(scraped(150, 1.2, 15, 0.55, 30, 320))
    steps = engine_steps(before, after, duration=1.0)
    assert (steps.decode_steps, steps.prefill_steps, steps.sequences, steps.tokens) == (100, 10, 20, 220)
    assert steps.decode_rows == pytest.approx(2.0)  # 200 tokens after the 20 first ones, in 100 steps
    assert steps.prefill_rows == pytest.approx(2.0)
    assert steps.busy == pytest.approx(0.25) and steps.between_ms == pytest.approx(750 / 110)
    report = format_steps(steps)
    assert "2.00 ms mean, 2.00 rows" in report and "5.00 ms mean, 2.00 sequences" in report


def test_comparison_with_the_server_flags_what_disagrees() -> None:
    result = RunResult([record(0.2, [0.01] * 4), record(0.2, [0.01] * 4)], duration=1.0)
    before = parse_server_figures(exposition(5, 0, 6, 1.0, 100))
    agreeing = parse_server_figures(exposition(7, 0, 8, 1.3, 110))  # server TTFT 150 ms < client 200 ms
    assert all(check.ok for check in compare_with_server(before, agreeing, result))
    off = parse_server_figures(exposition(8, 0, 8, 1.6, 111))  # one extra request, TTFT 300 ms, one token
    failing = {check.name for check in compare_with_server(before, off, result) if not check.ok}
    assert failing == {
        "requests (GenerateStream)",
        "successful requests (code OK)",
        "generated tokens",
        "mean TTFT (s): server <= client",
    }


def test_corpus_prompts_are_cut_to_at_most_the_token_budget() -> None:
    def words(text: str) -> int:
        return len(text.split())

    text = " ".join(f"word{i}" for i in range(100))
    cut = cut_to_tokens(text, 30, words)
    assert 25 <= words(cut) <= 30 and text.startswith(cut)


def test_synthetic_prompts_avoid_eos() -> None:
    import random

    ids = synthetic_ids(500, vocab_size=4, eos_token_id=0, rng=random.Random(1))
    assert len(ids) == 500 and 0 not in ids and set(ids) == {1, 2, 3}


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig(target="x:1", concurrency=0)
    with pytest.raises(ValueError, match="exactly one"):
        LoadConfig(target="x:1", num_requests=4, duration=1.0)


def test_requests_name_the_models_in_turn() -> None:
    assert model_names("a,,b") == ("a", "", "b")
    config = LoadConfig(target="t", num_requests=4, progress=False, models=model_names("a,,b"))
    plan = loadgen._Plan(config, [loadgen.Prompt(None, (5, 6), 2)], origin=0.0)
    assert [issued.message.adapter for issued in iter(plan.next, None)] == ["a", "", "b", "a"]


def test_an_http_request_names_its_adapter_in_the_servers_field() -> None:
    message = loadgen.Prompt(None, (5, 6), 2).message("r", LoadConfig(target="t"), adapter="1")
    assert json.loads(completion_body(message))["model"] == "1"
    assert json.loads(completion_body(message, "lora"))["lora"] == [{"id": 1, "scale": 1.0}]
    base = loadgen.Prompt(None, (5, 6), 2).message("r", LoadConfig(target="t"))
    assert not {"model", "lora"} & set(json.loads(completion_body(base)))
    with pytest.raises(ValueError, match="adapter_field"):  # llama-server's lora list holds indices
        LoadConfig(target="t", models=("a",), adapter_field="lora")


# --- smoke run against a real server ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_bundle: Path) -> Iterator[RunningServer]:
    loop = LoopThread()
    running = RunningServer(loop, loopback_settings(tiny_bundle, max_batch_size=4, http_port=free_port()))
    yield running
    running.stop()
    loop.close()


def test_closed_loop_smoke_run_matches_the_server(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = [
        "--target",
        server.target,
        "--concurrency",
        "2",
        "--num-requests",
        "4",
        "--max-new-tokens",
        "5",
        "--input-len",
        "6",
        "--ignore-eos",
        "--no-progress",
        "--output",
        str(out),
        "--metrics-url",
        f"http://127.0.0.1:{server.server.metrics_port}/metrics",
    ]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["summary"]["successful_requests"] == 4 and saved["summary"]["failed_requests"] == 0
    assert saved["summary"]["total_output_tokens"] == 20
    assert len(saved["records"]) == 4
    for rec in saved["records"]:
        assert rec["success"] and rec["output_tokens"] == 5 and rec["prompt_tokens"] == 6
        assert rec["finish_reason"] == "FINISH_REASON_LENGTH"
        assert 0 < rec["ttft"] <= rec["latency"]
        # A stream that lags the engine gets several tokens in one message (one gap per message, not token).
        assert len(rec["itl"]) <= 4 and all(gap > 0 for gap in rec["itl"])
    assert [c["ok"] for c in saved["server_checks"]] == [True] * 4
    steps = saved["server_steps"]
    assert steps["sequences"] == 4 and steps["tokens"] == 20 and steps["prefill_steps"] >= 1
    assert steps["decode_steps"] >= 4 and 1 <= steps["decode_rows"] <= 4  # 4 tokens each after the first
    assert 0 < steps["busy"] <= 1 and steps["between_ms"] >= 0


def test_unary_run_counts_generate_calls_and_checks_ttft_against_latency(
    server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "unary.json"
    argv = [
        *("--target", server.target, "--rpc", "unary", "--concurrency", "2", "--num-requests", "3"),
        *("--max-new-tokens", "4", "--input-len", "5", "--ignore-eos", "--no-progress", "--output", str(out)),
        *("--metrics-url", f"http://127.0.0.1:{server.server.metrics_port}/metrics"),
    ]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["summary"]["total_output_tokens"] == 12 and saved["summary"]["successful_requests"] == 3
    for rec in saved["records"]:
        assert rec["output_tokens"] == 4 and rec["prompt_tokens"] == 5 and rec["latency"] > 0
        assert rec["ttft"] is None and rec["itl"] == []  # a unary client sees no tokens before the end
    checks = {c["name"]: c for c in saved["server_checks"]}
    assert checks["requests (Generate)"]["server"] == 3
    assert all(c["ok"] for c in checks.values()) and "mean TTFT (s): server <= client latency" in checks


def test_http_run_streams_openai_completions_and_matches_the_server(
    server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "http.json"
    argv = [
        *(
            "--target",
            server.target,
            "--rpc",
            "http",
            "--http-target",
            f"127.0.0.1:{server.server.http_port}",
        ),
        *("--concurrency", "2", "--num-requests", "5", "--max-new-tokens", "4", "--input-len", "5"),
        *("--ignore-eos", "--no-progress", "--output", str(out)),
        *("--metrics-url", f"http://127.0.0.1:{server.server.metrics_port}/metrics"),
    ]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["summary"]["total_output_tokens"] == 20 and saved["summary"]["successful_requests"] == 5
    for rec in saved["records"]:
        assert rec["output_tokens"] == 4 and rec["prompt_tokens"] == 5 and rec["finish_reason"] == "length"
        assert 0 < rec["ttft"] <= rec["latency"] and len(rec["itl"]) <= 3
    checks = {c["name"]: c for c in saved["server_checks"]}
    assert checks["requests (/v1/completions)"]["server"] == 5 and all(c["ok"] for c in checks.values())


def test_open_loop_corpus_run_sends_text(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "open.json"
    argv = [
        "--target",
        server.target,
        "--request-rate",
        "50",
        "--num-requests",
        "3",
        "--dataset",
        "corpus",
        "--input-len",
        "8",
        "--max-new-tokens",
        "3",
        "--output-len-spread",
        "0.5",
        "--ignore-eos",
        "--no-progress",
        "--output",
        str(out),
    ]
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["summary"]["successful_requests"] == 3
    for rec in saved["records"]:
        assert 1 <= rec["prompt_tokens"] <= 8 and 2 <= rec["output_tokens"] <= 4


def test_an_open_loop_with_a_cap_starts_a_waiting_request_when_it_gets_a_place(
    server: RunningServer, tmp_path: Path
) -> None:
    out = tmp_path / "capped.json"
    argv = ["--target", server.target, "--request-rate", "500", "--concurrency", "1", "--num-requests", "4",
            "--max-new-tokens", "4", "--ignore-eos", "--no-progress", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    records = sorted(json.loads(out.read_text())["records"], key=lambda r: r["start"])
    assert [r["success"] for r in records] == [True] * 4
    # One place: each request went out once the one before had ended, and its start is then, not its arrival.
    for before, after in itertools.pairwise(records):
        assert after["start"] >= before["start"] + before["latency"]


def test_a_request_starts_when_the_plan_lets_it_through(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plan checks the clock at 0.299 of a 0.3 s run; building the message and getting to the send take
    # time (the clock reads 0.301 after): the request's start is the check's, so none starts after the end.
    ticks = [0.299, 0.301, 0.302, 0.303]
    monkeypatch.setattr(loadgen.time, "perf_counter", lambda: ticks.pop(0) if len(ticks) > 1 else ticks[0])
    config = LoadConfig(target="t", concurrency=1, num_requests=None, duration=0.3, progress=False)
    plan = loadgen._Plan(config, [loadgen.Prompt(None, (5, 6), 2)], origin=0.0)
    sent: list[float] = []

    def issue(message: pb.GenerateRequest, at: float) -> asyncio.Future[RequestRecord]:
        sent.append(at)
        future: asyncio.Future[RequestRecord] = asyncio.get_running_loop().create_future()
        future.set_result(RequestRecord(request_id=message.request_id, start=at))
        return future

    records = asyncio.run(loadgen._closed_loop(plan, 1, issue))
    assert sent == [0.299]
    assert [r.request_id for r in records] == ["bench-0"]


def test_duration_bound_run_stops_sending_when_time_is_up(server: RunningServer) -> None:
    config = LoadConfig(
        target=server.target, concurrency=2, num_requests=None, duration=0.3, max_new_tokens=2, progress=False
    )
    output = asyncio.run(benchmark(config))
    assert output.summary["successful_requests"] >= 2
    assert all(r.start < 0.3 for r in output.records)


@pytest.fixture(scope="module")
def naive_target(tiny_bundle: Path) -> Iterator[str]:
    settings = ServerSettings(bundle=tiny_bundle, host="127.0.0.1", port=0)
    server, port = naive_server.start(settings, max_workers=8)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_naive_server_serves_one_request_at_a_time(naive_target: str, tmp_path: Path) -> None:
    out = tmp_path / "naive.json"
    argv = ["--target", naive_target, "--concurrency", "3", "--num-requests", "3", "--max-new-tokens", "32",
            "--ignore-eos", "--no-progress", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads(out.read_text())
    assert saved["model"]["max_batch_size"] == 1
    records = saved["records"]
    assert [r["output_tokens"] for r in records] == [32, 32, 32]
    # Token windows (first to last token received) do not overlap: each request waited for the one before.
    # The times are the client's, taken as its event loop gets to each stream, on a machine other tests
    # keep busy: a stamp can come late by a millisecond or so (0.1 and 0.7 ms seen), while requests served
    # together would overlap by most of a window (32 tokens: several ms even on the tiny model).
    windows = sorted((r["start"] + r["ttft"], r["start"] + r["ttft"] + sum(r["itl"])) for r in records)
    for (first, previous_last), (next_first, _) in itertools.pairwise(windows):
        assert next_first >= previous_last - (previous_last - first) / 4


def test_naive_server_refuses_what_the_scheduler_refuses(naive_target: str) -> None:
    with grpc.insecure_channel(naive_target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        bad = pb.GenerateRequest(text="x", stopping=pb.StoppingCriteria(max_new_tokens=2, min_new_tokens=3))
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(bad, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_new_tokens is 3; allowed 0..2" in error.value.details()


def test_a_kept_connection_the_server_closed_is_replaced() -> None:
    """llama-server may close a keep-alive connection after a streamed answer, without saying so."""
    body = b'data: {"choices": [{"text": "a", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    connections = []

    async def one_answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def two_requests() -> list[loadgen.RequestRecord]:
        server = await asyncio.start_server(one_answer_then_close, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        http = loadgen.HttpConnections(f"127.0.0.1:{port}")
        records = [loadgen.RequestRecord(f"r{i}", 0.0) for i in range(2)]
        for record in records:
            await http.stream(b"{}", 0.0, record)
        http.close()
        server.close()
        return records

    records = asyncio.run(two_requests())
    assert [r.finish_reason for r in records] == ["length", "length"] and len(connections) == 2

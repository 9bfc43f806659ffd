"""The gRPC service end to end: a real server with the tiny bundle on a loopback port, real channels.

Both shapes of the server: the engine in a process of its own (the default) and an engine thread. Tests
that need a request to still be running when they act slow the engine's decode step down while it runs
(`engine_faults`: test instrumentation on the real engine; the scheduler and the server are the product's).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from engine_faults import InjectedFaults
from grpc_health.v1 import health_pb2, health_pb2_grpc
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, rpc_error

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.common import CallRecord
from serve.api.grpc_service import batch_invariant
from serve.api.loading import scheduler_limits
from serve.engine.engine import Engine
from serve.engine.types import MIN_PIECE, EngineSettings

PROMPT = "the quick brown fox"
# A stub, and the stream holding the small server's only row.
BusyRow = tuple[pb_grpc.TextGenerationStub, Iterator[pb.GenerateStreamResponse]]


@pytest.fixture(scope="module", params=[True, False], ids=["engine process", "engine thread"])
def server(loop: LoopThread, tiny_bundle: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """The server in both its shapes; requests with ids "slow-..." run slowly, "doomed..." fail a step."""
    settings = loopback_settings(
        tiny_bundle,
        max_new_tokens=32,
        default_max_new_tokens=8,
        max_stop_strings=2,
        engine_process=request.param,
    )
    running = RunningServer(loop, settings, InjectedFaults())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def channel(server: RunningServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as chan:
        yield chan


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.TextGenerationStub:
    return pb_grpc.TextGenerationStub(channel)


def greedy(max_new_tokens: int = 12, **fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True), **fields
    )


# --- the happy paths ----------------------------------------------------------------------------------------


def test_generate_and_stream_agree(stub: pb_grpc.TextGenerationStub) -> None:
    whole = stub.Generate(greedy(request_id="agree-1"))
    parts = list(stub.GenerateStream(greedy(request_id="agree-2")))
    assert whole.request_id == "agree-1" and {p.request_id for p in parts} == {"agree-2"}
    assert "".join(p.text for p in parts) == whole.text
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert len(whole.token_ids) == 12 and whole.finish_reason == pb.FINISH_REASON_LENGTH
    *body, last = parts
    assert last.finish_reason == whole.finish_reason and last.usage == whole.usage
    assert all(p.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not p.HasField("usage") for p in body)
    assert whole.usage.completion_tokens == 12
    assert 0 <= whole.queue_seconds <= whole.time_to_first_token_seconds <= whole.total_seconds


def test_server_makes_a_request_id_when_none_is_given(stub: pb_grpc.TextGenerationStub) -> None:
    first, second = stub.Generate(greedy(2)), stub.Generate(greedy(2))
    assert first.request_id and second.request_id and first.request_id != second.request_id


def test_token_ids_input_and_logprobs(stub: pb_grpc.TextGenerationStub) -> None:
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).ids)
    by_text = stub.Generate(greedy(6))
    by_ids = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
            include_logprobs=True,
        )
    )
    assert list(by_ids.token_ids) == list(by_text.token_ids) and by_ids.usage.prompt_tokens == len(ids)
    assert len(by_ids.logprobs) == 6 and all(lp <= 0 and math.isfinite(lp) for lp in by_ids.logprobs)
    assert not by_text.logprobs  # only when asked for


def test_only_text_is_tokenized_off_the_event_loop(
    stub: pb_grpc.TextGenerationStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed_off: list[str] = []
    to_thread = asyncio.to_thread

    async def recording(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        handed_off.append(getattr(func, "__name__", repr(func)))
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", recording)
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).ids)
    stopping = pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True)
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stopping=stopping))
    assert handed_off.count("prompt_ids") == 0  # token ids are only checked, on the loop
    by_text = stub.Generate(pb.GenerateRequest(text=PROMPT, stopping=stopping))
    assert handed_off.count("prompt_ids") == 1
    assert list(by_ids.token_ids) == list(by_text.token_ids)


def test_stop_token_ids_min_new_tokens_and_the_openai_penalties(stub: pb_grpc.TextGenerationStub) -> None:
    plain = list(stub.Generate(greedy(12)).token_ids)
    at = next(i for i in range(12) if plain[i] not in plain[:i])  # the tiny random model repeats itself

    def call(stopping: pb.StoppingCriteria, **sampling: float) -> pb.GenerateResponse:
        return stub.Generate(
            pb.GenerateRequest(text=PROMPT, stopping=stopping, sampling=pb.SamplingParams(**sampling))
        )

    stopped = call(pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True, stop_token_ids=[plain[at]]))
    assert stopped.finish_reason == pb.FINISH_REASON_STOP and list(stopped.token_ids) == plain[:at]
    held = call(
        pb.StoppingCriteria(
            max_new_tokens=12, ignore_eos=True, stop_token_ids=[plain[at]], min_new_tokens=at + 1
        )
    )
    assert list(held.token_ids[:at]) == plain[:at] and held.token_ids[at] != plain[at]
    # A strong frequency penalty makes greedy decoding avoid repeating its own tokens.
    penalized = call(pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True), frequency_penalty=2.0)
    assert len(set(penalized.token_ids)) > len(set(plain))
    assert call(pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True), min_p=0.5).token_ids == plain
    forced = stub.Generate(greedy(4, sampling=pb.SamplingParams(logit_bias={plain[0] + 1: 100.0})))
    assert list(forced.token_ids) == [plain[0] + 1] * 4


def test_top_logprobs_in_whole_and_streamed_replies(stub: pb_grpc.TextGenerationStub) -> None:
    whole = stub.Generate(greedy(5, include_logprobs=True, top_logprobs=3))
    parts = list(stub.GenerateStream(greedy(5, include_logprobs=True, top_logprobs=3)))
    streamed = [top for part in parts for top in part.top_logprobs]
    assert [list(t.token_ids) for t in streamed] == [list(t.token_ids) for t in whole.top_logprobs]
    assert len(whole.top_logprobs) == len(whole.token_ids) == 5
    for token, logprob, top in zip(whole.token_ids, whole.logprobs, whole.top_logprobs, strict=True):
        assert len(top.token_ids) == 3 and top.token_ids[0] == token
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        assert top.logprobs[0] == pytest.approx(logprob, abs=1e-5)
    assert not stub.Generate(greedy(2, include_logprobs=True)).top_logprobs


def test_prompt_logprobs_in_whole_and_streamed_replies(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    whole = stub.Generate(greedy(4, include_prompt_logprobs=True))
    parts = list(stub.GenerateStream(greedy(4, include_prompt_logprobs=True)))
    prompt = server.model.tokenizer.encode(PROMPT).ids
    assert len(whole.prompt_logprobs) == len(prompt) - 1
    engine = Engine.from_bundle(server.model.bundle, EngineSettings(max_batch_size=1))
    expected = engine.score_prompt(prompt).logprobs
    assert list(whole.prompt_logprobs) == pytest.approx(expected, abs=1e-6)
    assert all(lp <= 0 for lp in whole.prompt_logprobs)
    assert list(parts[0].prompt_logprobs) == list(whole.prompt_logprobs)  # the first message carries them
    assert not any(part.prompt_logprobs for part in parts[1:])
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert not stub.Generate(greedy(2)).prompt_logprobs
    listed = stub.Generate(greedy(2, include_prompt_logprobs=True, prompt_top_logprobs=2))
    assert [len(t.token_ids) for t in listed.prompt_top_logprobs] == [2] * (len(prompt) - 1)
    streamed = list(stub.GenerateStream(greedy(2, include_prompt_logprobs=True, prompt_top_logprobs=2)))
    assert list(streamed[0].prompt_top_logprobs) == list(listed.prompt_top_logprobs)
    for bad in (
        greedy(2, prompt_top_logprobs=2),
        greedy(2, include_prompt_logprobs=True, prompt_top_logprobs=21),
    ):
        error = rpc_error(lambda bad=bad: stub.Generate(bad))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_top_logprobs" in error.details()


def test_a_prompt_longer_than_the_context_is_served_when_truncated(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    context = server.model.info.context_length
    ids = [1 + i % 50 for i in range(context + 10)]
    assert rpc_error(lambda: stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids)))).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    truncated = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        truncate_prompt_tokens=20,
        stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
    )
    whole = stub.Generate(truncated)
    tail = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids[-20:]),
            stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
        )
    )
    assert whole.usage.prompt_tokens == 20 and list(whole.token_ids) == list(tail.token_ids)


def test_include_stop_str_in_output(stub: pb_grpc.TextGenerationStub) -> None:
    (the,) = stub.Tokenize(pb.TokenizeRequest(text=" the")).ids  # one token; forced, it repeats
    forced = pb.SamplingParams(logit_bias={the: 100.0})

    def stopped(include: bool) -> pb.GenerateResponse:
        stopping = pb.StoppingCriteria(max_new_tokens=8, stop=["he t"], include_stop_str_in_output=include)
        return stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=forced, stopping=stopping))

    assert stopped(False).text == " t" and stopped(True).text == " the t"
    assert stopped(True).finish_reason == pb.FINISH_REASON_STOP


def test_default_max_new_tokens_and_the_cap(stub: pb_grpc.TextGenerationStub) -> None:
    def generated(max_new_tokens: int) -> int:
        stopping = pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=True)
        return stub.Generate(pb.GenerateRequest(text=PROMPT, stopping=stopping)).usage.completion_tokens

    assert generated(0) == 8  # the server's default_max_new_tokens
    assert generated(33) == 32  # above the server's max_new_tokens: lowered to it, as vLLM does


def test_model_info(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    manifest = server.model.bundle.manifest
    assert info.model_name == manifest.model_name
    assert info.vocab_size == manifest.architecture.vocab_size
    assert info.context_length == manifest.architecture.context_length
    assert info.eos_token_id == manifest.eos_token_id
    assert (info.dtype, info.quantization) == (manifest.dtype, manifest.quantization)
    assert info.batch_invariant and manifest.batch_invariant  # a float bundle
    assert info.max_new_tokens_limit == min(32, info.context_length - 1)
    assert info.max_batch_size == server.model.info.max_batch_size == 16  # the default
    assert "CPUExecutionProvider" in info.execution_providers
    assert info.server_version
    assert info.prefix_cache_rows == 4  # the default
    arch = manifest.architecture
    row_bytes = arch.n_layers * 2 * arch.n_heads * arch.context_length * arch.head_dim * 4  # K, V; float32
    assert info.kv_cache_bytes == (info.max_batch_size + info.prefix_cache_rows) * row_bytes


def test_batch_invariance_is_claimed_on_the_cpu_only() -> None:
    assert batch_invariant(True, ("CPUExecutionProvider",))
    assert not batch_invariant(True, ("CUDAExecutionProvider", "CPUExecutionProvider"))  # not measured there
    assert not batch_invariant(False, ("CPUExecutionProvider",))


def test_tokenize(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    response = stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
    encoding = server.model.tokenizer.encode(PROMPT)
    assert list(response.ids) == encoding.ids and list(response.tokens) == encoding.tokens
    assert server.model.tokenizer.decode(list(response.ids)) == PROMPT


def test_chat_messages_are_rendered_by_the_bundles_template(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    chat = [pb.ChatMessage(role="system", content="be brief"), pb.ChatMessage(role="user", content=PROMPT)]
    rendered = server.model.chat.render([{"role": m.role, "content": m.content} for m in chat])  # type: ignore[union-attr]
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=rendered, add_special_tokens=False)).ids)
    stopping = pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)
    by_chat = stub.Generate(pb.GenerateRequest(messages=pb.ChatMessages(messages=chat), stopping=stopping))
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), stopping=stopping))
    assert list(by_chat.token_ids) == list(by_ids.token_ids) and by_chat.usage.prompt_tokens == len(ids)
    for bad, message in [
        (pb.ChatMessages(), "messages is empty"),
        (
            pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")]),
            "messages[0].role is 'robot'",
        ),
    ]:
        error = rpc_error(lambda bad=bad: stub.Generate(pb.GenerateRequest(messages=bad)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()


def test_tokenize_without_special_tokens(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    tokenizer = server.model.tokenizer
    plain = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=False))
    assert list(plain.ids) == tokenizer.encode(PROMPT, add_special_tokens=False).ids
    assert list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=True)).ids) == list(
        stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).ids
    )


def test_detokenize_is_tokenize_backwards(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    tokenized = stub.Tokenize(pb.TokenizeRequest(text=PROMPT + " é"))
    detokenized = stub.Detokenize(pb.DetokenizeRequest(ids=tokenized.ids))
    assert detokenized.text == PROMPT + " é" and list(detokenized.tokens) == list(tokenized.tokens)
    tokenizer = server.model.tokenizer
    assert list(detokenized.texts) == [tokenizer.decode([i]) for i in tokenized.ids]
    # The ids top_logprobs reports, spelled out.
    top = stub.Generate(greedy(1, include_logprobs=True, top_logprobs=3)).top_logprobs[0]
    assert len(stub.Detokenize(pb.DetokenizeRequest(ids=top.token_ids)).texts) == 3
    assert stub.Detokenize(pb.DetokenizeRequest()).text == ""
    error = rpc_error(lambda: stub.Detokenize(pb.DetokenizeRequest(ids=[1, 10**6])))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "ids[1] = 1000000 is outside the vocabulary" in error.details()


def test_health_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "textgen.v1.TextGeneration"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = list(
        reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"textgen.v1.TextGeneration", "grpc.health.v1.Health"} <= names


# --- every INVALID_ARGUMENT case ----------------------------------------------------------------------------


def _sampling(**fields: float) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(**fields))


def _stopping(**fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, stopping=pb.StoppingCriteria(**fields))


INVALID = [
    (pb.GenerateRequest(), "input is required: set either text or token_ids"),
    (pb.GenerateRequest(text=""), "text is empty"),
    (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids is empty"),
    (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])),
        "token_ids[1] = 1000000 is outside the vocabulary",
    ),
    (_stopping(max_new_tokens=500), "max_new_tokens (500) = "),  # more than the context holds
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 5000)), "prompt has 5000 tokens; allowed 1.."),
    (_sampling(temperature=-1), "temperature must be a finite number >= 0 (0 = greedy), got -1"),
    (_sampling(temperature=math.nan), "temperature must be a finite number >= 0 (0 = greedy), got nan"),
    (_sampling(top_p=1.5), "top_p must be in [0, 1] (0 = off), got 1.5"),
    (_sampling(repetition_penalty=-2), "repetition_penalty must be 0 (off) or a finite number > 0, got -2"),
    (_stopping(stop=["a", "b", "c"]), "3 stop strings given; at most 2 are allowed"),
    (_stopping(stop=["x" * 65]), "stop[0] has 65 characters; allowed 1..64"),
    (_sampling(min_p=2), "min_p must be in [0, 1] (0 = off), got 2"),
    (pb.GenerateRequest(text=PROMPT, top_logprobs=2), "top_logprobs needs include_logprobs (as OpenAI's"),
    (_sampling(logit_bias={3: 150.0}), "logit_bias[3] must be in [-100, 100], got 150"),
    (_sampling(logit_bias={10**6: 1.0}), "logit_bias token ids must be in [0, "),
    (
        pb.GenerateRequest(text=PROMPT, include_logprobs=True, top_logprobs=21),
        "top_logprobs is 21; allowed 0..20",
    ),
    (_sampling(presence_penalty=5), "presence_penalty must be in [-2, 2] (0 = off), got 5"),
    (_stopping(stop_token_ids=[10**6]), "stop_token_ids must be in [0, "),
    (_stopping(max_new_tokens=4, min_new_tokens=5), "min_new_tokens is 5; allowed 0..4 (max_new_tokens)"),
    # Against the default that max_new_tokens = 0 asks for (8 on this server), not against 0.
    (_stopping(min_new_tokens=9), "min_new_tokens is 9; allowed 0..8 (max_new_tokens)"),
    (pb.GenerateRequest(text=PROMPT, request_id="r" * 200), "request_id has 200 characters; at most 128"),
]


@pytest.mark.parametrize(("request_", "message"), INVALID, ids=[m.split(" ")[0] for _, m in INVALID])
def test_invalid_argument(
    stub: pb_grpc.TextGenerationStub, request_: pb.GenerateRequest, message: str
) -> None:
    for call in (stub.Generate, stub.GenerateStream):
        error = rpc_error(lambda call=call: call(request_))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details()


def test_prompt_plus_max_new_tokens_beyond_the_context(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    limit = server.model.limits.context_length
    assert server.model.limits.max_prompt_tokens == limit - 1  # the default: any prompt that leaves room
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[1] * (limit - 4)), stopping=pb.StoppingCriteria(max_new_tokens=5)
    )
    error = rpc_error(lambda: stub.Generate(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"exceeds the context length {limit}: allowed max_new_tokens 1..4" in error.details()


def test_unknown_field_is_refused(channel: grpc.Channel) -> None:
    raw = channel.unary_unary(
        "/textgen.v1.TextGeneration/Generate", response_deserializer=pb.GenerateResponse.FromString
    )
    payload = pb.GenerateRequest(text=PROMPT).SerializeToString() + b"\x78\x05"  # field 15: not in textgen.v1
    error = rpc_error(lambda: raw(payload))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field number(s) [15]" in error.details()


@pytest.mark.parametrize("method", ["Generate", "GenerateStream", "GetModelInfo", "Tokenize", "Detokenize"])
def test_undecodable_request_is_invalid_argument(channel: grpc.Channel, method: str) -> None:
    path = f"/textgen.v1.TextGeneration/{method}"
    call = channel.unary_stream(path) if method == "GenerateStream" else channel.unary_unary(path)
    error = rpc_error(lambda: call(b"\x12\x05ab"))  # field 2 claims 5 bytes, 2 follow
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request is not a valid protobuf message" in error.details()


def test_bad_utf8_text_is_invalid_argument(channel: grpc.Channel) -> None:
    call = channel.unary_unary("/textgen.v1.TextGeneration/Generate")
    error = rpc_error(lambda: call(b"\x12\x02\xff\xfe"))  # GenerateRequest.text = 0xff 0xfe
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "bad UTF-8" in error.details()


def test_bad_requests_leave_the_server_healthy(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    before = stub.Generate(greedy(5)).text
    for request, _message in INVALID:
        rpc_error(lambda request=request: stub.Generate(request))
    assert stub.Generate(greedy(5)).text == before
    assert server.wait_idle().running == 0


# --- failures while running ---------------------------------------------------------------------------------


def test_engine_failure_is_internal_with_the_request_id_and_the_server_recovers(
    stub: pb_grpc.TextGenerationStub,
) -> None:
    error = rpc_error(lambda: stub.Generate(greedy(4, request_id="doomed")))  # its decode steps fail
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "doomed" in error.details()
    assert stub.Generate(greedy(4)).usage.completion_tokens == 4


def test_deadline_exceeded_frees_the_slot(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    error = rpc_error(lambda: stub.Generate(greedy(30, request_id="slow-deadline"), timeout=0.3))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.wait_idle(2.0).running == 0


def test_cancelling_a_stream_frees_its_slot(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    cancelled_before = server.snapshot().outcomes.get("cancelled", 0)
    call = stub.GenerateStream(greedy(30, request_id="slow-cancel"))
    next(call)
    assert server.snapshot().running == 1
    call.cancel()
    snapshot = server.wait_idle(2.0)
    assert snapshot.running == 0 and snapshot.kv_slots_used == 0
    assert snapshot.outcomes.get("cancelled", 0) == cancelled_before + 1
    scrape = server.server.metrics.exposition()
    assert 'textgen_requests_total{code="CANCELLED",rpc="GenerateStream"}' in scrape


def test_request_log_lines(
    stub: pb_grpc.TextGenerationStub, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="textgen.requests"):
        stub.Generate(greedy(3, request_id="logged"))
        rpc_error(lambda: stub.Generate(pb.GenerateRequest(request_id="bad")))
    lines = {r.getMessage() for r in caplog.records if r.name == "textgen.requests"}
    ok = next(line for line in lines if '"request_id": "logged"' in line)
    assert '"code": "OK"' in ok and '"completion_tokens": 3' in ok and '"ttft_s"' in ok
    assert PROMPT not in ok  # no prompt text unless log_prompts
    assert any('"code": "INVALID_ARGUMENT"' in line for line in lines)
    scrape = server.server.metrics.exposition()
    assert 'textgen_requests_total{code="INVALID_ARGUMENT",rpc="Generate"}' in scrape


def test_log_prompts_adds_the_texts() -> None:
    record = CallRecord(rpc="Generate", request_id="r", prompt=PROMPT, text=" jumps")
    assert "prompt" not in record.fields(log_prompts=False)
    fields = record.fields(log_prompts=True)
    assert (fields["prompt"], fields["text"]) == (PROMPT, " jumps")


# --- limits -------------------------------------------------------------------------------------------------


@pytest.fixture
def small_server(loop: LoopThread, tiny_bundle: Path) -> Iterator[RunningServer]:
    running = RunningServer(
        loop,
        loopback_settings(tiny_bundle, max_batch_size=1, max_queue=1, max_message_bytes=2048),
        InjectedFaults(slow_seconds=0.02),
    )
    yield running
    running.stop()


@pytest.fixture
def busy_row(small_server: RunningServer) -> Iterator[BusyRow]:
    """A stub, and a 40-token stream that holds the small server's only row for ~0.8 s (slowed decode)."""
    with grpc.insecure_channel(small_server.target) as chan:
        stub = pb_grpc.TextGenerationStub(chan)
        running = stub.GenerateStream(greedy(40, request_id="slow-busy"))
        next(running)  # the row is taken
        yield stub, running


def test_queue_full_is_resource_exhausted(
    small_server: RunningServer,
    busy_row: BusyRow,
) -> None:
    stub, running = busy_row
    queued = stub.GenerateStream(greedy(2))
    waiting = threading.Thread(target=lambda: list(queued))
    waiting.start()
    small_server.wait_for(lambda s: s.waiting == 1)
    error = rpc_error(lambda: stub.Generate(greedy(2)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in error.details()
    assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH
    waiting.join(10)


def test_an_urgent_request_preempts_low_priority_streams_that_then_finish_in_full(
    loop: LoopThread, tiny_bundle: Path
) -> None:
    # Two rows, both held by slowed low-priority streams, a third waiting: an urgent request preempts one
    # of them and its first token comes before the queued one's; each stream ends with the tokens it gives
    # alone.
    settings = loopback_settings(tiny_bundle, max_batch_size=2, max_queue=2, scheduling_policy="priority")
    server = RunningServer(loop, settings, InjectedFaults(slow_seconds=0.02))
    seeded = pb.SamplingParams(temperature=1.0, seed=11)
    lows = {f"slow-low-{i}": greedy(30, priority=5, sampling=seeded if i else None) for i in range(3)}
    try:
        with grpc.insecure_channel(server.target) as chan:
            stub = pb_grpc.TextGenerationStub(chan)
            alone = {rid: list(stub.Generate(request).token_ids) for rid, request in lows.items()}
            first_tokens: dict[str, float] = {}
            streamed: dict[str, list[pb.GenerateStreamResponse]] = {}

            def read(rid: str, request: pb.GenerateRequest) -> None:
                request.request_id = rid
                for part in stub.GenerateStream(request):
                    first_tokens.setdefault(rid, time.monotonic())
                    streamed.setdefault(rid, []).append(part)

            readers = [threading.Thread(target=read, args=item) for item in lows.items()]
            for reader in readers[:2]:
                reader.start()
            server.wait_for(lambda s: s.running == 2)
            readers[2].start()
            server.wait_for(lambda s: s.waiting == 1)
            urgent = threading.Thread(target=read, args=("slow-urgent", greedy(20, priority=-1)))
            urgent.start()
            server.wait_for(lambda s: server.metric("textgen_preemptions_total") == 1)
            # The preempted stream waits in the queue beside the third: the queue is full, whatever priority.
            server.wait_for(lambda s: s.waiting == 2)
            error = rpc_error(lambda: stub.Generate(greedy(2, priority=-9)))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for reader in (urgent, *readers):
                reader.join(30)
    finally:
        server.stop()
    assert first_tokens["slow-urgent"] < first_tokens["slow-low-2"]
    assert sum(len(part.token_ids) for part in streamed["slow-urgent"]) == 20
    for rid, tokens in alone.items():
        parts = streamed[rid]
        assert [t for part in parts for t in part.token_ids] == tokens and len(tokens) == 30
        finished = [part.finish_reason for part in parts if part.finish_reason]
        assert finished == [pb.FINISH_REASON_LENGTH]


def test_deadline_while_queued_leaves_the_queue(
    small_server: RunningServer,
    busy_row: BusyRow,
) -> None:
    stub, running = busy_row
    error = rpc_error(lambda: stub.Generate(greedy(2), timeout=0.2))
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    small_server.wait_for(lambda s: s.waiting == 0, timeout=1.0)
    assert small_server.snapshot().running == 1  # the running stream is unaffected
    assert list(running)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_oversized_message_is_refused_by_the_transport(small_server: RunningServer) -> None:
    with grpc.insecure_channel(small_server.target) as chan:
        stub = pb_grpc.TextGenerationStub(chan)
        error = rpc_error(lambda: stub.Generate(pb.GenerateRequest(text="x" * 4096)))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stub.Generate(greedy(2)).usage.completion_tokens == 2


def test_stream_interval_sends_the_first_token_at_once_then_fuller_messages(
    loop: LoopThread, tiny_bundle: Path
) -> None:
    # An interval longer than the whole generation: the first token goes out alone (time to first token is
    # not delayed), the other 11 travel together in the message that ends the generation. Slow decode steps
    # keep the first message from being merged with the rest by a stream that lags (the tiny model is fast).
    slow = InjectedFaults(slow_seconds=0.02, slow_prefix="")
    running = RunningServer(loop, loopback_settings(tiny_bundle, stream_interval_ms=10_000), slow)
    try:
        with grpc.insecure_channel(running.target) as chan:
            stub = pb_grpc.TextGenerationStub(chan)
            whole = stub.Generate(greedy())
            parts = list(stub.GenerateStream(greedy()))
    finally:
        running.stop()
    assert [len(p.token_ids) for p in parts] == [1, 11, 0]
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason == pb.FINISH_REASON_LENGTH and parts[-1].usage.completion_tokens == 12


def test_a_repeated_prompt_is_served_from_the_prefix_cache(loop: LoopThread, tiny_bundle: Path) -> None:
    running = RunningServer(
        loop, loopback_settings(tiny_bundle, prefix_cache_rows=1, prefix_cache_min_tokens=4)
    )
    request = pb.GenerateRequest(
        text=PROMPT * 4, stopping=pb.StoppingCriteria(max_new_tokens=5, ignore_eos=True)
    )
    try:
        with grpc.insecure_channel(running.target) as chan:
            stub = pb_grpc.TextGenerationStub(chan)
            first = stub.Generate(request)
            again = stub.Generate(request)
            streamed = list(stub.GenerateStream(request))
        scrape = running.server.metrics.exposition()
    finally:
        running.stop()
    prompt_tokens = first.usage.prompt_tokens
    assert first.usage.cached_prompt_tokens == 0
    reused = prompt_tokens - MIN_PIECE  # the last ones run again: the last one's logits pick the next token
    assert again.usage.cached_prompt_tokens == streamed[-1].usage.cached_prompt_tokens == reused
    assert list(again.token_ids) == list(first.token_ids)
    assert [t for m in streamed for t in m.token_ids] == list(first.token_ids)
    assert f"textgen_prompt_tokens_cached_total {2.0 * reused}" in scrape


def test_scheduling_settings_reach_the_scheduler(tiny_bundle: Path) -> None:
    settings = loopback_settings(
        tiny_bundle, prefill_chunk_tokens=16, stream_interval_ms=25, max_wait_seconds=0.5
    )
    limits = scheduler_limits(settings)
    assert limits.prefill_chunk_tokens == 16 and limits.max_wait_seconds == 0.5
    assert limits.stream_interval_seconds == pytest.approx(0.025)

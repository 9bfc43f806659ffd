"""Bad input against a real server: random requests get OK or INVALID_ARGUMENT, quickly, and change nothing.

Hypothesis draws whole GenerateRequests (any Unicode, empty and huge texts; empty, out-of-range and huge token
id lists; negative, NaN, infinite and extreme sampling and stopping values) and sends each, unary or streamed,
to one tiny-bundle server. Transport limits and the context check refuse before the scheduler sees anything,
and the metrics port never shows what a request said.
"""

from __future__ import annotations

import datetime
import hmac
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, rpc_error

import serve.api.auth
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 1024 * 1024  # above every drawn request (the largest huge text is ~320 KB of UTF-8)
CALL_BOUND = datetime.timedelta(seconds=15)  # one unary or streamed call, on a loaded 2-core machine
UINT32 = st.integers(0, 2**32 - 1)
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = st.floats(width=32)  # NaN, +-inf, +-0, subnormals and the extremes included


@pytest.fixture(scope="module")
def server(loop: LoopThread, tiny_bundle: Path) -> Iterator[RunningServer]:
    running = RunningServer(
        loop,
        loopback_settings(
            tiny_bundle, max_new_tokens=16, default_max_new_tokens=4, max_message_bytes=MAX_MESSAGE_BYTES
        ),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.TextGenerationStub]:
    with grpc.insecure_channel(
        server.target, options=[("grpc.max_send_message_length", 8 * MAX_MESSAGE_BYTES)]
    ) as channel:
        yield pb_grpc.TextGenerationStub(channel)


def greedy(prompt: str = "the quick brown fox") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True))


def counted(server: RunningServer, code: str) -> float:
    value = server.server.metrics.registry.get_sample_value(
        "textgen_requests_total", {"rpc": "Generate", "code": code}
    )
    return value or 0.0


# --- strategies ---------------------------------------------------------------------------------------------


def repeated(piece: st.SearchStrategy[str] | st.SearchStrategy[list[int]], most: int) -> st.SearchStrategy:
    """A short draw repeated up to `most` times: huge inputs without drawing every element."""
    return st.builds(lambda part, times: part * times, piece, st.integers(1, most))


# Each field has a plausible strategy (what a working client sends) and a wild one (anything the wire type can
# carry). A request takes a few fields wild, often none, so draws reach generation as well as every refusal.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "request_id": st.text(max_size=40),
    "temperature": st.floats(0, 2, width=32),
    "top_k": st.integers(0, 400),
    "top_p": st.floats(0, 1, width=32),
    "repetition_penalty": st.one_of(st.just(0.0), st.floats(0.5, 2, width=32)),
    "max_new_tokens": st.integers(0, 16),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=2),
    # <= 12 characters are <= 48 byte-level tokens: room for 16 new ones in the tiny model's 64.
    "text": st.text(min_size=1, max_size=12),
    "token_ids": st.lists(st.integers(0, 319), min_size=1, max_size=40),
}
WILD: dict[str, st.SearchStrategy] = {
    "request_id": st.text(max_size=160),
    "temperature": FLOAT32,
    "top_k": UINT32,
    "top_p": FLOAT32,
    "repetition_penalty": FLOAT32,
    "max_new_tokens": UINT32,
    "stop": st.lists(st.text(max_size=80), max_size=10),
    "text": st.one_of(st.text(max_size=300), repeated(st.text(min_size=1, max_size=4), 20_000)),
    "token_ids": st.one_of(
        st.lists(st.integers(0, 400), max_size=80),  # the tiny vocabulary is 0..319: both sides of its edge
        st.lists(UINT32, max_size=20),
        repeated(st.lists(UINT32, min_size=1, max_size=4), 20_000),
    ),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    # "input" wild: the request has neither text nor token ids.
    count = draw(st.integers(0, 3))
    wild = draw(st.frozensets(st.sampled_from([*sorted(WILD), "input"]), min_size=count, max_size=count))

    def field(name: str) -> Any:
        return draw((WILD if name in wild else PLAUSIBLE)[name])

    request = pb.GenerateRequest(
        request_id=field("request_id"),
        sampling=pb.SamplingParams(
            temperature=field("temperature"),
            top_k=field("top_k"),
            top_p=field("top_p"),
            repetition_penalty=field("repetition_penalty"),
        ),
        stopping=pb.StoppingCriteria(
            max_new_tokens=field("max_new_tokens"), stop=field("stop"), ignore_eos=draw(st.booleans())
        ),
        include_logprobs=draw(st.booleans()),
    )
    if draw(st.booleans()):
        request.sampling.seed = draw(UINT64)
    if "input" in wild:
        return request
    if draw(st.booleans()):
        request.text = field("text")
    else:
        request.token_ids.ids.extend(field("token_ids"))
    return request


# --- the property -------------------------------------------------------------------------------------------


def check_unary(stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest) -> None:
    response = stub.Generate(request, timeout=CALL_BOUND.total_seconds())
    assert response.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert response.usage.completion_tokens == len(response.token_ids)
    # Only an end-of-sequence first token ends a generation with nothing (EOS itself is not returned).
    assert response.token_ids or response.finish_reason == pb.FINISH_REASON_EOS
    if request.stopping.max_new_tokens:
        assert len(response.token_ids) <= request.stopping.max_new_tokens


def check_stream(stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest) -> None:
    *body, last = list(stub.GenerateStream(request, timeout=CALL_BOUND.total_seconds()))
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert all(message.finish_reason == pb.FINISH_REASON_UNSPECIFIED for message in body)
    assert last.usage.completion_tokens == sum(len(message.token_ids) for message in body)


def check_answer(stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest, stream: bool) -> str:
    """OK with a consistent result, or INVALID_ARGUMENT that says why; anything else fails the test."""
    try:
        (check_stream if stream else check_unary)(stub, request)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert exc.details().strip(), "INVALID_ARGUMENT without a message"
        return exc.code().name
    return "OK"


def test_random_requests_get_ok_or_invalid_argument_and_change_nothing(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    before = stub.Generate(greedy())
    answers: Counter[str] = Counter()

    # derandomize: the fast suite explores the same 60 requests every run, so a failure is reproducible.
    @settings(
        max_examples=60,
        deadline=CALL_BOUND,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=generate_requests(), stream=st.booleans())
    def property_(request: pb.GenerateRequest, stream: bool) -> None:
        answers[check_answer(stub, request, stream)] += 1

    property_()
    assert answers["OK"] >= 10 and answers["INVALID_ARGUMENT"] >= 10, answers  # both paths were exercised
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    idle = server.wait_idle()
    assert idle.kv_slots_used == 0 and idle.kv_tokens_reserved == 0
    after = stub.Generate(greedy())
    assert (after.text, list(after.token_ids)) == (before.text, list(before.token_ids))


# --- refused before any work --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_",
    [
        pb.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1)),
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1] * (MAX_MESSAGE_BYTES // 5 + 1))),
        pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(stop=["y" * MAX_MESSAGE_BYTES])),
    ],
    ids=["text", "token_ids", "stop"],
)
def test_oversized_messages_are_refused_by_the_transport(
    stub: pb_grpc.TextGenerationStub, server: RunningServer, request_: pb.GenerateRequest
) -> None:
    assert request_.ByteSize() > MAX_MESSAGE_BYTES
    steps, outcomes = server.model.scheduler.steps(), server.snapshot().outcomes
    handled = sum(counted(server, code) for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"))
    for call in (stub.Generate, stub.GenerateStream):
        error = rpc_error(lambda call=call: call(request_, timeout=30))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "Received message larger than max" in error.details()  # the server's limit, not ours
    # The handler never ran: nothing counted, queued or stepped.
    assert sum(counted(server, code) for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")) == handled
    assert server.model.scheduler.steps() == steps and server.snapshot().outcomes == outcomes


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_queued(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    context = server.model.limits.context_length
    metrics = server.server.metrics.registry
    queued_before = metrics.get_sample_value("textgen_request_queue_seconds_count")
    steps, outcomes = server.model.scheduler.steps(), server.snapshot().outcomes
    invalid_before = counted(server, "INVALID_ARGUMENT")
    too_long = [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * context)),
        pb.GenerateRequest(text="lorem ipsum dolor sit amet " * context),
    ]
    for request in too_long:
        error = rpc_error(lambda request=request: stub.Generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"the context holds {context}" in error.details()
    assert counted(server, "INVALID_ARGUMENT") == invalid_before + len(too_long)
    assert metrics.get_sample_value("textgen_request_queue_seconds_count") == queued_before
    assert server.model.scheduler.steps() == steps and server.snapshot().outcomes == outcomes


# --- the metrics port ---------------------------------------------------------------------------------------


def test_metrics_expose_no_request_content(stub: pb_grpc.TextGenerationStub, server: RunningServer) -> None:
    prompt, request_id = "zebra quokka narwhal 7f3a", "req-secret-91c2"
    stub.Generate(pb.GenerateRequest(request_id=request_id, text=prompt))
    list(stub.GenerateStream(pb.GenerateRequest(request_id=f"{request_id}-s", text=prompt)))
    rpc_error(lambda: stub.Generate(pb.GenerateRequest(request_id=f"{request_id}-x", text=prompt * 500)))
    url = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    deadline = time.monotonic() + 5
    while True:  # the handler counts a call just after the client has its answer
        with urllib.request.urlopen(url, timeout=10) as response:
            scrape = response.read().decode()
        if 'textgen_requests_total{code="INVALID_ARGUMENT",rpc="Generate"}' in scrape:
            break
        assert time.monotonic() < deadline, scrape
        time.sleep(0.05)
    assert 'textgen_requests_total{code="OK",rpc="GenerateStream"}' in scrape
    for secret in ("zebra", "quokka", "narwhal", "7f3a", "91c2"):
        assert secret not in scrape


# --- bearer token -------------------------------------------------------------------------------------------


def test_the_bearer_token_is_compared_in_constant_time(
    loop: LoopThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `==` on the token would leak, through timing, how much of a guess is right."""
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(serve.api.auth.hmac, "compare_digest", spy)
    interceptor = serve.api.auth.TokenAuthInterceptor("s3cret")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    async def continuation(_details: object) -> grpc.RpcMethodHandler:
        return handler

    def call(token: str) -> grpc.RpcMethodHandler:
        details: Any = SimpleNamespace(
            method="/textgen.v1.TextGeneration/Generate",
            invocation_metadata=(("authorization", f"Bearer {token}"),),
        )
        return loop.run(interceptor.intercept_service(continuation, details))

    assert call("s3cret") is handler
    assert call("s3creT") is not handler
    assert compared == [(b"Bearer s3cret", b"Bearer s3cret"), (b"Bearer s3creT", b"Bearer s3cret")]

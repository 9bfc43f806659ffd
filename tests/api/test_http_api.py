"""The OpenAI-compatible HTTP API end to end: a real server (tiny bundle), gRPC and HTTP on loopback ports,
called with the official `openai` SDK (and httpx for what the SDK does not send). What HTTP returns is
checked against what gRPC returns for the same request, on the same server. Servers configured otherwise
(a token, TLS, no chat template, one row) are test_http_server.py's."""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from engine_faults import InjectedFaults
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.scheduling.request import RequestTracker

PROMPT = "the quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You complete Python."},
    {"role": "user", "content": "def add(a, b):"},
]


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A request "held-X" decodes no further than its first token until the file gates/held-X exists."""
    return tmp_path_factory.mktemp("gates")


@pytest.fixture
def cancel_opens_gate(gates: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A held request goes on once its cancel reaches the engine's side (the engine runs in this process):
    it is then still running when the client leaves, and cannot end before the cancel is seen."""
    request_cancel = RequestTracker.request_cancel

    def cancel_and_open(tracker: RequestTracker) -> None:
        request_cancel(tracker)
        (gates / tracker.request_id).touch()

    monkeypatch.setattr(RequestTracker, "request_cancel", cancel_and_open)


@pytest.fixture(scope="module")
def server(loop: LoopThread, tiny_bundle: Path, gates: Path) -> Iterator[RunningServer]:
    """Requests with ids "slow-..." decode slowly, "held-..." wait for their gate, "doomed..." fail a decode
    step."""
    settings = loopback_settings(
        tiny_bundle,
        http_port=free_port(),
        max_new_tokens=32,
        default_max_new_tokens=8,
        max_stop_strings=2,
        max_n=4,
        engine_process=False,
        max_message_bytes=64 * 1024,
    )
    running = RunningServer(loop, settings, InjectedFaults(gate_dir=str(gates)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def base(server: RunningServer) -> str:
    return server.http_base


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.TextGenerationStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="module")
def model(server: RunningServer) -> str:
    return server.model.name


def grpc_greedy(stub: pb_grpc.TextGenerationStub, n: int, **fields: Any) -> pb.GenerateResponse:
    return stub.Generate(
        pb.GenerateRequest(stopping=pb.StoppingCriteria(max_new_tokens=n, ignore_eos=True), **fields)
    )


GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


# --- the happy paths ----------------------------------------------------------------------------------------


def test_models_lists_the_bundle(client: openai.OpenAI, server: RunningServer) -> None:
    (card,) = client.models.list().data
    assert card.id == server.model.name and card.owned_by == "textgen"
    assert (
        card.model_extra is not None
        and card.model_extra["max_model_len"] == server.model.limits.context_length
    )


def test_tokenize_and_detokenize_as_grpc_and_the_generation_routes_count(
    base: str, client: openai.OpenAI, model: str, server: RunningServer, stub: pb_grpc.TextGenerationStub
) -> None:
    ours = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    theirs = stub.Tokenize(pb.TokenizeRequest(text=PROMPT))
    assert ours["tokens"] == list(theirs.ids) and ours["token_strs"] == list(theirs.tokens)
    assert (
        ours["count"]
        == len(ours["tokens"])
        == client.completions.create(model=model, prompt=PROMPT, max_tokens=1).usage.prompt_tokens
    )  # type: ignore[union-attr]
    assert ours["max_model_len"] == server.model.limits.context_length
    plain = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    unspecial = stub.Tokenize(pb.TokenizeRequest(text=PROMPT, add_special_tokens=False))
    assert plain["tokens"] == list(unspecial.ids) and plain["token_strs"] is None
    chat = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "model": model}).json()
    usage = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1).usage  # type: ignore[arg-type]
    assert usage is not None and chat["count"] == usage.prompt_tokens
    back = httpx.post(f"{base}/detokenize", json={"tokens": ours["tokens"]}).json()
    assert back == {"prompt": stub.Detokenize(pb.DetokenizeRequest(ids=ours["tokens"])).text}
    assert httpx.post(f"{base}/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    assert server.metric("textgen_requests_total", rpc="/tokenize", code="OK") >= 3
    assert server.metric("textgen_requests_total", rpc="/detokenize", code="OK") >= 2


def test_completion_equals_grpc_generate_streamed_or_not(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str
) -> None:
    expected = grpc_greedy(stub, 12, text=PROMPT)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, **GREEDY)
    (choice,) = whole.choices
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (expected.usage.prompt_tokens, 12)
    assert whole.usage.total_tokens == expected.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *body, usage = chunks
    assert "".join(c.choices[0].text for c in body) == expected.text
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 12
    assert all(c.usage is None for c in body)


def test_token_id_prompts_and_lists_of_prompts(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str
) -> None:
    ids = list(stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).ids)
    by_text = grpc_greedy(stub, 5, text=PROMPT).text
    other = grpc_greedy(stub, 5, text="import os").text
    assert (
        client.completions.create(model=model, prompt=ids, max_tokens=5, **GREEDY).choices[0].text == by_text
    )
    many = client.completions.create(model=model, prompt=[PROMPT, "import os"], max_tokens=5, **GREEDY)
    assert [c.text for c in many.choices] == [by_text, other] and [c.index for c in many.choices] == [0, 1]
    batch = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=5, **GREEDY)
    assert batch.choices[0].text == by_text and batch.usage is not None
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_chat_equals_grpc_messages_streamed_or_not(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str, server: RunningServer
) -> None:
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in MESSAGES])
    expected = grpc_greedy(stub, 10, messages=messages)
    rendered = server.model.chat.render(MESSAGES)  # type: ignore[union-attr]
    tokens = server.model.tokenizer.encode(rendered, add_special_tokens=False).ids
    assert expected.usage.prompt_tokens == len(tokens)
    reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=10, **GREEDY)  # type: ignore[arg-type]
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert reply.usage is not None and reply.usage.prompt_tokens == len(tokens)
    parts = [{"type": "text", "text": "def add"}, {"type": "text", "text": "(a, b):"}]
    as_parts = client.chat.completions.create(
        model=model,
        messages=[MESSAGES[0], {"role": "user", "content": parts}],  # type: ignore[list-item]
        max_completion_tokens=10,
        **GREEDY,
    )
    joined = [MESSAGES[0], {"role": "user", "content": "def add\n(a, b):"}]
    assert (
        as_parts.choices[0].message.content
        == grpc_greedy(
            stub, 10, messages=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in joined])
        ).text
    )
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    *body, usage = chunks
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in body) == expected.text
    assert body[-1].choices[0].finish_reason == "length"
    assert usage.usage is not None and usage.usage.completion_tokens == 10


def test_logprobs_and_top_logprobs(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str
) -> None:
    expected = grpc_greedy(stub, 5, text=PROMPT, include_logprobs=True, top_logprobs=3)
    legacy = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=3, **GREEDY)
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-5)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens or []) == legacy.choices[0].text
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,  # type: ignore[arg-type]
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and math.isfinite(entry.logprob) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)  # greedy: the top one
        assert entry.bytes is not None
    streamed = [
        e
        for c in client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=5,
            logprobs=True,
            stream=True,
            **GREEDY,  # type: ignore[arg-type]
        )
        for e in ((c.choices[0].logprobs.content or []) if c.choices and c.choices[0].logprobs else [])
    ]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_echo_logprobs_equal_grpc_prompt_logprobs_and_score_without_generating(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str
) -> None:
    expected = grpc_greedy(stub, 3, text=PROMPT, include_prompt_logprobs=True, include_logprobs=True)
    prompt_len = expected.usage.prompt_tokens
    echoed = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, **GREEDY
    )
    (choice,) = echoed.choices
    assert choice.text == PROMPT + expected.text
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    lps = choice.logprobs.token_logprobs
    assert lps[0] is None and len(lps) == prompt_len + 3
    assert lps[1:prompt_len] == pytest.approx(list(expected.prompt_logprobs), abs=1e-5)
    assert lps[prompt_len:] == pytest.approx(list(expected.logprobs), abs=1e-5)
    scored = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, **GREEDY
    )
    assert (
        scored.choices[0].text == PROMPT and scored.usage is not None and scored.usage.completion_tokens == 0
    )
    only = scored.choices[0].logprobs
    assert only is not None and only.token_logprobs is not None
    assert only.token_logprobs[1:] == pytest.approx(list(expected.prompt_logprobs), abs=1e-5)
    streamed = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == PROMPT


def test_n_choices_with_a_seed(client: openai.OpenAI, model: str, server: RunningServer) -> None:
    def ask(**kwargs: Any) -> list[str]:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, **kwargs)
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    before = len(server.model.scheduler.steps())
    first = ask(n=3, seed=11)
    prefills = [s for s in server.model.scheduler.steps()[before:] if s.phase == "prefill"]
    prompt_len = len(server.model.tokenizer.encode(PROMPT).ids)
    # One prefill of the prompt, forked into the other choices' rows: 3 rows, one prompt's tokens computed.
    assert [(s.rows, s.padded_tokens) for s in prefills] == [(3, prompt_len)]
    # Other requests in the batch meanwhile change nothing: each choice draws from its own seeded stream.
    busy = threading.Thread(target=lambda: ask(n=2, seed=99))
    busy.start()
    again = ask(n=3, seed=11)
    busy.join()
    assert first == again and len(set(first)) > 1
    assert ask(n=1, seed=11) == first[:1]  # choice 0 keeps the seed
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        seed=5,
        stream=True,  # type: ignore[arg-type]
    )
    texts = ["", ""]
    for chunk in chat:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, n=2, seed=5)  # type: ignore[arg-type]
    assert texts == [c.message.content for c in whole.choices]


def test_stop_strings_penalties_and_vllm_fields(
    client: openai.OpenAI, stub: pb_grpc.TextGenerationStub, model: str
) -> None:
    (the,) = stub.Tokenize(pb.TokenizeRequest(text=" the")).ids
    bias = {str(the): 100}
    stopped = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, logit_bias=bias, stop="he t"
    )
    assert stopped.choices[0].text == " t" and stopped.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, logit_bias=bias, stop=["he t"],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == " the t"
    plain = grpc_greedy(stub, 12, text=PROMPT).token_ids
    at = next(i for i in range(12) if plain[i] not in plain[:i])
    extra = {"ignore_eos": True, "stop_token_ids": [plain[at]], "min_tokens": 0, "top_k": -1}
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra
    )
    assert (
        cut.choices[0].finish_reason == "stop" and cut.usage is not None and cut.usage.completion_tokens == at
    )
    penalized = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, frequency_penalty=2.0, presence_penalty=0.5, **GREEDY
    )
    expected = grpc_greedy(
        stub, 12, text=PROMPT, sampling=pb.SamplingParams(frequency_penalty=2.0, presence_penalty=0.5)
    )
    assert penalized.choices[0].text == expected.text


def test_request_id_is_echoed_logged_and_named_in_internal_errors(
    base: str, server: RunningServer, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    with caplog.at_level(logging.INFO, logger="textgen.requests"):
        ok = httpx.post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": "http-id-1"})
        made = httpx.post(f"{base}/v1/completions", json=body)
        failed = httpx.post(
            f"{base}/v1/completions", json={**body, "max_tokens": 4}, headers={"X-Request-Id": "doomed-7"}
        )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "http-id-1"
    assert ok.json()["id"] == "cmpl-http-id-1"
    assert made.headers["x-request-id"] and made.headers["x-request-id"] != "http-id-1"
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert (
        error["type"] == "server_error" and "doomed-7" in error["message"] and "Traceback" not in failed.text
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "textgen.requests"]
    line = json.loads(next(line for line in lines if "http-id-1" in line))
    assert line["rpc"] == "/v1/completions" and line["code"] == "OK" and line["status"] == 200
    assert any('"doomed-7"' in line and '"INTERNAL"' in line for line in lines)
    scrape = server.server.metrics.exposition()
    assert 'textgen_requests_total{code="OK",rpc="/v1/completions"}' in scrape
    assert 'textgen_requests_total{code="INTERNAL",rpc="/v1/completions"}' in scrape


# --- errors -----------------------------------------------------------------------------------------------


C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
ERRORS: list[tuple[str, Any, int, str]] = [
    (C, b"{not json", 400, "not valid JSON"),
    (C, {"prompt": PROMPT, "temperature": 2.5}, 400, "temperature: Input should be less than or equal to 2"),
    (C, {"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    (C, {"prompt": PROMPT, "presence_penalty": -3}, 400, "presence_penalty"),
    (C, {"prompt": PROMPT, "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    (C, {"prompt": PROMPT, "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    (C, {"prompt": PROMPT, "n": 5}, 400, "n = 5; allowed 1..4 (the server's max_n)"),
    (C, {"prompt": PROMPT, "max_tokens": -1}, 400, "max_tokens"),
    (C, {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens = 0 generates nothing"),
    (
        C,
        {"prompt": PROMPT, "max_tokens": 500},
        400,
        "exceeds the context length 128: allowed max_tokens 1..",  # the cap (32) lowers what fits
    ),
    (C, {"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),
    (C, {"prompt": PROMPT, "best_of": 2}, 400, "best_of is not supported"),
    (C, {"prompt": PROMPT, "suffix": "x"}, 400, "suffix is not supported"),
    (C, {"prompt": PROMPT, "logit_bias": {"a": 1}}, 400, "logit_bias keys are token ids"),
    (C, {"prompt": PROMPT, "logit_bias": {"3": 101}}, 400, "logit_bias[3] must be in [-100, 100]"),
    (C, {"prompt": PROMPT, "stop": ["a", "b", "c"]}, 400, "3 stop strings given; at most 2"),
    (C, {"prompt": PROMPT, "min_tokens": 9}, 400, "min_tokens is 9; allowed 0..8 (max_tokens)"),
    (C, {"prompt": ""}, 400, "prompt is empty"),
    (C, {"prompt": []}, 400, "prompt is empty"),
    (C, {"prompt": [1, 10**6]}, 400, "prompt[1] = 1000000 is outside the vocabulary"),
    (C, {"prompt": [1] * 500}, 400, "prompt has 500 tokens; allowed 1.."),
    (C, {"prompt": [[1], []]}, 400, "prompt[1] is empty"),
    (C, {}, 400, "prompt: Field required"),
    (C, {"prompt": PROMPT, "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    (C, {"prompt": PROMPT, "tools": [{"type": "function"}]}, 400, "tools is not supported"),
    (CHAT, {"messages": []}, 400, "messages is empty"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role is 'robot'"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content is required"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "is not a text part"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs needs logprobs: true"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (
        CHAT,
        {"messages": USER, "response_format": {"type": "xml"}},
        400,
        "response_format.type must be text, json_object or json_schema",
    ),
    (
        C,
        {"prompt": PROMPT, "guided_regex": "a+", "structured_outputs": {"choice": ["x"]}},
        400,
        "give one structured-output constraint, not 2",
    ),
    (C, {"prompt": PROMPT, "guided_regex": "(unclosed"}, 400, "regex"),
    (C, {"prompt": PROMPT, "guided_choice": "x"}, 400, "guided_choice must be a list of strings"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_tokens = 0 generates nothing"),
    (C, {"prompt": PROMPT, "priority": 1.5}, 400, "priority: Input should be a valid integer"),
    (CHAT, {"messages": USER, "priority": "1"}, 400, "priority: Input should be a valid integer"),
    (C, {"prompt": PROMPT, "priority": 2**31}, 400, "priority: Input should be less than or equal"),
    ("/v1/nothing", {}, 404, "no route POST /v1/nothing"),
    ("/tokenize", {}, 400, "give exactly one of prompt and messages"),
    ("/tokenize", {"prompt": PROMPT, "messages": USER}, 400, "give exactly one of prompt and messages"),
    (
        "/tokenize",
        {"messages": USER, "add_special_tokens": True},
        400,
        "add_special_tokens applies to a prompt",
    ),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role is 'robot'"),
    ("/tokenize", {"prompt": PROMPT, "model": "gpt-4"}, 404, "the model 'gpt-4' does not exist"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens[1] = 1000000 is outside the vocabulary"),
    ("/detokenize", {}, 400, "tokens: Field required"),
]


@pytest.mark.parametrize(("path", "body", "status", "message"), ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_errors_in_openais_shape(base: str, path: str, body: Any, status: int, message: str) -> None:
    for stream in (False, True):
        payload = body if isinstance(body, bytes) else json.dumps({**body, "stream": stream})
        response = httpx.post(f"{base}{path}", content=payload, headers={"Content-Type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert message in error["message"] and set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"


def test_structured_output_from_response_format_and_vllms_fields(client: openai.OpenAI, model: str) -> None:
    choices = ["alpha", "beta gamma"]  # greedy, and room for the longer one spelt a byte a token
    picked = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"guided_choice": choices}
    )
    assert picked.choices[0].text in choices and picked.choices[0].finish_reason == "stop"
    newer = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert re.fullmatch("[0-9]{3}", newer.choices[0].text), newer.choices[0].text
    schema = {"type": "string", "enum": ["yes", "no"]}
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "yes or no?"}],
        max_tokens=32,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    text = chat.choices[0].message.content
    assert text is not None and json.loads(text) in ("yes", "no") and chat.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=32,
        temperature=0,
        stream=True,
        extra_body={"guided_choice": choices},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) in choices


def test_openapi_describes_the_generation_routes_answers(base: str) -> None:
    schema = httpx.get(f"{base}/openapi.json", timeout=10).json()
    schemas = schema["components"]["schemas"]

    def answer(path: str, status: str = "200") -> dict[str, Any]:
        content = schema["paths"][path]["post"]["responses"][status]["content"]["application/json"]
        return schemas[content["schema"]["$ref"].rsplit("/", 1)[1]]

    chat, completion = answer("/v1/chat/completions"), answer("/v1/completions")
    assert {"choices", "usage"} <= set(chat["properties"]) and "usage" in chat["required"]
    assert {"choices", "usage"} <= set(completion["properties"]) and "usage" not in completion["required"]
    assert set(answer("/v1/chat/completions", "400")["properties"]) == {"error"}
    assert "tokens" in answer("/tokenize")["required"]
    response = answer("/v1/responses")
    assert {"id", "output", "status", "usage"} <= set(response["required"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert "text/event-stream" in schema["paths"][path]["post"]["responses"]["200"]["content"], path


def test_openapi_states_the_lengths_the_routes_check(base: str) -> None:
    """An empty prompt, chat or Responses input, and too many prompts, are refused (ERRORS above, with the
    routes' own messages) and the schema says so: a client or a fuzzer built from it knows."""
    schema = httpx.get(f"{base}/openapi.json", timeout=10).json()

    def field(path: str, name: str) -> dict[str, Any]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]["properties"][name]

    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": {"type": "integer"}, "minItems": 1}
    prompts = {"type": "array", "minItems": 1, "maxItems": 64}
    assert field("/v1/completions", "prompt")["anyOf"] == [
        text,
        {**prompts, "items": text},
        ids,
        {**prompts, "items": ids},
    ]
    assert field("/v1/chat/completions", "messages")["minItems"] == 1
    assert field("/tokenize", "messages")["anyOf"][0]["minItems"] == 1
    string, items = field("/v1/responses", "input")["anyOf"]
    assert string == {"type": "string"} and items["minItems"] == 1  # "" is a user message of its own
    assert "minItems" not in field("/detokenize", "tokens")  # no ids decode to "" (the tokenize test)


def test_the_body_is_json_whatever_its_content_type(base: str) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2})
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):  # curl -d, a bare client
        reply = httpx.post(f"{base}/v1/completions", content=body, headers={"Content-Type": content_type})
        assert reply.status_code == 200, reply.text
    form = httpx.post(f"{base}/v1/completions", data={"prompt": PROMPT})  # a real form is not JSON
    assert form.status_code == 400 and "not valid JSON" in form.json()["error"]["message"]


def test_the_priority_header_is_an_integer_and_the_body_field_wins(base: str) -> None:
    def post(body: dict[str, Any], header: str) -> httpx.Response:
        payload = {"prompt": PROMPT, "max_tokens": 2, **body}
        return httpx.post(f"{base}/v1/completions", json=payload, headers={"X-Request-Priority": header})

    assert post({}, "-7").status_code == 200
    refused = post({}, "high")
    assert refused.status_code == 400
    assert "X-Request-Priority is 'high'; give an integer" in refused.json()["error"]["message"]
    assert post({"priority": 3}, "high").status_code == 200  # the body's field is the one read


def test_ignored_fields_and_a_body_over_the_limit(base: str, client: openai.OpenAI, model: str) -> None:
    harmless = {
        "user": "u",
        "metadata": {"a": "b"},
        "store": False,
        "parallel_tool_calls": True,
        "whatever": 1,
    }
    ok = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **harmless})
    assert ok.status_code == 200
    big = httpx.post(f"{base}/v1/completions", json={"prompt": "x" * 70_000})
    assert big.status_code == 413 and "exceeds the server's limit" in big.json()["error"]["message"]
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].text is not None


# --- clients that go away ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("cancel_opens_gate")
def test_a_client_that_disconnects_cancels_its_request(base: str, server: RunningServer) -> None:
    cancelled = server.snapshot().outcomes.get("cancelled", 0)
    body = {"prompt": PROMPT, "max_tokens": 30, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"X-Request-Id": "held-sse"}) as r:
        assert r.status_code == 200
        # One iterator for the whole block: a dropped one, closed when the garbage collector gets to it,
        # closes the connection (httpcore), and the server would cancel the request before the test acts.
        lines = r.iter_lines()
        next(lines)  # the first token arrived: the request holds a row until its cancel
        server.wait_for(lambda s: s.running == 1)
    snapshot = server.wait_idle(5.0)  # closing the connection freed it
    assert snapshot.running == 0 and snapshot.kv_slots_used == 0
    assert snapshot.outcomes.get("cancelled", 0) == cancelled + 1
    # Not streamed: the client gives up waiting for the whole completion.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/v1/completions",
            json={**body, "stream": False},
            headers={"X-Request-Id": "held-unary"},
            timeout=httpx.Timeout(5.0, read=0.3),
        )
    deadline = time.monotonic() + 5
    while server.snapshot().outcomes.get("cancelled", 0) < cancelled + 2:
        assert time.monotonic() < deadline, server.snapshot()
        time.sleep(0.01)
    assert server.wait_idle(5.0).running == 0
    scrape = server.server.metrics.exposition()
    assert 'textgen_requests_total{code="CANCELLED",rpc="/v1/completions"} 2.0' in scrape


@pytest.mark.usefixtures("cancel_opens_gate")
def test_a_client_that_leaves_a_streamed_response_cancels_it(base: str, server: RunningServer) -> None:
    cancelled = server.snapshot().outcomes.get("cancelled", 0)
    body = {"input": PROMPT, "max_output_tokens": 30, "stream": True, "ignore_eos": True}
    headers = {"X-Request-Id": "held-responses"}
    with httpx.stream("POST", f"{base}/v1/responses", json=body, headers=headers) as r:
        assert r.status_code == 200
        # response.created goes out at submission; the request then holds a row until its cancel.
        lines = r.iter_lines()  # kept: see the test above
        next(line for line in lines if line == "event: response.created")
        server.wait_for(lambda s: s.running == 1)
    snapshot = server.wait_idle(5.0)  # closing the connection freed its row
    assert snapshot.running == 0 and snapshot.kv_slots_used == 0
    assert snapshot.outcomes.get("cancelled", 0) == cancelled + 1


def test_the_http_socket_sends_small_chunks_at_once(server: RunningServer) -> None:
    """asyncio sets TCP_NODELAY on accepted sockets only when the listener names IPPROTO_TCP: without it, a
    keep-alive connection's stream chunks waited ~40 ms for the client's delayed ACK (TTFT 50 ms, not 5)."""
    import socket

    listener = server.server._http._socket  # type: ignore[union-attr]
    assert listener is not None and listener.proto == socket.IPPROTO_TCP
    assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_bad_requests_leave_the_server_serving(base: str, client: openai.OpenAI, model: str) -> None:
    before = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, **GREEDY).choices[0].text
    for path, body, _status, _message in ERRORS:
        httpx.post(f"{base}{path}", content=body if isinstance(body, bytes) else json.dumps(body))
    assert (
        client.completions.create(model=model, prompt=PROMPT, max_tokens=5, **GREEDY).choices[0].text
        == before
    )

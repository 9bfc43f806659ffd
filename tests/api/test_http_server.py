"""The HTTP server as it is configured and as the scheduler runs its streams, each test on a server of its
own (tiny bundle): a bundle without a chat template, the bearer token and /health, TLS and mTLS with the gRPC
port's files; a chat stream preempted by an urgent request, a queued stream whose client leaves. The routes'
answers on one shared server are test_http_api.py's."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from engine_faults import InjectedFaults
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, free_port

PROMPT = "the quick brown fox"
MESSAGES = [
    {"role": "system", "content": "You complete Python."},
    {"role": "user", "content": "def add(a, b):"},
]
USER = [{"role": "user", "content": "hi"}]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_bundle_without_a_chat_template_refuses_chat(
    loop: LoopThread, tiny_bundle: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_bundle, plain)
    manifest = json.loads((plain / "manifest.json").read_text())
    del manifest["chat_template"]
    (plain / "manifest.json").write_text(json.dumps(manifest))
    running = RunningServer(loop, loopback_settings(plain, http_port=free_port(), engine_process=False))
    try:
        url = f"http://127.0.0.1:{running.server.http_port}"
        refused = httpx.post(f"{url}/v1/chat/completions", json={"messages": USER})
        assert refused.status_code == 400 and "has no chat template" in refused.json()["error"]["message"]
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
        )
    finally:
        running.stop()


def test_auth_token_and_health(loop: LoopThread, tiny_bundle: Path) -> None:
    settings = loopback_settings(
        tiny_bundle, http_port=free_port(), engine_process=False, auth_token="s3cret"
    )
    running = RunningServer(loop, settings)
    try:
        url = f"http://127.0.0.1:{running.server.http_port}"
        assert httpx.get(f"{url}/health").status_code == 200  # no token needed
        missing = httpx.get(f"{url}/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        wrong = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "invalid bearer token" in wrong.json()["error"]["message"]
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert sdk.completions.create(model=running.model.name, prompt=PROMPT, max_tokens=2).choices
        scrape = running.server.metrics.exposition()
        assert 'textgen_requests_total{code="UNAUTHENTICATED",rpc="/v1/models"} 2.0' in scrape
        for route, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(f"{url}{route}", json=body).status_code == 401  # the same front door
            authorized = httpx.post(f"{url}{route}", json=body, headers={"Authorization": "Bearer s3cret"})
            assert authorized.status_code == 200
    finally:
        running.stop()


def test_tls_and_mtls_with_the_grpc_ports_files(loop: LoopThread, tiny_bundle: Path, tmp_path: Path) -> None:
    import ssl

    from server_tools import make_pki

    files = make_pki().write(tmp_path)
    settings = loopback_settings(
        tiny_bundle,
        http_port=free_port(),
        engine_process=False,
        tls_cert=files["server_cert"],
        tls_key=files["server_key"],
        tls_client_ca=files["ca"],
    )
    running = RunningServer(loop, settings)
    try:
        url = f"https://localhost:{running.server.http_port}"
        trusted = ssl.create_default_context(cafile=str(files["ca"]))
        trusted.load_cert_chain(files["client_cert"], files["client_key"])
        assert httpx.get(f"{url}/health", verify=trusted).status_code == 200
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", http_client=httpx.Client(verify=trusted))
        assert sdk.completions.create(model=running.model.name, prompt=PROMPT, max_tokens=2).choices
        no_client_cert = ssl.create_default_context(cafile=str(files["ca"]))
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", verify=no_client_cert)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{running.server.http_port}/health")  # plaintext
    finally:
        running.stop()


def test_a_preempted_chat_stream_only_pauses(loop: LoopThread, tiny_bundle: Path) -> None:
    # One row, held by a slowed low-priority chat stream: an urgent request preempts it, and the stream goes
    # on where it stopped, one role chunk and the very text it gives alone.
    settings = loopback_settings(
        tiny_bundle,
        http_port=free_port(),
        max_batch_size=1,
        scheduling_policy="priority",
        engine_process=False,
    )
    running = RunningServer(loop, settings, InjectedFaults(slow_seconds=0.02))
    low: dict[str, Any] = {"max_tokens": 24, **GREEDY, "extra_body": {"ignore_eos": True, "priority": 5}}
    try:
        client, model = running.openai_client(), running.model.name
        alone = client.chat.completions.create(model=model, messages=MESSAGES, **low)  # type: ignore[arg-type]
        chunks: list[Any] = []

        def stream() -> None:
            chunks.extend(
                client.chat.completions.create(
                    model=model,
                    messages=MESSAGES,  # type: ignore[arg-type]
                    stream=True,
                    extra_headers={"X-Request-Id": "slow-low"},
                    **low,
                )
            )

        reader = threading.Thread(target=stream)
        reader.start()
        running.wait_for(lambda s: s.running == 1)
        urgent = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=4, extra_body={"ignore_eos": True, "priority": 0}
        )
        reader.join(30)
        preemptions = running.metric("textgen_preemptions_total")
    finally:
        running.stop()
    assert urgent.choices[0].finish_reason == "length" and preemptions == 1
    assert [c.choices[0].delta.role for c in chunks if c.choices[0].delta.role] == ["assistant"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_a_queued_stream_whose_client_leaves_leaves_the_queue(loop: LoopThread, tiny_bundle: Path) -> None:
    settings = loopback_settings(
        tiny_bundle,
        http_port=free_port(),
        engine_process=False,
        max_batch_size=1,
        max_message_bytes=64 * 1024,
    )
    running = RunningServer(loop, settings, InjectedFaults(slow_seconds=0.02))
    url = f"http://127.0.0.1:{running.server.http_port}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url, json=body, headers={"X-Request-Id": "slow-holder"}) as holder:
            lines = holder.iter_lines()
            next(lines)  # the only row is taken

            def give_up() -> None:
                with pytest.raises(httpx.ReadTimeout):  # queued: no response before the first token
                    httpx.post(url, json=body, timeout=httpx.Timeout(5.0, read=0.3))

            waiting = threading.Thread(target=give_up)
            waiting.start()
            running.wait_for(lambda s: s.waiting == 1)
            waiting.join(5)
            snapshot = running.wait_for(lambda s: s.waiting == 0)  # the queued one went with its client
            assert snapshot.running == 1 and snapshot.outcomes.get("cancelled", 0) == 1
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the holder is unaffected
        # A body streamed in without a Content-Length is counted as it comes: 413 all the same.
        chunks = (b"x" * 1024 for _ in range(80))
        big = httpx.post(url, content=chunks, headers={"Content-Type": "application/json"})
        assert big.status_code == 413, big.text
    finally:
        running.stop()

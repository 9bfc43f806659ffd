"""A real TextgenServer on a loopback port for tests, driven from a LoopThread."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
from server_tools import LoopThread, free_port

from serve.api.common import LoadedModel
from serve.api.config import ServerSettings
from serve.api.lifecycle import TextgenServer
from serve.api.metrics import Metrics
from serve.api.tracing import RequestTracer
from serve.scheduling.intake import SchedulerSnapshot
from serve.scheduling.messages import EngineWrap


def loopback_settings(bundle: Path, **overrides: Any) -> ServerSettings:
    """Settings for a test server: loopback only, any free ports; the HTTP API off unless `http_port` is
    given (0 turns it off: `free_port()` picks one)."""
    fields: dict[str, Any] = {
        "bundle": bundle,
        "host": "127.0.0.1",
        "port": 0,
        "http_host": "127.0.0.1",
        "http_port": 0,
        "metrics_host": "127.0.0.1",
        "metrics_port": 0,
        **overrides,
    }
    return ServerSettings(**fields)


class RunningServer:
    """A TextgenServer started on a LoopThread; `stop()` stops it at once."""

    def __init__(
        self,
        loop: LoopThread,
        settings: ServerSettings,
        engine_wrap: EngineWrap | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.loop = loop
        self.server = TextgenServer(settings, Metrics(), engine_wrap, tracer=tracer)
        loop.run(self.server.start())
        self.target = f"127.0.0.1:{self.server.port}"

    @property
    def http_base(self) -> str:
        """The HTTP API's base URL."""
        return f"http://127.0.0.1:{self.server.http_port}"

    def openai_client(self) -> openai.OpenAI:
        """The openai SDK's client of the HTTP API (no retries: a test sees each response)."""
        return openai.OpenAI(base_url=f"{self.http_base}/v1", api_key="unused", max_retries=0, timeout=30)

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the server's metrics (0 when it has none yet)."""
        return self.server.metrics.registry.get_sample_value(name, labels) or 0.0

    @property
    def model(self) -> LoadedModel:
        model = self.server.state.model
        assert model is not None, "the server has not loaded its model"
        return model

    def snapshot(self) -> SchedulerSnapshot:
        return self.model.scheduler.snapshot()

    def wait_for(
        self, condition: Callable[[SchedulerSnapshot], bool], timeout: float = 10.0
    ) -> SchedulerSnapshot:
        """The first scheduler snapshot that satisfies `condition`; fails after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            snapshot = self.snapshot()
            if condition(snapshot):
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no scheduler snapshot satisfied the condition in {timeout} s: {snapshot}"
                )
            time.sleep(0.005)

    def wait_idle(self, timeout: float = 10.0) -> SchedulerSnapshot:
        return self.wait_for(lambda s: s.running == 0 and s.waiting == 0, timeout)

    def stop(self) -> None:
        self.loop.run(self.server.stop())


def serve_with_template(
    loop: LoopThread,
    tiny_bundle: Path,
    where: Path,
    template: str,
    *,
    engine_process: bool,
    engine_wrap: EngineWrap | None = None,
    **overrides: Any,
) -> RunningServer:
    """A server of a copy of the tiny bundle whose chat template is `template` (`overrides`: settings)."""
    bundle = where / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    (bundle / "manifest.json").write_text(json.dumps({**manifest, "chat_template": template}))
    lengths = {"max_new_tokens": 64, "default_max_new_tokens": 48}  # short outputs, unless overridden
    settings = loopback_settings(
        bundle, http_port=free_port(), engine_process=engine_process, **{**lengths, **overrides}
    )
    return RunningServer(loop, settings, engine_wrap)

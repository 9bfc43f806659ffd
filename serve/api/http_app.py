"""The HTTP server of `textgen-serve --http-port`: the shared application (serve/api/http/) with each API's
routes, the OpenAI-compatible ones (serve/api/openai/) and Anthropic's Messages API (serve/api/anthropic/).
Neither API imports the other; this is where they meet."""

from __future__ import annotations

from serve.api.anthropic.routes import anthropic_routes
from serve.api.config import ServerSettings
from serve.api.http.app import HttpApi
from serve.api.http.server import HttpServer
from serve.api.metrics import Metrics
from serve.api.openai.routes import openai_routes
from serve.api.state import ServingState
from serve.api.tracing import RequestTracer


def http_api(
    state: ServingState,
    settings: ServerSettings,
    metrics: Metrics | None,
    tracer: RequestTracer | None = None,
) -> HttpServer:
    api = HttpApi(state, settings, metrics, tracer)
    return HttpServer(api.app(openai_routes(api), anthropic_routes(api)), settings)


__all__ = ["http_api"]

"""The naive baseline server: what a user writes first. Same bundle, same `textgen.v1` service, no batching.

One lock around a plain loop on an engine with one row: prefill the prompt, then decode one token at a time
until the request stops, streaming each token; every other request waits for the lock. The stopping rules,
text decoding and request validation are the real server's (`RequestTracker`, `serve.api.validation`), so the
two servers differ only in scheduling. A blocking gRPC server with a thread per call, as in grpc's examples.

    python -m bench.naive_server --bundle DIR --host 127.0.0.1 --port 50052
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent import futures

import grpc

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.config import ConfigError, ServerSettings, load_settings
from serve.api.grpc_requests import generation_request, prompt_ids
from serve.api.grpc_service import generate_response, stream_message
from serve.api.grpc_status import grpc_status
from serve.api.loading import request_limits, session_config
from serve.api.validation import check_request_id
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine, open_engine
from serve.engine.types import EngineSettings
from serve.errors import TextgenError
from serve.scheduling.request import Completion, Event, GenerationRequest, RequestTracker
from serve.scheduling.request_checks import validate_request

log = logging.getLogger("textgen.naive")


class NaiveService(pb_grpc.TextGenerationServicer):
    def __init__(self, bundle: Bundle, engine: Engine, settings: ServerSettings) -> None:
        self._bundle = bundle
        self._engine = engine
        self._lock = threading.Lock()
        # The real server's request limits for a batch-1 engine: a request may fill its slot.
        self._limits = request_limits(settings, engine.info, engine.capacity)

    def generate_events(self, request: GenerationRequest) -> Iterator[Event]:
        """Run one request to its end under the lock: the whole of this server's scheduling."""
        engine = self._engine
        arrival = time.monotonic()
        with self._lock:
            tracker = RequestTracker(request, engine.tokenizer, engine.eos_token_id, engine.capacity, arrival)
            tracker.admit(time.monotonic())
            sequence = tracker.new_sequence()
            try:
                out = engine.prefill([sequence])[0]
                while True:
                    event, finish = tracker.accept(
                        out.token_id, out.logprob, time.monotonic(), out.top, out.prompt
                    )
                    if event is not None:
                        yield event
                    if finish is not None:
                        yield finish
                        return
                    out = engine.decode()[0]
            finally:
                engine.release([request.request_id])  # also when the client went away mid-stream

    def _request(self, message: pb.GenerateRequest) -> GenerationRequest:
        request_id = check_request_id(message.request_id) or uuid.uuid4().hex
        encode = self._engine.tokenizer.encode
        prompt = prompt_ids(message, lambda text: encode(text).ids, self._limits.vocab_size)
        # No deadline: the naive server does not check them (the client's own timeout still ends the call).
        request = generation_request(
            message, request_id=request_id, prompt=prompt, limits=self._limits, deadline=None
        )
        validate_request(request, self._engine.vocab_size, self._engine.capacity)  # as Scheduler.track does
        return request

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateStreamResponse]:
        try:
            generation = self._request(request)
            for event in self.generate_events(generation):
                yield stream_message(generation.request_id, event)
        except TextgenError as exc:
            context.abort(*grpc_status(exc, request.request_id or None))

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        try:
            generation = self._request(request)
            completion = Completion(generation.request_id)
            for event in self.generate_events(generation):
                completion.add(event)
        except TextgenError as exc:
            context.abort(*grpc_status(exc, request.request_id or None))
        return generate_response(generation.request_id, completion)

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        manifest = self._bundle.manifest
        return pb.ModelInfo(
            model_name=manifest.model_name,
            vocab_size=self._engine.vocab_size,
            context_length=self._engine.context_length,
            max_new_tokens_limit=self._limits.largest_new_tokens,
            max_batch_size=1,
            dtype=manifest.dtype,
            quantization=manifest.quantization,
            execution_providers=self._engine.providers,
            eos_token_id=self._engine.eos_token_id,
            server_version="naive-baseline",
        )

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        encoding = self._engine.tokenizer.encode(request.text)
        return pb.TokenizeResponse(ids=encoding.ids, tokens=encoding.tokens)


def build(settings: ServerSettings) -> NaiveService:
    bundle = load_bundle(settings.bundle)
    session = session_config(settings)
    # Warmed up as the real server's, so the first client does not pay for the set-up.
    engine = open_engine(bundle, EngineSettings(max_batch_size=1, session=session))
    return NaiveService(bundle, engine, settings)


def start(settings: ServerSettings, max_workers: int) -> tuple[grpc.Server, int]:
    """A started server and its port. `max_workers` must exceed the clients: a waiting call holds a thread."""
    service = build(settings)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    pb_grpc.add_TextGenerationServicer_to_server(service, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise OSError(f"cannot listen on {settings.host}:{settings.port}")
    server.start()
    return server, port


def serve(settings: ServerSettings, max_workers: int) -> None:
    """Serve until interrupted."""
    server, port = start(settings, max_workers)
    log.info("naive baseline serving %s on %s:%d", settings.bundle, settings.host, port)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="naive_server",
        description=__doc__.splitlines()[0],
        epilog="Every other flag is textgen-serve's (--bundle, --host, --port, --threads, ...); batching and "
        "metrics flags are accepted and have no effect here.",
    )
    p.add_argument("--max-workers", type=int, default=128, help="gRPC handler threads (> clients)")
    args, serve_flags = p.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        serve(load_settings(serve_flags), args.max_workers)
    except (ConfigError, TextgenError, OSError) as exc:
        log.error("start-up failed: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

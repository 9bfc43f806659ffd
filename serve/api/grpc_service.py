"""The gRPC TextGeneration service: its RPCs, the interceptor that turns undecodable requests into
INVALID_ARGUMENT, and the converters from the scheduler's completions and events to protobuf replies.

The service serves the model a `ServingState` holds; the process's life (listening, loading, draining) is
`serve.api.lifecycle`'s. Every failure a client sees goes through `serve.api.grpc_status`; nothing else picks
status codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from tokenizers import Tokenizer

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.common import CallRecord, account
from serve.api.config import ServerSettings
from serve.api.grpc_requests import generation_request, prompt_ids, reject_unknown_fields
from serve.api.grpc_status import grpc_status
from serve.api.metrics import Metrics
from serve.api.state import ServingState
from serve.api.tracing import RequestTracer, take_trace_context
from serve.api.validation import check_request_id, token_ids
from serve.engine.sampling import Alternatives
from serve.errors import Draining, InvalidRequest, NotFound
from serve.scheduling.handles import RequestHandle
from serve.scheduling.request import Completion, Event, FinishEvent

log = logging.getLogger("textgen.server")

M = TypeVar("M", bound=Message)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name


def server_version() -> str:
    try:
        return importlib.metadata.version("textgen-serving")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def batch_invariant(bundle_invariant: bool, providers: tuple[str, ...]) -> bool:
    """What GetModelInfo claims: the bundle's batch invariance, which export verification measures with ONNX
    Runtime's CPU kernels. On a GPU (CUDA, TensorRT) the libraries may choose other kernels for one row than
    for many, which nothing here has measured: no claim there."""
    return bundle_invariant and bool(providers) and providers[0] == "CPUExecutionProvider"


FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "stop": pb.FINISH_REASON_STOP,
    "context": pb.FINISH_REASON_CONTEXT,
}


def finish_reason(reason: str) -> pb.FinishReason:
    return FINISH_REASONS.get(reason, pb.FINISH_REASON_UNSPECIFIED)


def top_logprobs(alternatives: list[Alternatives]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=a.token_ids, logprobs=a.logprobs) for a in alternatives]


def usage(finish: FinishEvent) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=finish.prompt_tokens,
        completion_tokens=finish.completion_tokens,
        cached_prompt_tokens=finish.cached_prompt_tokens,
    )


def generate_response(request_id: str, completion: Completion) -> pb.GenerateResponse:
    """A finished completion as `Generate`'s reply."""
    finish = completion.finish
    assert finish is not None  # every generation ends with a FinishEvent or an exception
    return pb.GenerateResponse(
        request_id=request_id,
        text=completion.text,
        token_ids=completion.token_ids,
        finish_reason=finish_reason(finish.finish_reason),
        usage=usage(finish),
        logprobs=completion.logprobs,
        top_logprobs=top_logprobs(completion.top_logprobs),
        prompt_logprobs=completion.prompt_logprobs,
        prompt_top_logprobs=top_logprobs(completion.prompt_top_logprobs),
        queue_seconds=finish.queue_seconds,
        time_to_first_token_seconds=finish.ttft_seconds,
        total_seconds=finish.total_seconds,
        constraint_incomplete=finish.constraint_incomplete,
    )


def stream_message(request_id: str, event: Event) -> pb.GenerateStreamResponse:
    """One `GenerateStream` message: tokens and their text, or the last one with finish reason and usage."""
    if isinstance(event, FinishEvent):
        return pb.GenerateStreamResponse(
            request_id=request_id,
            finish_reason=finish_reason(event.finish_reason),
            usage=usage(event),
            constraint_incomplete=event.constraint_incomplete,
        )
    return pb.GenerateStreamResponse(
        request_id=request_id,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=event.logprobs,
        top_logprobs=top_logprobs(event.top_logprobs),
        prompt_logprobs=event.prompt_logprobs,
        prompt_top_logprobs=top_logprobs(event.prompt_top_logprobs),
    )


# --- requests that are not valid protobuf ------------------------------------------------------------------


@dataclass(frozen=True)
class Undecodable:
    """Stands in for request bytes that are not a valid message (e.g. bad UTF-8 in a string field)."""

    message: str


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            return Undecodable(f"the request is not a valid protobuf message: {exc}")

    return parse


class DecodeGuardInterceptor(grpc.aio.ServerInterceptor):
    """gRPC answers an undecodable request with UNKNOWN before any handler runs; this hands the handler an
    `Undecodable` instead, so the service refuses it with INVALID_ARGUMENT and logs and counts it."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                handler.unary_stream,
                request_deserializer=_lenient(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            handler.unary_unary,
            request_deserializer=_lenient(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


def checked(request: M | Undecodable) -> M:
    """The request message, or InvalidRequest for bytes that do not decode or fields this server lacks."""
    if isinstance(request, Undecodable):
        raise InvalidRequest(request.message)
    reject_unknown_fields(request)
    return request


# --- the service -------------------------------------------------------------------------------------------


class TextGenerationService(pb_grpc.TextGenerationServicer):
    """The TextGeneration RPCs, on the model `state` holds (the lifecycle loads it and drains)."""

    def __init__(
        self,
        state: ServingState,
        settings: ServerSettings,
        metrics: Metrics | None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self._state = state
        self._settings = settings
        self._metrics = metrics
        self._tracer = tracer

    @contextlib.asynccontextmanager
    async def _call(self, rpc: str, context: grpc.aio.ServicerContext) -> AsyncIterator[CallRecord]:
        """Maps whatever ends the RPC to its one status, log line and metric.

        The record is written before the status goes out, so whoever sees the status can find its log line.
        """
        if self._tracer is not None:
            take_trace_context(context.invocation_metadata() or ())
        record = CallRecord(rpc=rpc)
        try:
            yield record
        except asyncio.CancelledError:
            record.code, record.error = self._cancelled(context)
            self._account(record)
            raise
        except GeneratorExit:  # a stream whose client vanished mid-write: gRPC closes it without cancelling
            record.code = "CANCELLED"
            self._account(record)
            raise
        except Exception as exc:
            code, record.error = grpc_status(exc, record.request_id or None)
            record.code = code.name
            if code is grpc.StatusCode.INTERNAL:
                log.exception("request %s failed", record.request_id)
            self._account(record)
            await context.abort(code, record.error)
        else:
            self._account(record)

    def _cancelled(self, context: grpc.aio.ServicerContext) -> tuple[str, str]:
        """The code (and error) of a cancelled call, as its client saw it: its deadline passed, the server
        stopped (gRPC cancels the calls still running at the end of its stop's grace, and their clients get
        UNAVAILABLE "Cancelling all calls", to retry elsewhere; a client that cancels during that grace is
        counted so too), or the client cancelled it."""
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED", ""
        if self._state.stopping:
            return "UNAVAILABLE", "the server stopped before the call ended"
        return "CANCELLED", ""

    def _account(self, record: CallRecord) -> None:
        account(record, self._settings.log_prompts, self._metrics, self._tracer)

    async def _submit(
        self,
        raw: pb.GenerateRequest | Undecodable,
        context: grpc.aio.ServicerContext,
        record: CallRecord,
        stream: bool,
    ) -> RequestHandle:
        model = self._state.ready_model()
        request: pb.GenerateRequest = checked(raw)
        record.request_id = check_request_id(request.request_id) or uuid.uuid4().hex
        which = request.WhichOneof("input")
        record.prompt = request.text if which == "text" else None
        encode = model.tokenizer.encode
        args = (request, lambda text: encode(text).ids, model.limits.vocab_size, model.chat_prompt)
        # Text and chats are tokenized off the event loop (a long prompt takes milliseconds); token ids are
        # only checked.
        on_loop = which not in ("text", "messages")
        prompt = prompt_ids(*args) if on_loop else await asyncio.to_thread(prompt_ids, *args)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if request.adapter and request.adapter not in model.info.adapters:
            loaded = ", ".join(model.info.adapters) or "none"
            raise NotFound(f"adapter {request.adapter!r} is not loaded on this server (adapters: {loaded})")
        generation = generation_request(
            request,
            request_id=record.request_id,
            prompt=prompt,
            limits=model.limits,
            deadline=deadline,
            stream=stream,
        )
        if self._state.draining:  # the drain may have begun while the prompt was being tokenized
            raise Draining("the server is shutting down: retry on another replica")
        if self._metrics is not None and generation.constraint is not None:
            self._metrics.on_constrained(generation.constraint.kind.value)
        return model.scheduler.submit(generation)

    async def Generate(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        async with self._call("Generate", context) as record:
            handle = await self._submit(request, context, record, stream=False)
            completion = Completion(record.request_id)
            try:
                async for event in handle:
                    completion.add(event)
            finally:
                handle.cancel()  # frees the slot of a call that ends early; no effect once finished
            record.finish, record.text = completion.finish, completion.text
            return generate_response(record.request_id, completion)

    async def GenerateStream(
        self, request: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        """Tokens as they come, then a last message with the finish reason and usage (and no tokens).

        A stream that keeps up gets one message per engine step; one that falls behind (slow client, busy
        event loop) gets everything produced meanwhile in its next message, so the per-message cost is paid
        once per write instead of once per token.
        """
        async with self._call("GenerateStream", context) as record:
            handle = await self._submit(request, context, record, stream=True)
            texts: list[str] = []
            try:
                async for event in handle.coalesced():
                    if isinstance(event, FinishEvent):
                        record.finish = event
                    else:
                        texts.append(event.text)
                    yield stream_message(record.request_id, event)
            finally:
                handle.cancel()  # frees the slot when the client goes away; no effect once finished
            record.text = "".join(texts)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        async with self._call("GetModelInfo", context):
            model = self._state.ready_model()
            checked(request)
            manifest = model.bundle.manifest
            return pb.ModelInfo(
                model_name=model.name,
                vocab_size=model.info.vocab_size,
                context_length=model.info.context_length,
                max_new_tokens_limit=model.limits.largest_new_tokens,
                max_batch_size=model.info.max_batch_size,
                dtype=manifest.dtype,
                quantization=manifest.quantization,
                execution_providers=list(model.info.providers),
                eos_token_id=model.info.eos_token_id,
                server_version=server_version(),
                prefix_cache_rows=model.info.prefix_cache_rows,
                kv_cache_bytes=model.info.kv_bytes,
                eos_token_ids=list(model.info.eos_token_ids or (model.info.eos_token_id,)),
                max_model_len=model.limits.context_length,
                batch_invariant=batch_invariant(manifest.batch_invariant, model.info.providers),
                speculative=model.info.speculation.method,
                num_speculative_tokens=model.info.speculation.num_tokens,
                adapters=list(model.info.adapters),
                lora_slots=model.info.lora_slots,
            )

    async def Tokenize(
        self, request: pb.TokenizeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        async with self._call("Tokenize", context):
            model = self._state.ready_model()
            tokenize: pb.TokenizeRequest = checked(request)
            special = not tokenize.HasField("add_special_tokens") or tokenize.add_special_tokens
            encoding = await asyncio.to_thread(
                model.tokenizer.encode, tokenize.text, add_special_tokens=special
            )
            return pb.TokenizeResponse(ids=encoding.ids, tokens=encoding.tokens)

    async def Detokenize(
        self, request: pb.DetokenizeRequest | Undecodable, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        async with self._call("Detokenize", context):
            model = self._state.ready_model()
            detokenize: pb.DetokenizeRequest = checked(request)
            ids = token_ids(detokenize.ids, model.info.vocab_size, "ids")
            return await asyncio.to_thread(_detokenized, model.tokenizer, ids)


def _detokenized(tokenizer: Tokenizer, ids: list[int]) -> pb.DetokenizeResponse:
    return pb.DetokenizeResponse(
        text=tokenizer.decode(ids),
        texts=tokenizer.decode_batch([[token] for token in ids]),
        # "" for ids the model has but the tokenizer does not (a vocabulary padded for speed).
        tokens=[tokenizer.id_to_token(token) or "" for token in ids],
    )

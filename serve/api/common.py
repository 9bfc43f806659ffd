"""What both front ends share: the loaded model (bundle, engine info, scheduler, limits, chat template) and
the one log line and request metric each call gets."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from serve.api.chat import ChatTemplate, special_tokens
from serve.api.metrics import Metrics
from serve.api.tracing import RequestTracer, trace_context
from serve.api.validation import RequestLimits
from serve.bundle import MANIFEST_FILE, Bundle
from serve.engine.types import EngineInfo
from serve.errors import InvalidRequest
from serve.scheduling.request import FinishEvent
from serve.scheduling.scheduler import RequestScheduler

request_log = logging.getLogger("textgen.requests")


def chat_template(bundle: Bundle) -> ChatTemplate | None:
    """The bundle's chat template, compiled (BundleError for one that is not valid Jinja)."""
    manifest = bundle.manifest
    if manifest.chat_template is None:
        return None
    ids = {"eos_token": manifest.eos_token_id, "pad_token": manifest.pad_token_id}
    if manifest.bos_token_id is not None:  # Llama's templates begin with {{ bos_token }}
        ids["bos_token"] = manifest.bos_token_id
    where = f"{bundle.root / MANIFEST_FILE}: chat_template"
    return ChatTemplate(manifest.chat_template, special_tokens(bundle.tokenizer, ids), where=where)


@dataclass
class LoadedModel:
    bundle: Bundle
    scheduler: RequestScheduler
    limits: RequestLimits
    chat: ChatTemplate | None = None  # the bundle's chat template (made from it when not given)
    served_names: tuple[str, ...] = ()  # --served-model-name's; none: the bundle's model name

    def __post_init__(self) -> None:
        if self.chat is None:
            self.chat = chat_template(self.bundle)

    @property
    def info(self) -> EngineInfo:
        """The engine's description, from the scheduler: its adapters change as they are loaded and
        unloaded while the server runs, and every reader sees the same ones."""
        return self.scheduler.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.bundle.tokenizer

    @property
    def names(self) -> tuple[str, ...]:
        """The names a request's `model` may give for the base model (vLLM's --served-model-name)."""
        return self.served_names or (self.bundle.manifest.model_name,)

    @property
    def name(self) -> str:
        """The name the server reports the model by: the first of `names`."""
        return self.names[0]

    @property
    def chat_reads_parts(self) -> bool:
        """Whether the chat template takes a message's content parts as given (ChatTemplate.reads_parts),
        not joined into one string."""
        return self.chat is not None and self.chat.reads_parts

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """A chat's prompt ids (rendered, then tokenized without special tokens); InvalidRequest when the
        bundle has no chat template or the template refuses the messages. Takes milliseconds: call it off
        the event loop."""
        if self.chat is None:
            raise InvalidRequest(
                f"model {self.name} has no chat template (its bundle's manifest sets no chat_template): "
                "send a completion with a prompt instead"
            )
        return self.chat.prompt_ids(self.tokenizer, messages, tools, documents, variables)


@dataclass
class CallRecord:
    """What the one log line and the request metric of a call (an RPC, an HTTP request) say. `code` is a
    gRPC status name for both front ends (serve/api/http_status.py); `status` the HTTP status."""

    rpc: str
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    code: str = "OK"
    status: int | None = None
    error: str = ""
    finish: FinishEvent | None = None
    prompt: str | None = None
    text: str | None = None
    trace: dict[str, str] | None = field(default_factory=trace_context)  # the caller's W3C trace headers

    def fields(self, log_prompts: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"rpc": self.rpc, "request_id": self.request_id, "code": self.code}
        if self.status is not None:
            out["status"] = self.status
        if self.error:
            out["error"] = self.error
        if self.finish is not None:
            out.update(
                finish_reason=self.finish.finish_reason,
                prompt_tokens=self.finish.prompt_tokens,
                cached_prompt_tokens=self.finish.cached_prompt_tokens,
                completion_tokens=self.finish.completion_tokens,
                queue_s=round(self.finish.queue_seconds, 6),
                ttft_s=round(self.finish.ttft_seconds, 6),
            )
        out["total_s"] = round(time.perf_counter() - self.started, 6)
        if log_prompts:
            out.update(prompt=self.prompt, text=self.text)
        return out


def account(
    record: CallRecord, log_prompts: bool, metrics: Metrics | None, tracer: RequestTracer | None = None
) -> None:
    """The call's log line, request metric and span, written once, before the client sees how it ended."""
    request_log.info(json.dumps(record.fields(log_prompts), ensure_ascii=False))
    if tracer is not None:
        tracer.record(record)
    if metrics is not None:
        metrics.on_request_done(record.rpc, record.code, time.perf_counter() - record.started)

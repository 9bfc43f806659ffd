"""/v1/chat/completions' answers: `chat.completion` objects, or `chat.completion.chunk`s as the tokens come.
A choice's text is read as its request's tools say (serve/api/tool_calls.py `Reply`): plain content, or tool
calls; a stream's first chunk of each choice opens its message with the role."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve.api.http.serving import ChunkRenderer, finish_reason
from serve.api.http.translate import ChatPlan
from serve.api.http.vocabulary import Vocabulary
from serve.api.openai.logprobs import chat_logprobs
from serve.api.tool_calls import Reply
from serve.engine.sampling import Alternatives
from serve.scheduling.request import Completion, FinishEvent, TokenEvent


class ChatRenderer(ChunkRenderer[ChatPlan]):
    prefix = "chatcmpl-"

    def __init__(self, plan: ChatPlan, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self._replies = [Reply(plan.tools) for _ in plan.requests]  # a stream's choices, read as they come

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def choices(self, done: Sequence[Completion]) -> list[dict[str, Any]]:
        return [self._choice(index, completion) for index, completion in enumerate(done)]

    def on_tokens(self, index: int, event: TokenEvent) -> list[dict[str, Any]]:
        delta = self._replies[index].feed(event.text)
        logprobs = self._logprobs(event.token_ids, event.logprobs, event.top_logprobs)
        return [self._delta(index, delta, logprobs, None)] if delta or logprobs is not None else []

    def on_finish(self, index: int, event: FinishEvent) -> list[dict[str, Any]]:
        last, reason = self._replies[index].finish(finish_reason(event.finish_reason))
        choices = [self._delta(index, last, None, None)] if last else []
        choices.append(self._delta(index, {}, None, reason))
        return choices

    def _choice(self, index: int, completion: Completion) -> dict[str, Any]:
        assert completion.finish is not None
        logprobs = self._logprobs(completion.token_ids, completion.logprobs, completion.top_logprobs)
        reply = Reply(self.plan.tools)
        reply.feed(completion.text)
        _, reason = reply.finish(finish_reason(completion.finish.finish_reason))
        return {"index": index, "message": reply.message(), "logprobs": logprobs, "finish_reason": reason}

    def _delta(
        self, index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, reason: str | None
    ) -> dict[str, Any]:
        if self._first(index):
            opening: dict[str, Any] = {"role": "assistant"}
            if self.plan.tools.mode != "none":
                opening["content"] = None
            delta = {**opening, **delta}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def _logprobs(
        self, token_ids: list[int], logprobs: list[float], tops: list[Alternatives]
    ) -> dict[str, Any] | None:
        if not self.plan.logprobs:
            return None
        return {"content": chat_logprobs(self.vocab, token_ids, logprobs, tops)}

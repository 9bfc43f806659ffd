"""/v1/completions' answers: `text_completion` objects, whole or streamed. With echo a choice's text begins
with its prompt, and its logprobs (the legacy object) score the prompt's tokens before the generated ones."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve.api.http.serving import ChunkRenderer, finish_reason
from serve.api.http.translate import Prompt
from serve.api.http.vocabulary import Vocabulary
from serve.api.openai.logprobs import completion_logprobs
from serve.api.openai.protocol import CompletionLogprobs
from serve.api.openai.translate_completions import CompletionPlan
from serve.scheduling.request import Completion, FinishEvent, TokenEvent


class CompletionRenderer(ChunkRenderer[CompletionPlan]):
    prefix = "cmpl-"

    def __init__(self, plan: CompletionPlan, model: str, request_id: str, vocab: Vocabulary) -> None:
        super().__init__(plan, model, request_id, vocab)
        self._offsets = [0] * len(plan.requests)  # where each choice's next token starts in its text

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choices(self, done: Sequence[Completion]) -> list[dict[str, Any]]:
        plan = self.plan
        return [
            _completion_choice(i, plan.prompts[i // plan.n], c, plan.echo, plan.logprobs, self.vocab)
            for i, c in enumerate(done)
        ]

    def on_tokens(self, index: int, event: TokenEvent) -> list[dict[str, Any]]:
        plan = self.plan
        prompt = plan.prompts[index // plan.n]
        first = self._first(index)
        echoed = plan.echo and first  # the prompt goes before the choice's first tokens
        text = prompt.text + event.text if echoed else event.text
        logprobs = None
        if plan.logprobs is not None:
            logprobs, self._offsets[index] = _event_completion_logprobs(
                self.vocab, event, prompt if echoed else None, self._offsets[index]
            )
        return [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}]

    def on_finish(self, index: int, event: FinishEvent) -> list[dict[str, Any]]:
        reason = finish_reason(event.finish_reason)
        return [{"index": index, "text": "", "logprobs": None, "finish_reason": reason}]


def _prompt_scores(
    prompt: Prompt, logprobs: list[float], tops: list[Any]
) -> tuple[list[float | None], list[Any]]:
    """The prompt's logprobs as echo shows them: the first token has none."""
    top_list: list[Any] = [None, *tops] if tops else [None] * len(prompt.ids)
    return [None, *logprobs], top_list


def _event_completion_logprobs(
    vocab: Vocabulary, event: TokenEvent, prompt: Prompt | None, offset: int
) -> tuple[CompletionLogprobs, int]:
    ids: list[int] = []
    lps: list[float | None] = []
    tops: list[Any] = []
    if prompt is not None:
        plp, ptop = _prompt_scores(prompt, event.prompt_logprobs, event.prompt_top_logprobs)
        ids, lps, tops = list(prompt.ids), plp, ptop
    ids += event.token_ids
    lps += event.logprobs
    tops += event.top_logprobs or [None] * len(event.token_ids)
    return completion_logprobs(vocab, ids, lps, tops, offset)


def _completion_choice(
    index: int, prompt: Prompt, completion: Completion, echo: bool, k: int | None, vocab: Vocabulary
) -> dict[str, Any]:
    assert completion.finish is not None
    text = (prompt.text if echo else "") + completion.text
    logprobs = None
    if k is not None:
        event = TokenEvent(
            completion.token_ids,
            completion.text,
            completion.logprobs,
            completion.top_logprobs,
            completion.prompt_logprobs,
            completion.prompt_top_logprobs,
        )
        logprobs, _ = _event_completion_logprobs(vocab, event, prompt if echo else None, 0)
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(completion.finish.finish_reason),
    }

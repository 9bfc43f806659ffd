"""The generation routes' renderers without a server (serve/api/openai/completions.py, chat.py): the same
events rendered as one body and as a stream say the same thing, choice by choice."""

from __future__ import annotations

from typing import Any

import pytest

from export.tokenizer import train_tokenizer
from serve.api.openai.chat import ChatRenderer
from serve.api.openai.completions import CompletionRenderer
from serve.api.openai.logprobs import Vocabulary
from serve.api.openai.serving import Renderer
from serve.api.openai.translate import ChatPlan, CompletionPlan, Prompt
from serve.api.tool_calls import NamedToolChoice, Tool, tool_plan
from serve.engine.sampling import Alternatives, SamplingParams
from serve.scheduling.request import Completion, Event, FinishEvent, GenerationRequest, TokenEvent

TOKENIZER = train_tokenizer(["the quick brown fox jumps over the lazy dog " * 3], vocab_size=300)
VOCAB = Vocabulary(TOKENIZER)
PROMPT = Prompt(TOKENIZER.encode("the quick").ids, "the quick")
WEATHER = Tool.model_validate({"type": "function", "function": {"name": "weather"}})


def tokens(text: str, first: bool = False, scored: bool = True) -> TokenEvent:
    """An event of `text`'s tokens, with logprobs and 2 alternatives each (the first event: the prompt's)."""
    ids = TOKENIZER.encode(text).ids
    tops = [Alternatives([i, i + 1], [-0.5, -1.5]) for i in ids] if scored else []
    prompt_lps = [-2.0 - p for p in range(len(PROMPT.ids) - 1)] if first and scored else []
    prompt_tops = [Alternatives([3, 4], [-1.0, -2.0]) for _ in prompt_lps]
    lps = [-0.25 * (i + 1) for i in range(len(ids))] if scored else []
    return TokenEvent(ids, text, lps, tops, prompt_lps, prompt_tops)


def finish(reason: str, generated: int) -> FinishEvent:
    return FinishEvent(reason, len(PROMPT.ids), generated, 0, 0.0, 0.0, 0.0)


def interleaved(scored: bool = True) -> list[tuple[int, Event]]:
    """Two choices' events, in the order a stream might get them."""
    return [
        (0, tokens(" brown", first=True, scored=scored)),
        (1, tokens(" lazy", first=True, scored=scored)),
        (0, tokens(" fox", scored=scored)),
        (1, finish("eos", 1)),
        (0, tokens(" jumps", scored=scored)),
        (0, finish("length", 3)),
    ]


def requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"rid-{i}", PROMPT.ids, SamplingParams(), 3) for i in range(n)]


def rendered(renderer: Renderer[Any], events: list[tuple[int, Event]]) -> tuple[dict[str, Any], list[Any]]:
    """The whole body and the stream's chunks, each from a renderer of its own."""
    done = [Completion(f"rid-{i}") for i in range(len(renderer.plan.requests))]
    for index, event in events:
        done[index].add(event)
    stream = type(renderer)(renderer.plan, renderer.model, "rid", VOCAB)
    chunks = [chunk for index, event in events for chunk in stream.chunks(index, event)]
    finishes = [c.finish for c in done]
    return renderer.body(done), [*chunks, stream.usage_chunk(finishes)]


def completion_plan(echo: bool, logprobs: int | None) -> CompletionPlan:
    return CompletionPlan([PROMPT], requests(2), 2, True, True, None, echo, logprobs)


@pytest.mark.parametrize(("echo", "logprobs"), [(False, None), (True, None), (False, 2), (True, 2)])
def test_a_streamed_completion_adds_up_to_the_whole_body(echo: bool, logprobs: int | None) -> None:
    plan = completion_plan(echo, logprobs)
    body, chunks = rendered(CompletionRenderer(plan, "m", "rid", VOCAB), interleaved())
    assert body["id"] == "cmpl-rid" and body["object"] == "text_completion" and body["model"] == "m"
    assert all(c["id"] == "cmpl-rid" and c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == len(PROMPT.ids)
    for whole in body["choices"]:
        parts = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == whole["index"]]
        assert "".join(p["text"] for p in parts) == whole["text"]
        assert whole["text"].startswith(PROMPT.text) == echo
        assert [p["finish_reason"] for p in parts if p["finish_reason"]] == [whole["finish_reason"]]
        if logprobs is None:
            assert whole["logprobs"] is None and all(p["logprobs"] is None for p in parts)
            continue
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            streamed = [x for p in parts if p["logprobs"] is not None for x in p["logprobs"][field]]
            assert streamed == whole["logprobs"][field], field
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]


@pytest.mark.parametrize("want_logprobs", [False, True])
def test_a_streamed_chat_adds_up_to_the_whole_body(want_logprobs: bool) -> None:
    plan = ChatPlan([PROMPT], requests(2), 2, True, True, None, tool_plan(None, None, None), want_logprobs)
    body, chunks = rendered(ChatRenderer(plan, "m", "rid", VOCAB), interleaved(scored=want_logprobs))
    assert body["id"] == "chatcmpl-rid" and body["object"] == "chat.completion"
    assert all(c["id"] == "chatcmpl-rid" and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]
    for whole in body["choices"]:
        parts = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == whole["index"]]
        assert [p["delta"].get("role") for p in parts] == ["assistant"] + [None] * (len(parts) - 1)
        assert "".join(p["delta"].get("content", "") for p in parts) == whole["message"]["content"]
        assert parts[-1]["finish_reason"] == whole["finish_reason"]
        streamed = [x for p in parts if p["logprobs"] is not None for x in p["logprobs"]["content"]]
        assert streamed == (whole["logprobs"]["content"] if want_logprobs else [])


def test_a_streamed_tool_call_adds_up_to_the_whole_body() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}})
    plan = ChatPlan([PROMPT], requests(1), 1, True, False, "tool", tool_plan([WEATHER], named, None), False)
    arguments = [(0, tokens('{"city": ', scored=False)), (0, tokens('"Oslo"}', scored=False))]
    body, chunks = rendered(ChatRenderer(plan, "m", "rid", VOCAB), [*arguments, (0, finish("stop", 5))])
    (whole,) = body["choices"]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    parts = [c["choices"][0] for c in chunks[:-1]]
    assert parts[0]["delta"]["role"] == "assistant" and parts[0]["delta"]["content"] is None
    streamed = [d for p in parts for d in p["delta"].get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "weather"
    assert "".join(d["function"]["arguments"] for d in streamed) == call["function"]["arguments"]
    assert parts[-1]["finish_reason"] == whole["finish_reason"] == "tool_calls"

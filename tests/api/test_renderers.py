"""The generation routes' renderers without a server (serve/api/openai/completions.py, chat.py,
responses.py, messages.py): the same events rendered as one body and as a stream say the same thing, choice
by choice, item by item, block by block."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import pytest

from export.tokenizer import train_tokenizer
from serve.api.anthropic.messages import MessagesRenderer
from serve.api.anthropic.translate import MessagesPlan
from serve.api.http.serving import ChunkRenderer
from serve.api.http.translate import ChatPlan, Prompt
from serve.api.http.vocabulary import Vocabulary
from serve.api.http_status import anthropic_error, http_error
from serve.api.openai.chat import ChatRenderer
from serve.api.openai.completions import CompletionRenderer
from serve.api.openai.protocol import ResponsesRequest
from serve.api.openai.responses import ResponsesRenderer
from serve.api.openai.translate_completions import CompletionPlan
from serve.api.openai.translate_responses import ResponsesPlan
from serve.api.tool_calls import NamedToolChoice, Tool, ToolPlan, tool_plan
from serve.engine.sampling import Alternatives, SamplingParams
from serve.errors import DeadlineExceeded, EngineFailure
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


def rendered(
    renderer: ChunkRenderer[Any], events: list[tuple[int, Event]]
) -> tuple[dict[str, Any], list[Any]]:
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


# --- /v1/responses ------------------------------------------------------------------------------------------

NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}})


def responses_plan(
    tools: ToolPlan, max_output_tokens: int | None = None, context: int = 128, logprobs: bool = False
) -> ResponsesPlan:
    request = ResponsesRequest(input="x", max_output_tokens=max_output_tokens)
    return ResponsesPlan([PROMPT], requests(1), 1, True, False, None, tools, logprobs, request, context)


def sse_events(messages: list[str]) -> list[dict[str, Any]]:
    """The events of a Responses stream's messages (`event: <type>` and `data: <JSON>` each)."""
    events = []
    for message in messages:
        kind, data = message.removesuffix("\n\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def streamed_response(
    plan: ResponsesPlan, events: list[Event]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole body and the stream's events, each from a renderer of its own."""
    done = Completion("rid")
    for event in events:
        done.add(event)
    stream = ResponsesRenderer(plan, "m", "rid", VOCAB)
    messages = [*stream.opening(), *(m for event in events for m in stream.events(0, event))]
    messages += stream.closing([done.finish])
    return dict(ResponsesRenderer(plan, "m", "rid", VOCAB).body([done])), sse_events(messages)


def without_call_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items without the ids each renderer draws for its calls."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def assert_adds_up(body: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """The stream's events say what the body says: its items, their text and arguments, the final state."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and events[0]["response"]["output"] == []
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert kinds[-1] == f"response.{body['status']}"
    assert without_call_ids(final["output"]) == without_call_ids(body["output"])
    drawn = ("id", "output", "created_at")  # the renderers' own: their ids, the second each was made in
    assert {k: v for k, v in final.items() if k not in drawn} == {
        k: v for k, v in body.items() if k not in drawn
    }
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(body["output"])))
    for place, item in enumerate(final["output"]):
        mine = [e for e in events if e.get("item_id") == item["id"]]
        assert all(e["output_index"] == place for e in mine)
        if item["type"] == "message":
            text = "".join(e["delta"] for e in mine if e["type"] == "response.output_text.delta")
            assert text == item["content"][0]["text"]
        else:
            arguments = "".join(
                e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta"
            )
            assert arguments == item["arguments"] == mine[-1]["arguments"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    assert_one_item_at_a_time(events)


def assert_one_item_at_a_time(events: list[dict[str, Any]]) -> None:
    """As OpenAI streams them: an item's events all come between its output_item.added and .done, and the
    next item is added after that."""
    places = [e["output_index"] for e in events if "output_index" in e]
    assert places == sorted(places)
    for kind in ("response.output_item.added", "response.output_item.done"):
        assert [e["output_index"] for e in events if e["type"] == kind] == sorted(set(places))


@pytest.mark.parametrize(("reason", "status"), [("eos", "completed"), ("length", "incomplete")])
def test_a_streamed_response_adds_up_to_the_whole_body(reason: str, status: str) -> None:
    plan = responses_plan(tool_plan(None, None, None))
    events: list[Event] = [tokens(" brown", scored=False), tokens(" fox", scored=False), finish(reason, 2)]
    body, streamed = streamed_response(plan, events)
    assert body["object"] == "response" and body["status"] == status
    (message,) = body["output"]
    assert message["status"] == status and message["content"][0]["text"] == " brown fox"
    assert body["usage"]["output_tokens"] == 2 and body["usage"]["input_tokens"] == len(PROMPT.ids)
    assert body["incomplete_details"] == ({"reason": "max_output_tokens"} if status == "incomplete" else None)
    assert_adds_up(body, streamed)


def test_a_streamed_function_call_adds_up_to_the_whole_body() -> None:
    plan = responses_plan(tool_plan([WEATHER], NAMED, None))
    arguments = [tokens('{"city": ', scored=False), tokens('"Oslo"}', scored=False)]
    body, streamed = streamed_response(plan, [*arguments, finish("stop", 5)])
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "weather" and call["status"] == "completed"
    assert call["arguments"] == '{"city": "Oslo"}' and call["id"] == f"fc_{call['call_id']}"
    deltas = [e for e in streamed if e["type"] == "response.function_call_arguments.delta"]
    assert [e["delta"] for e in deltas] == ['{"city": ', '"Oslo"}']  # as they came, not at the end
    assert_adds_up(body, streamed)


def test_calls_read_at_the_end_follow_the_content() -> None:
    plan = responses_plan(tool_plan([WEATHER], None, None))  # auto: Hermes blocks, read when the output ends
    text = ["Sure. ", '<tool_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    body, streamed = streamed_response(plan, [*(tokens(t, scored=False) for t in text), finish("eos", 9)])
    message, call = body["output"]
    assert message["content"][0]["text"] == "Sure. " and call["arguments"] == '{"city": "Oslo"}'
    assert_adds_up(body, streamed)


def test_the_message_is_done_before_a_call_is_added() -> None:
    plan = responses_plan(tool_plan([WEATHER], None, None))  # auto: the content, then the calls at the end
    text = ["Sure. ", '<tool_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    _, streamed = streamed_response(plan, [*(tokens(t, scored=False) for t in text), finish("eos", 9)])
    kinds = [(e["type"], e.get("output_index")) for e in streamed if e["type"].startswith("response.output_")]
    message_done = kinds.index(("response.output_item.done", 0))
    assert message_done < kinds.index(("response.output_item.added", 1))
    assert [item["status"] for item in streamed[-1]["response"]["output"]] == ["completed", "completed"]


def test_each_response_has_an_id_of_its_own() -> None:
    plan = responses_plan(tool_plan(None, None, None))
    renderers = [ResponsesRenderer(plan, "m", "same-request-id", VOCAB) for _ in range(2)]
    ids = [renderer.id for renderer in renderers]
    assert ids[0] != ids[1] and all(re.fullmatch("resp_[0-9a-f]{32}", i) for i in ids)
    messages = [
        sse_events([*r.events(0, tokens(" brown", scored=False))])[0]["item"]["id"] for r in renderers
    ]
    assert messages[0] != messages[1] and "same-request-id" not in messages[0]


def test_the_output_texts_logprobs_add_up_to_the_whole_bodys() -> None:
    plan = responses_plan(tool_plan(None, None, None), logprobs=True)
    events: list[Event] = [tokens(" brown"), tokens(" fox"), finish("eos", 2)]
    body, streamed = streamed_response(plan, events)
    (message,) = body["output"]
    logprobs = message["content"][0]["logprobs"]
    ids = TOKENIZER.encode(" brown").ids + TOKENIZER.encode(" fox").ids
    assert [entry["token"] for entry in logprobs] == [VOCAB.text(i) for i in ids]
    assert all(len(entry["top_logprobs"]) == 2 for entry in logprobs)
    deltas = [e for e in streamed if e["type"] == "response.output_text.delta"]
    assert [entry for e in deltas for entry in e["logprobs"]] == logprobs
    (text_done,) = [e for e in streamed if e["type"] == "response.output_text.done"]
    assert text_done["logprobs"] == logprobs
    assert_adds_up(body, streamed)


def test_an_output_of_nothing_is_an_empty_message() -> None:
    body, streamed = streamed_response(responses_plan(tool_plan(None, None, None)), [finish("eos", 0)])
    assert [(item["type"], item["content"][0]["text"]) for item in body["output"]] == [("message", "")]
    assert_adds_up(body, streamed)


@pytest.mark.parametrize(
    ("max_output_tokens", "context", "reason"),
    [
        (None, len(PROMPT.ids) + 3, "context_length"),  # no limit given: the output filled the context
        (3, len(PROMPT.ids) + 3, "max_output_tokens"),  # both at once: the limit the client set
        (3, 128, "max_output_tokens"),
    ],
)
def test_a_full_context_is_its_own_incomplete_reason(
    max_output_tokens: int | None, context: int, reason: str
) -> None:
    plan = responses_plan(tool_plan(None, None, None), max_output_tokens, context)
    body, _ = streamed_response(plan, [tokens(" brown fox", scored=False), finish("length", 3)])
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": reason}


def test_a_failed_stream_ends_with_response_failed() -> None:
    renderer = ResponsesRenderer(responses_plan(tool_plan(None, None, None)), "m", "rid", VOCAB)
    messages = [*renderer.opening(), *renderer.events(0, tokens(" brown", scored=False))]
    error = http_error(EngineFailure("the engine failed"), "rid")
    *_, failed = sse_events(messages + renderer.failure(error))
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": "server_error", "message": error.message}
    assert failed["error"] == error.body()["error"]  # what the openai SDK raises
    (message,) = failed["response"]["output"]
    assert message["status"] == "incomplete" and message["content"][0]["text"] == " brown"


# --- /v1/messages -------------------------------------------------------------------------------------------


def messages_plan(tools: ToolPlan, max_tokens: int = 3, context: int = 128) -> MessagesPlan:
    return MessagesPlan([PROMPT], requests(1), 1, True, False, None, tools, False, max_tokens, context)


def streamed_message(plan: MessagesPlan, events: list[Event]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The whole body and the stream's events, each from a renderer of its own."""
    done = Completion("rid")
    for event in events:
        done.add(event)
    stream = MessagesRenderer(plan, "m", "rid", VOCAB)
    messages = [*stream.opening(), *(m for event in events for m in stream.events(0, event))]
    messages += stream.closing([done.finish])
    return dict(MessagesRenderer(plan, "m", "rid", VOCAB).body([done])), sse_events(messages)


def assembled(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a stream's events build, as Anthropic's SDK builds it; checks their order on the way."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    message = dict(events[0]["message"])
    message["content"], arguments, open_block = [], "", None
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert open_block is None and event["index"] == len(message["content"])
            open_block, arguments = event["index"], ""
            message["content"].append(dict(event["content_block"]))
            continue
        assert event["index"] == open_block  # one block at a time
        block = message["content"][open_block]
        if event["type"] == "content_block_stop":
            if block["type"] == "tool_use":
                block["input"] = json.loads(arguments or "{}")
            open_block = None
        elif event["delta"]["type"] == "text_delta":
            block["text"] += event["delta"]["text"]
        else:
            arguments += event["delta"]["partial_json"]
    assert open_block is None
    return {**message, **events[-2]["delta"], "usage": events[-2]["usage"]}


def without_tool_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A message without the ids each renderer draws for its calls."""
    content = [{k: v for k, v in block.items() if k != "id"} for block in body["content"]]
    return {**body, "content": content}


@pytest.mark.parametrize(("reason", "stop_reason"), [("eos", "end_turn"), ("length", "max_tokens")])
def test_a_streamed_message_adds_up_to_the_whole_body(reason: str, stop_reason: str) -> None:
    plan = messages_plan(tool_plan(None, None, None))
    events: list[Event] = [tokens(" brown", scored=False), tokens(" fox", scored=False), finish(reason, 2)]
    body, streamed = streamed_message(plan, events)
    assert body["id"] == "msg_rid" and body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [{"type": "text", "text": " brown fox"}]
    assert body["stop_reason"] == stop_reason and body["stop_sequence"] is None
    usage = {
        "input_tokens": len(PROMPT.ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 2,
    }
    assert body["usage"] == usage
    assert assembled(streamed) == body


def test_a_streamed_tool_use_adds_up_to_the_whole_body() -> None:
    plan = messages_plan(tool_plan([WEATHER], NAMED, None))
    arguments = [tokens('{"city": ', scored=False), tokens('"Oslo"}', scored=False)]
    body, streamed = streamed_message(plan, [*arguments, finish("stop", 5)])
    (block,) = body["content"]
    assert block["type"] == "tool_use" and block["name"] == "weather" and block["input"] == {"city": "Oslo"}
    assert body["stop_reason"] == "tool_use"
    deltas = [e["delta"] for e in streamed if e["type"] == "content_block_delta"]
    assert [d["partial_json"] for d in deltas] == ['{"city": ', '"Oslo"}']  # as they came
    assert without_tool_ids(assembled(streamed)) == without_tool_ids(body)


def test_text_then_calls_read_at_the_end_are_blocks_in_order() -> None:
    plan = messages_plan(tool_plan([WEATHER], None, None))  # auto: Hermes blocks, read when the output ends
    text = ["Sure. ", '<tool_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    body, streamed = streamed_message(plan, [*(tokens(t, scored=False) for t in text), finish("eos", 9)])
    assert [block["type"] for block in body["content"]] == ["text", "tool_use"]
    assert body["content"][0]["text"] == "Sure. " and body["content"][1]["input"] == {"city": "Oslo"}
    assert body["stop_reason"] == "tool_use"
    assert without_tool_ids(assembled(streamed)) == without_tool_ids(body)


def test_an_output_of_nothing_has_no_blocks() -> None:
    body, streamed = streamed_message(messages_plan(tool_plan(None, None, None)), [finish("eos", 0)])
    assert body["content"] == [] and assembled(streamed) == body


@pytest.mark.parametrize(
    ("stop_string", "stop"), [("fox", ("stop_sequence", "fox")), (None, ("end_turn", None))]
)
def test_a_stop_string_is_the_stop_sequence(stop_string: str | None, stop: tuple[str, str | None]) -> None:
    """A stop string, named; a stop token id (vLLM's stop_token_ids) is the end of the turn."""
    stopped = replace(finish("stop", 2), stop_string=stop_string)
    body, streamed = streamed_message(
        messages_plan(tool_plan(None, None, None)), [tokens(" brown ", scored=False), stopped]
    )
    assert (body["stop_reason"], body["stop_sequence"]) == stop
    assert assembled(streamed) == body


def test_a_failed_message_stream_ends_with_an_error_event() -> None:
    renderer = MessagesRenderer(messages_plan(tool_plan(None, None, None)), "m", "rid", VOCAB)
    messages = [*renderer.opening(), *renderer.events(0, tokens(" brown", scored=False))]
    error = http_error(EngineFailure("the engine failed"), "rid")
    *_, failed = sse_events(messages + renderer.failure(error))
    assert failed == {"type": "error", "error": {"type": "api_error", "message": error.message}}


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (EngineFailure("the engine failed"), 500, "api_error"),
        (DeadlineExceeded("too late"), 504, "timeout_error"),
    ],
)
def test_a_messages_error_is_of_anthropics_type(error: Exception, status: int, kind: str) -> None:
    failed = http_error(error, "rid")
    assert anthropic_error(failed) == (
        status,
        {"type": "error", "error": {"type": kind, "message": failed.message}},
    )


def test_a_streams_usage_tells_the_same_input_from_start_to_end() -> None:
    """message_start splits the prompt as the first event tells (2 tokens from the prefix cache), and
    message_delta repeats it, as the whole body says."""
    first = replace(tokens(" brown", scored=False), cached_prompt_tokens=2)
    body, streamed = streamed_message(
        messages_plan(tool_plan(None, None, None)), [first, replace(finish("eos", 1), cached_prompt_tokens=2)]
    )
    told = {
        "input_tokens": len(PROMPT.ids) - 2,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 2,
    }
    start, delta = streamed[0]["message"]["usage"], streamed[-2]["usage"]
    assert start == {**told, "output_tokens": 0} and delta == body["usage"] == {**told, "output_tokens": 1}


def test_a_stream_that_opens_while_waiting_starts_once() -> None:
    renderer = MessagesRenderer(messages_plan(tool_plan(None, None, None)), "m", "rid", VOCAB)
    waited = sse_events([*renderer.keepalive(), *renderer.keepalive()])
    assert [e["type"] for e in waited] == ["message_start", "ping", "ping"]
    first = replace(tokens(" brown", scored=False), cached_prompt_tokens=2)
    ended = replace(finish("eos", 1), cached_prompt_tokens=2)
    events = sse_events([*renderer.events(0, first), *renderer.events(0, ended), *renderer.closing([ended])])
    assert "message_start" not in [e["type"] for e in events]
    # told before the first event: the whole prompt is input, at the start and at the end alike
    assert (
        waited[0]["message"]["usage"]["input_tokens"]
        == len(PROMPT.ids)
        == events[-2]["usage"]["input_tokens"]
    )


@pytest.mark.parametrize(
    ("event", "room", "stop_reason"),
    [
        (finish("context", 2), 100, "model_context_window_exceeded"),  # the server's token limit
        (finish("length", 2), 2, "model_context_window_exceeded"),  # the context full before max_tokens
        (finish("length", 3), 3, "max_tokens"),  # both at once: the limit the client set
        (finish("length", 3), 100, "max_tokens"),
    ],
)
def test_a_full_context_is_its_own_stop_reason(event: FinishEvent, room: int, stop_reason: str) -> None:
    context = len(PROMPT.ids) + room
    body, streamed = streamed_message(
        messages_plan(tool_plan(None, None, None), max_tokens=3, context=context),
        [tokens(" brown", scored=False), event],
    )
    assert body["stop_reason"] == stop_reason == assembled(streamed)["stop_reason"]


def test_whitespace_alone_makes_no_text_block_beside_a_tool_use() -> None:
    plan = messages_plan(tool_plan([WEATHER], None, None))  # auto: Hermes blocks, read when the output ends
    text = ["\n", ' <tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>', "\n"]
    body, streamed = streamed_message(plan, [*(tokens(t, scored=False) for t in text), finish("eos", 9)])
    (use,) = body["content"]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")  # Anthropic's kind of id
    assert without_tool_ids(assembled(streamed)) == without_tool_ids(body)

    blank, streamed = streamed_message(plan, [tokens(" \n", scored=False), finish("eos", 2)])
    assert blank["content"] == [{"type": "text", "text": " \n"}] and assembled(streamed) == blank
    spaced, _ = streamed_message(
        plan, [tokens(t, scored=False) for t in (" ", "Sure", " ")] + [finish("eos", 3)]
    )
    assert spaced["content"] == [{"type": "text", "text": " Sure "}]

"""The dense families' chat templates (tests/support/family_chat_templates.py: each family's layout and Jinja,
written here) render through the server's template path as transformers' apply_chat_template renders them:
an OpenAI chat request read as /v1/chat/completions reads it (its messages, tools, documents and
chat_template_kwargs), rendered and tokenized as the server does, against apply_chat_template given the
same chat (tool calls' arguments as the objects transformers documents) with the same keyword arguments.
The HTTP routes and gRPC's `messages` input hand the request's tools, documents, template variables and
messages' own fields to the template, and both render one chat as one prompt. A message's reasoning reaches
templates written for either of its names, as transformers aliases them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from family_chat_templates import GEMMA2, GEMMA3, GRANITE, OLMO2, PHI4_MINI, SMOLLM3
from running_server import RunningServer, serve_with_template
from server_tools import LoopThread, rpc_error
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc
from serve.api.chat import ChatTemplate, special_tokens
from serve.api.openai.protocol import ChatCompletionRequest
from serve.api.openai.translate_chat import chat_messages
from serve.api.tool_calls import tool_plan
from serve.api.tool_formats import tool_format
from serve.bundle import load_bundle
from serve.errors import InvalidRequest

# family -> its template, its bos / eos / pad tokens (None: it has none) and its other special tokens
FAMILIES: dict[str, tuple[str, tuple[str | None, str, str], tuple[str, ...]]] = {
    "gemma3": (GEMMA3, ("<bos>", "<eos>", "<pad>"), ("<start_of_turn>", "<end_of_turn>", "<start_of_image>")),
    "gemma2": (GEMMA2, ("<bos>", "<eos>", "<pad>"), ("<start_of_turn>", "<end_of_turn>")),
    "phi4-mini": (
        PHI4_MINI,
        ("<|endoftext|>", "<|endoftext|>", "<|endoftext|>"),
        ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|/tool|>", "<|end|>", "<|tool_call|>"),
    ),
    "smollm3": (SMOLLM3, (None, "<|im_end|>", "<|endoftext|>"), ("<|im_start|>", "<think>", "</think>")),
    "granite": (
        GRANITE,
        ("<|end_of_text|>", "<|end_of_text|>", "<|end_of_text|>"),
        ("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    ),
    "olmo2": (OLMO2, ("<|endoftext|>", "<|endoftext|>", "<|pad|>"), ()),
}

WEATHER = {
    "name": "weather",
    "description": "Today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS = [{"type": "function", "function": WEATHER}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
SYSTEM = {"role": "system", "content": 'Be brief. <b>&</b> "quotes"'}
TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "  and 3+3?\n"}]},
]
ONE_TURN = {"messages": [{"role": "user", "content": "hello"}]}
SYSTEM_AND_TURNS = {"messages": [SYSTEM, *TURNS]}
# family -> the requests (bodies of /v1/chat/completions) it renders
CASES: dict[str, dict[str, dict[str, Any]]] = {
    "gemma3": {
        "one-turn": ONE_TURN,
        "system-multi-turn": SYSTEM_AND_TURNS,
        "several-text-parts": {
            "messages": [
                {
                    "role": "system",
                    "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}],
                },
                {
                    "role": "user",
                    "content": [{"type": "text", "text": " 2+2? "}, {"type": "text", "text": "\n3+3?"}],
                },
            ]
        },
    },
    "gemma2": {"one-turn": ONE_TURN, "multi-turn": {"messages": TURNS}},
    "phi4-mini": {
        "system-multi-turn": SYSTEM_AND_TURNS,
        "system-tools": {
            "messages": [
                {"role": "system", "content": "Call tools.", "tools": json.dumps([WEATHER])},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": '<|tool_call|>[{"name": "weather"}]'},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
            ]
        },
    },
    "smollm3": {
        "one-turn": ONE_TURN,
        "system-multi-turn": SYSTEM_AND_TURNS,
        "no-think-flag-over-the-variable": {
            "messages": [{"role": "system", "content": "Be brief. /no_think"}, *TURNS],
            "chat_template_kwargs": {"enable_thinking": True},
        },
        "xml-tools-without-thinking": {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": '\n<tool_call>{"name": "weather"}</tool_call>'},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"},
            ],
            "chat_template_kwargs": {"enable_thinking": False, "xml_tools": [WEATHER]},
        },
    },
    "granite": {
        "one-turn-with-the-date": ONE_TURN,
        "system-multi-turn": SYSTEM_AND_TURNS,
        "tools-documents-calls": {
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"degrees": 3}'},
            ],
            "tools": TOOLS,
            "documents": [{"doc_id": "met", "text": "Oslo is cold."}, {"text": "Bergen is wet."}],
            "chat_template_kwargs": {"thinking": True, "controls": {"length": "short"}},
        },
    },
    "olmo2": {"one-turn": ONE_TURN, "system-multi-turn": SYSTEM_AND_TURNS},
}
PARAMS = [(family, case) for family, cases in CASES.items() for case in cases]


def family_tokenizers(family: str) -> tuple[Tokenizer, Any]:
    """A byte-level tokenizer with the family's special tokens, and transformers' around it."""
    _, (bos, eos, pad), others = FAMILIES[family]
    specials = list(dict.fromkeys(t for t in (bos, eos, pad, *others) if t is not None))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(specials)
    named = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=FAMILIES[family][0],
        **{k: v for k, v in named.items() if v is not None},
    )
    return tok, hf


def server_template(family: str, tok: Tokenizer) -> ChatTemplate:
    """The template as the server compiles it: with the special tokens of the bundle's ids."""
    _, (bos, eos, pad), _ = FAMILIES[family]
    ids = {"eos_token": tok.token_to_id(eos), "pad_token": tok.token_to_id(pad)}
    if bos is not None:
        ids["bos_token"] = tok.token_to_id(bos)
    return ChatTemplate(FAMILIES[family][0], special_tokens(tok, ids))


def server_inputs(template: str, request: dict[str, Any], parts: bool = False) -> dict[str, Any]:
    """What /v1/chat/completions hands the chat template for `request` (`parts`: the template reads them)."""
    body = ChatCompletionRequest.model_validate(request)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_format(template))
    return {
        "messages": chat_messages(body.messages, parts),
        "tools": plan.template_tools,
        "documents": body.documents,
        "variables": body.chat_template_kwargs,
    }


# The templates that read a message's content parts; the others take content as a string, and a client of
# transformers gives them strings (the server joins the text parts for them).
READS_PARTS = ("gemma3",)


def transformers_chat(family: str, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's chat as transformers documents it: a call's arguments as an object, content as the
    family's template reads it."""
    chat = copy.deepcopy(request["messages"])
    for message in chat:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if isinstance(message["content"], list) and family not in READS_PARTS:
            message["content"] = "\n".join(part["text"] for part in message["content"])
    return chat


def either_side(render: Callable[[], Any], ours: Any) -> None:
    """`ours` equals transformers' rendering just before or just after it (templates that write today's
    date may see the day change between the two)."""
    before = render()
    assert ours in (before, render())


@pytest.mark.parametrize(("family", "case"), PARAMS)
def test_the_server_renders_and_tokenizes_as_apply_chat_template(family: str, case: str) -> None:
    request = CASES[family][case]
    tok, hf = family_tokenizers(family)
    ours = server_template(family, tok)
    inputs = server_inputs(ours.source, request, ours.reads_parts)
    theirs = {
        "conversation": transformers_chat(family, request),
        "tools": request.get("tools"),
        "documents": request.get("documents"),
        "add_generation_prompt": True,
        **request.get("chat_template_kwargs", {}),
    }
    text = ours.render(**inputs)
    either_side(lambda: hf.apply_chat_template(**theirs, tokenize=False), text)
    ids = ours.prompt_ids(tok, **inputs)
    either_side(lambda: list(hf.apply_chat_template(**theirs, tokenize=True, return_dict=False)), ids)
    if case == "system-tools":  # a system message's own field reached the template
        assert f"<|tool|>{json.dumps([WEATHER])}<|/tool|>" in text


@pytest.mark.parametrize(
    ("family", "messages", "why"),
    [
        ("gemma2", [SYSTEM, *TURNS], "takes no system turn"),
        ("gemma3", [SYSTEM, TURNS[1], TURNS[0]], "alternates user and model turns"),
    ],
    ids=["gemma2-system", "gemma3-assistant-first"],
)
def test_a_chat_the_template_refuses_is_refused_as_transformers_refuses_it(
    family: str, messages: list[dict[str, Any]], why: str
) -> None:
    tok, hf = family_tokenizers(family)
    with pytest.raises(Exception, match=why):
        hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with pytest.raises(InvalidRequest, match=why):
        server_template(family, tok).render(**server_inputs(FAMILIES[family][0], {"messages": messages}))


def test_template_variables_cannot_replace_what_the_server_gives() -> None:
    tok, _ = family_tokenizers("smollm3")
    inputs = server_inputs(SMOLLM3, {**ONE_TURN, "chat_template_kwargs": {"messages": []}})
    with pytest.raises(InvalidRequest, match=r"chat_template_kwargs\.messages: the server sets it"):
        server_template("smollm3", tok).render(**inputs)


# What the routes hand a template, in a few tokens: a message's own field, its reasoning (as `thinking`) and
# tool calls (their arguments parsed), the tools, the documents, a variable.
ROUTED = (
    "{%- for t in tools or [] %}<{{ t.function.name }}>{% endfor %}"
    "{%- for m in messages %}{{ m.role[0] }}{{ m.mood or '' }}{{ m.thinking or '' }}"
    "{%- for c in m.tool_calls or [] %}{{ c.function.name }}={{ c.function.arguments.n }}{% endfor %}"
    ":{{ m.content }}\n{% endfor %}"
    "{%- for d in documents or [] %}[{{ d.text }}]{% endfor %}{{ suffix if suffix is defined else '' }}a:"
)


@pytest.fixture(scope="module")
def routed(
    loop: LoopThread, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    running = serve_with_template(
        loop, tiny_bundle, tmp_path_factory.mktemp("routed"), ROUTED, engine_process=False
    )
    yield running
    running.stop()


def test_the_routes_hand_documents_variables_and_message_fields_to_the_template(
    routed: RunningServer, tiny_bundle: Path
) -> None:
    chat = {
        "messages": [{"role": "user", "content": "def f(", "mood": "!"}],
        "documents": [{"text": "x = 1"}],
        "chat_template_kwargs": {"suffix": "#"},
    }
    tokenizer = load_bundle(tiny_bundle).tokenizer
    want = tokenizer.encode("u!:def f(\n[x = 1]#a:", add_special_tokens=False).ids
    base = routed.http_base
    counted = httpx.post(f"{base}/tokenize", json=chat).json()
    assert counted["tokens"] == want
    reply = httpx.post(f"{base}/v1/chat/completions", json={**chat, "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == len(want)
    refused = httpx.post(f"{base}/tokenize", json={"prompt": "x", "documents": chat["documents"]})
    assert refused.status_code == 400 and "documents applies to messages" in refused.text


def test_grpc_renders_a_chat_as_the_http_api_renders_it(routed: RunningServer, tiny_bundle: Path) -> None:
    """The same chat over gRPC (its typed fields and JSON text fields) and over HTTP is one prompt."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"n": 7}'}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat: dict[str, Any] = {
        "messages": [
            {"role": "system", "content": "s", "name": "ops"},
            {"role": "user", "content": "q", "mood": "!"},
            {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "8"},
            {"role": "user", "content": "def f("},
        ],
        "tools": [tool],
        "documents": [{"text": "x = 1"}],
        "chat_template_kwargs": {"suffix": "#"},
    }
    tokenizer = load_bundle(tiny_bundle).tokenizer
    counted = httpx.post(f"{routed.http_base}/tokenize", json=chat).json()["tokens"]
    text = "<f>s:s\nu!:q\nahmf=7:\nt:8\nu:def f(\n[x = 1]#a:"
    assert counted == tokenizer.encode(text, add_special_tokens=False).ids

    messages = [
        pb.ChatMessage(role="system", content="s", name="ops"),
        pb.ChatMessage(role="user", content="q", fields=json.dumps({"mood": "!"})),
        pb.ChatMessage(
            role="assistant",
            reasoning_content="hm",
            tool_calls=[pb.ToolCall(id="c1", name="f", arguments='{"n": 7}')],
        ),
        pb.ChatMessage(role="tool", tool_call_id="c1", content="8"),
        pb.ChatMessage(role="user", content="def f("),
    ]
    grpc_chat = pb.ChatMessages(
        messages=messages,
        tools=json.dumps(chat["tools"]),
        documents=json.dumps(chat["documents"]),
        chat_template_kwargs=json.dumps(chat["chat_template_kwargs"]),
    )
    stopping = pb.StoppingCriteria(max_new_tokens=3, ignore_eos=True)
    with grpc.insecure_channel(routed.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        by_chat, by_ids = (
            stub.Generate(pb.GenerateRequest(stopping=stopping, include_prompt_logprobs=True, **prompt))
            for prompt in ({"messages": grpc_chat}, {"token_ids": pb.TokenIds(ids=counted)})
        )
        assert by_chat.usage.prompt_tokens == len(counted)
        assert list(by_chat.token_ids) == list(by_ids.token_ids)
        assert list(by_chat.prompt_logprobs) == pytest.approx(list(by_ids.prompt_logprobs), abs=1e-5)

        user = [pb.ChatMessage(role="user", content="q")]
        for bad, why in [
            (
                pb.ChatMessages(messages=user, chat_template_kwargs='{"documents": []}'),
                "chat_template_kwargs.documents: the server sets it",
            ),
            (pb.ChatMessages(messages=user, documents="[{"), "messages.documents is not valid JSON"),
            (
                pb.ChatMessages(messages=user, documents="{}"),
                "messages.documents: Input should be a valid list",
            ),
            (
                pb.ChatMessages(messages=[pb.ChatMessage(role="user", fields='{"name": "x"}')]),
                "messages.messages[0].fields.name: set ChatMessage.name instead",
            ),
            (pb.ChatMessages(messages=[pb.ChatMessage(role="tool")]), "tool_call_id is required"),
        ]:
            error = rpc_error(lambda bad=bad: stub.Generate(pb.GenerateRequest(messages=bad)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and why in error.details()


# Templates written for one name of a message's reasoning, and chats that give it under each name.
REASONING_TEMPLATES = {
    name: "{%- for m in messages %}{{ m.role }}["
    f"{{{{ m.{name} if m.{name} is defined else '-' }}}}]:{{{{ m.content }}}}\n{{% endfor %}}"
    for name in ("thinking", "reasoning_content")
}
REASONING_CHATS: dict[str, list[dict[str, Any]]] = {
    "reasoning_content": [{"role": "assistant", "content": "4", "reasoning_content": "2+2"}],
    "thinking": [{"role": "assistant", "content": "4", "thinking": "2+2"}],
    "reasoning": [{"role": "assistant", "content": "4", "reasoning": "2+2"}],
    "both": [{"role": "assistant", "content": "4", "reasoning_content": "a", "thinking": "b"}],
    "thinking-and-reasoning": [{"role": "assistant", "content": "4", "thinking": "b", "reasoning": "c"}],
    "a-user-turn-and-none": [
        {"role": "user", "content": "q", "thinking": "u"},
        {"role": "assistant", "content": "4"},
    ],
}


@pytest.mark.parametrize("chat", REASONING_CHATS)
@pytest.mark.parametrize("reads", REASONING_TEMPLATES)
def test_a_messages_reasoning_reaches_a_template_under_either_name_as_in_transformers(
    reads: str, chat: str
) -> None:
    tok, _ = family_tokenizers("olmo2")
    template = REASONING_TEMPLATES[reads]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, eos_token="<|endoftext|>")
    messages = REASONING_CHATS[chat]
    ours = ChatTemplate(template, {}).render(**server_inputs(template, {"messages": messages}))
    theirs = hf.apply_chat_template(copy.deepcopy(messages), add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    assert "[-]" not in ours.split("\n")[0]  # the first message's reasoning reached the template


@pytest.mark.parametrize("family", FAMILIES)
def test_the_templates_that_read_content_parts_get_them(family: str) -> None:
    """A template that loops over a message's content gets the request's parts (each rendered as
    transformers renders it); the others get the text parts joined with newlines."""
    tok, _ = family_tokenizers(family)
    template = server_template(family, tok)
    assert template.reads_parts == (family in READS_PARTS)
    request = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    (message,) = server_inputs(template.source, request, template.reads_parts)["messages"]
    joined = message["content"] == "a\nb"
    assert joined != template.reads_parts

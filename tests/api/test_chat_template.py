"""serve/api/chat.py renders a chat exactly as transformers' apply_chat_template(add_generation_prompt=True)
does and tokenizes it without adding special tokens, for a few templates (tokenizers built here: nothing is
downloaded). transformers is a dev/export dependency: the server never imports it."""

from __future__ import annotations

from typing import Any

import pytest
from chat_templates import HERMES_TOOLS, LLAMA_TOOLS, MISTRAL_TOOLS
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from export.demo import DEMO_CHAT_TEMPLATE
from serve.api.chat import ChatTemplate
from serve.errors import BundleError, InvalidRequest

ZEPHYR = (
    "{% for message in messages %}\n{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif %}\n"
    "{% endfor %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Namespaces, tojson, a dict, loop controls and a generation block: what newer templates use.
FANCY = (
    "{%- set ns = namespace(n=0) -%}{%- for m in messages -%}{%- if m.role == 'system' -%}{%- continue -%}"
    "{%- endif -%}{%- set ns.n = ns.n + 1 -%}{{ ns.n }}:{{ m.role }}={{ m.content | tojson }}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}\n"
    "{%- endfor -%}{{ dict(a=1) | tojson }}{%- if add_generation_prompt %}<assistant>{% endif -%}"
)
TEMPLATES = {"demo": DEMO_CHAT_TEMPLATE, "zephyr": ZEPHYR, "llama2": LLAMA2, "fancy": FANCY}
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "hello"}],
    [
        {"role": "system", "content": 'Be brief. <b>&</b> "quotes"'},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
    ],
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def tokenizer() -> Tokenizer:
    """A byte-level tokenizer with special tokens and a post-processor that adds BOS (so "without special
    tokens" is visible)."""
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab |= {ch: i + 3 for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<s>", "</s>", "<pad>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def hf_tokenizer(tok: Tokenizer, template: str) -> Any:
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **SPECIAL)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_renders_and_tokenizes_as_transformers(name: str, chat: int) -> None:
    tok = tokenizer()
    hf = hf_tokenizer(tok, TEMPLATES[name])
    messages = CHATS[chat]
    if name == "llama2" and chat == 1:
        messages = messages[:3]  # llama2's template wants the user's turn to end... any alternating chat
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ours = ChatTemplate(TEMPLATES[name], SPECIAL)
    assert ours.render(messages) == expected
    assert ours.prompt_ids(tok, messages) == list(ids)
    assert (ids[0] == 0) == expected.startswith("<s>")  # the post-processor's BOS is not added again


def test_raise_exception_is_the_clients_error() -> None:
    ours = ChatTemplate(LLAMA2, SPECIAL)
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        ours.render(bad)
    with pytest.raises(Exception, match="roles must alternate"):
        hf_tokenizer(tokenizer(), LLAMA2).apply_chat_template(bad, add_generation_prompt=True, tokenize=False)


def test_the_sandbox_keeps_templates_from_python() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest, match="chat template refused"):
        ChatTemplate(escape, {}).render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequest, match="chat template refused"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", {}).render([{"role": "user", "content": "x"}])
    with pytest.raises(BundleError, match="not a valid Jinja template"):
        ChatTemplate("{% for %}", {})


# Each family's template, and how it writes the assistant's earlier call.
TOOL_TEMPLATES = [
    (HERMES_TOOLS, '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'),
    (MISTRAL_TOOLS, '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}]'),
    (LLAMA_TOOLS, '{"name": "weather", "parameters": {"city": "Oslo"}}<|eot_id|>'),
]


@pytest.mark.parametrize(("template", "call"), TOOL_TEMPLATES, ids=["hermes", "mistral", "llama"])
def test_tools_and_tool_messages_render_as_transformers(template: str, call: str) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Today's weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    chat: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "content": '{"celsius": -3}', "tool_call_id": "call_1"},
    ]
    hf = hf_tokenizer(tokenizer(), template)
    expected = hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    ours = ChatTemplate(template, SPECIAL)
    assert ours.render(chat, tools=tools) == expected
    assert "Today's weather" in expected and call in expected
    assert "Today's weather" not in ours.render(chat)  # without tools the template leaves them out


# A template that iterates the arguments as a mapping (as some HF templates write each argument).
CALLS = "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments"
ITEMS = CALLS + "|items %}{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}"
METHOD = CALLS + ".items() %}{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template", [ITEMS, METHOD], ids=["items-filter", "items-method"])
def test_a_template_that_needs_mapping_arguments_refuses_raw_ones_naming_them(template: str) -> None:
    def chat(arguments: Any) -> list[dict[str, Any]]:
        call = {"type": "function", "function": {"name": "weather", "arguments": arguments}}
        return [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]

    assert ChatTemplate(template, {}).render(chat({"city": "Oslo"})) == "city=Oslo;"
    with pytest.raises(InvalidRequest, match=r"""arguments in the history are the text '\{"city": "Os'"""):
        ChatTemplate(template, {}).render(chat('{"city": "Os'))

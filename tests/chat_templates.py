"""Chat templates the tests share: a Hermes / Qwen2.5-style one that declares tools (ChatML's layout written
as plain text, as the demo template is, so any byte-level tokenizer renders it)."""

from __future__ import annotations

# The tools as JSON lines in a system turn, the assistant's earlier calls as <tool_call> blocks (their
# arguments are dicts: `tojson` writes them as objects), tool results as <tool_response> user turns.
HERMES_TOOLS = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    'For each function call, return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{- message.content }}"
    "{%- for call in message.tool_calls %}\n<tool_call>"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The same ideas in as few tokens as the tiny bundle's 128-token context allows: the tools' names, each
# message's first letter and content, an assistant's call arguments as JSON.
COMPACT_TOOLS = (
    "{%- if tools %}<tools>{% for tool in tools %}{{ tool.function.name }};{% endfor %}</tools>{% endif %}"
    "{%- for m in messages %}{{ m.role[0] }}:{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}<tool_call>{{ call.function.arguments | tojson }}</tool_call>"
    "{%- endfor %}\n{% endfor %}a:"
)

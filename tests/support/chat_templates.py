"""Chat templates the tests share, one per family's tool section (Hermes / Qwen2.5, Mistral v0.3, Llama 3.1
JSON), written as plain text, as the demo template is, so any byte-level tokenizer renders them; and compact
variants for the tiny bundle's 128-token context."""

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

# Mistral v0.3's layout (mistral-common's, as its official template writes it): the tools as a JSON array in
# [AVAILABLE_TOOLS] before the first user turn, the assistant's calls as "[TOOL_CALLS] [...]", results in
# [TOOL_RESULTS].
MISTRAL_TOOLS = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools and loop.first %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message.content }}[/INST]"
    "{%- elif message.tool_calls %}[TOOL_CALLS] ["
    "{%- for call in message.tool_calls %}{{ call.function | tojson }}{% if not loop.last %}, {% endif %}"
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] "
    '{"content": {{ message.content }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- else %} {{ message.content }}{{ eos_token }}{% endif %}"
    "{%- endfor %}"
)

# Llama 3.1 / 3.2's JSON tool calling (Meta's template): the tools and the instruction in the first user
# turn, the assistant's call as a {"name", "parameters"} object, results in an ipython turn.
LLAMA_TOOLS = (
    "{{- bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools %}Environment: ipython\n{% endif %}You are a helpful assistant.<|eot_id|>"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for call in message.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{- message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{%- if tools and loop.first %}Given the following functions, please respond with a JSON for a function "
    "call with its proper arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
    "{%- for tool in tools %}{{ tool | tojson(indent=4) }}\n\n{% endfor %}{% endif %}"
    "{{- message.content }}<|eot_id|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# The compact template's Mistral and Llama variants: what their families' templates declare, in few tokens.
COMPACT_MISTRAL = (
    "{%- if tools %}[AVAILABLE_TOOLS]{% for tool in tools %}{{ tool.function.name }};{% endfor %}"
    "[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{{ m.role[0] }}:{{ m.content }}"
    "{%- if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') | list | tojson }}"
    "{%- endif %}\n{% endfor %}a:"
)
COMPACT_LLAMA = (
    '{%- if tools %}{"name": function name, "parameters": args}'
    "{% for tool in tools %}{{ tool.function.name }};{% endfor %}{% endif %}"
    "{%- for m in messages %}{{ m.role[0] }}:{{ m.content }}\n{% endfor %}a:"
)

"""Chat templates in the layout of each dense family's published template, written here with the Jinja
constructs those use (their wording and structure are this project's): what the server must render as
transformers' apply_chat_template renders them.

- Gemma 3: BOS, the system prompt folded into the first user turn (a string or text parts), roles that must
  alternate (raise_exception), "model" turns, content as a string or parts (images, text), trim, loop.first;
- Gemma 2: the same turns, and a system turn refused;
- Phi-4-mini (and Phi-3's tags): <|role|> tags, a system message's own `tools` (a JSON string) in
  <|tool|>, EOS when no generation prompt is asked;
- SmolLM3: enable_thinking (defined or not), the /think and /no_think flags of the system prompt,
  strftime_now, namespace, str methods, xml_tools given as template variables (`tool | string`), a tool's
  result as a user turn, the empty think block of the no-think mode;
- Granite 3.x: today's date in the default system prompt, tools (tojson with indent), documents, the
  assistant's earlier calls (map, list, tojson), tool results, `thinking` and `controls` variables,
  loop.last with add_generation_prompt;
- OLMo 2: BOS, <|role|> tags, EOS after each answer, a newline between turns except after the last.
"""

from __future__ import annotations

GEMMA3 = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(prefix='', start=0) -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}"
    "{%- set text = system if system is string else system | map(attribute='text') | join('') -%}"
    "{%- set ns.prefix = text ~ '\n\n' -%}"
    "{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- for message in messages[ns.start:] -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 is even) -%}"
    "{{- raise_exception('Gemma 3 alternates user and model turns, the user first') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\n' -}}"
    "{%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<start_of_image>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] | trim -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

GEMMA2 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{{- raise_exception('Gemma 2 takes no system turn') -}}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') == (loop.index0 is even) -%}"
    "{{- raise_exception('Gemma 2 alternates user and model turns, the user first') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' ~ message['role'] | replace('assistant', 'model') ~ '\n' -}}"
    "{{- message['content'] | trim ~ '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

PHI4_MINI = (
    "{%- for message in messages -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] -}}"
    "{%- if message['role'] == 'system' and 'tools' in message and message['tools'] is not none -%}"
    "{{- '<|tool|>' ~ message['tools'] ~ '<|/tool|>' -}}"
    "{%- endif -%}"
    "{{- '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- else -%}{{- eos_token -}}{%- endif -%}"
)

SMOLLM3 = (
    "{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}"
    "{%- set ns = namespace(mode='/think' if enable_thinking else '/no_think', instructions='') -%}"
    "{%- if messages[0].role == 'system' -%}"
    "{%- set text = messages[0].content -%}"
    "{%- if '/no_think' in text -%}{%- set ns.mode = '/no_think' -%}"
    "{%- elif '/think' in text -%}{%- set ns.mode = '/think' -%}{%- endif -%}"
    "{%- set ns.instructions = text.replace('/no_think', '').replace('/think', '').rstrip() -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>system\n## Metadata\n\nToday Date: ' ~ strftime_now('%d %B %Y') -}}"
    "{{- '\nReasoning Mode: ' ~ ns.mode ~ '\n\n## Custom Instructions\n\n' -}}"
    "{{- (ns.instructions or 'You are a helpful assistant.') ~ '\n\n' -}}"
    "{%- if xml_tools is defined -%}"
    "{{- '### Tools\n\n<tools>\n' -}}"
    "{%- for tool in xml_tools -%}{{- tool | string ~ '\n' -}}{%- endfor -%}"
    "{{- '</tools>\n\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- set empty_think = '' if ns.mode == '/think' else '<think>\n\n</think>\n' -%}"
    "{%- for message in messages -%}"
    "{%- set content = message.content if message.content is string else '' -%}"
    "{%- if message.role in ('user', 'tool') -%}"
    "{{- '<|im_start|>user\n' ~ content ~ '<|im_end|>\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' ~ empty_think ~ content.lstrip('\n') ~ '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' ~ empty_think -}}{%- endif -%}"
)

GRANITE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set today = \"Today's Date: \" ~ strftime_now('%B %d, %Y') -%}"
    "{%- set system = today ~ '.\nYou are Granite, an AI assistant.' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- if tools and documents -%}{%- set system = system ~ ' Call the tools, and cite the documents.' -%}"
    "{%- elif tools -%}{%- set system = system ~ ' Call the tools when they help.' -%}"
    "{%- elif documents -%}{%- set system = system ~ ' Answer from the documents.' -%}{%- endif -%}"
    "{%- if thinking is defined and thinking -%}"
    "{%- set system = system ~ ' Think first, between <think> and </think>.' -%}"
    "{%- endif -%}"
    "{{- '<|start_of_role|>system<|end_of_role|>' ~ system ~ '<|end_of_text|>\n' -}}"
    "{%- if tools -%}"
    "{{- '<|start_of_role|>available_tools<|end_of_role|>\n' -}}"
    "{%- for tool in tools -%}"
    "{{- tool | tojson(indent=4) -}}{%- if not loop.last -%}{{- '\n\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{{- '<|end_of_text|>\n' -}}"
    "{%- endif -%}"
    "{%- for document in documents or [] -%}"
    "{{- '<|start_of_role|>document {\"document_id\": \"' ~ (document.doc_id or loop.index) ~ '\"}' -}}"
    "{{- '<|end_of_role|>\n' ~ document['text'] ~ '<|end_of_text|>\n' -}}"
    "{%- endfor -%}"
    "{%- for message in turns -%}"
    "{%- if message['role'] == 'assistant' and message.tool_calls -%}"
    "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' -}}"
    "{{- message.tool_calls | map(attribute='function') | list | tojson ~ '<|end_of_text|>\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|start_of_role|>tool_response<|end_of_role|>' ~ message['content'] ~ '<|end_of_text|>\n' -}}"
    "{%- else -%}"
    "{{- '<|start_of_role|>' ~ message['role'] ~ '<|end_of_role|>' ~ message['content'] -}}"
    "{{- '<|end_of_text|>\n' -}}"
    "{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}"
    "{{- '<|start_of_role|>assistant' -}}"
    "{%- if controls is defined and controls.length -%}"
    "{{- ' {\"length\": \"' ~ controls.length ~ '\"}' -}}"
    "{%- endif -%}"
    "{{- '<|end_of_role|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

OLMO2 = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>\n' ~ message['content'] ~ eos_token ~ ('' if loop.last else '\n') -}}"
    "{%- else -%}"
    "{{- '<|' ~ message['role'] ~ '|>\n' ~ message['content'] ~ '\n' -}}"
    "{%- endif -%}"
    "{%- if loop.last and add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"
    "{%- endfor -%}"
)

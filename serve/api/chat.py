"""Chat messages → the prompt text of the bundle's chat template, as transformers renders it.

`ChatTemplate` compiles the manifest's `chat_template` (Jinja) the way transformers' `apply_chat_template`
does: jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the loop-control
extension and the `{% generation %}` tag, a `tojson` filter that does not escape HTML, and the globals
`raise_exception`, `strftime_now`, `dict` and `namespace`; it is rendered with `messages` (each message's
fields as the request gave them, a Phi-4-mini system message's `tools` included, and a message's reasoning
under both of its names, as transformers 5 aliases them),
`add_generation_prompt=True`, `tools` (the HTTP request's tool dicts, or None), `documents` (the request's, or
None), the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token`, ... those the bundle has) and
the request's template variables (vLLM's `chat_template_kwargs`: SmolLM3's `enable_thinking` and `xml_tools`,
Granite's `thinking`, ...). The rendered text is tokenized WITHOUT adding special tokens again: the template
writes those it wants. Both front ends use it (gRPC's `messages` input and the HTTP API's
/v1/chat/completions).

A template is code from whoever exported the bundle: the sandbox keeps it from reaching Python's internals,
and a message it refuses (`raise_exception`) or cannot render is the client's InvalidRequest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from serve.errors import BundleError, InvalidRequest

# What the server itself hands a template, which a request's template variables cannot replace.
TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# The names a message's reasoning goes by, the one templates are written for first (transformers 5's
# _REASONING_FIELDS): see `_alias_reasoning`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The special tokens transformers hands a template (its special_tokens_map), and the manifest field or
# tokenizer id each one comes from here.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it (for
    training masks); rendering a prompt keeps the body as it is."""

    tags = {"generation"}  # noqa: RUF012  (jinja2's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside a template, without the class itself (no attribute access to type internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace that refuses underscore-prefixed attributes (as transformers' does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def special_tokens(tokenizer: Tokenizer, ids: Mapping[str, int | None]) -> dict[str, str]:
    """`{"eos_token": "<|endoftext|>", ...}` for the special tokens whose id is given (None: absent)."""
    out: dict[str, str] = {}
    for name, token_id in ids.items():
        token = None if token_id is None else tokenizer.id_to_token(token_id)
        if token is not None:
            out[name] = token
    return out


class ChatTemplate:
    """A bundle's chat template, compiled once; `render` and `prompt_ids` are safe to call from any thread."""

    def __init__(self, source: str, tokens: Mapping[str, str], *, where: str = "chat_template") -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            # Whether a request's text parts reach it as parts, else joined into one string.
            self.reads_parts = _reads_content_parts(env.parse(source))
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise BundleError(
                f"{where}: not a valid Jinja template: line {exc.lineno}: {exc.message}"
            ) from None
        self.source = source
        self.tokens = dict(tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; InvalidRequest if the template refuses the messages or fails on them. `tools` are
        the request's tool dicts (`{"type": "function", "function": {...}}`), as apply_chat_template passes
        them; `documents` its documents; `variables` its keyword arguments (vLLM's chat_template_kwargs:
        enable_thinking, xml_tools, ...), which, as there, take the place of a special token of their name."""
        if not messages:
            raise InvalidRequest("messages is empty: give at least one message")
        reserved = sorted(set(variables or ()) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise InvalidRequest(
                f"chat_template_kwargs.{reserved[0]}: the server sets it (from messages, tools, documents)"
            )
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        try:
            return self._template.render(
                **{**self.tokens, **(variables or {})},
                messages=chat,
                tools=None if tools is None else [dict(tool) for tool in tools],
                documents=None if documents is None else [dict(d) for d in documents],
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, a sandbox refusal, an undefined
            raise InvalidRequest(f"the chat template refused the messages: {exc}{_why(chat)}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidRequest(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}{_why(chat)}"
            ) from None

    def prompt_ids(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The rendered chat's token ids; special tokens are not added again (apply_chat_template's way)."""
        text = self.render(messages, tools=tools, documents=documents, variables=variables)
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise InvalidRequest("the chat template rendered the messages as no tokens")
        return list(ids)


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its reasoning (the first of REASONING_FIELDS it sets) also under `reasoning_content`
    and, unless it sets `thinking` itself, `thinking` (gpt-oss's templates read that name): what transformers
    5's apply_chat_template does to every message, whatever its role, so that a template written for either
    name renders a turn given under the other."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _reads_content_parts(template: jinja2.nodes.Template) -> bool:
    """Whether the template loops over a message's content (`for part in message['content']`, directly,
    through filters, or through a variable set to it): vLLM's "openai" content format, as its auto mode
    detects it. Such a template (Gemma 3's) renders a message's parts one by one, and gets them as the
    request gave them; the others take content as a string, and get the text parts joined."""

    def content(node: jinja2.nodes.Node, names: set[str]) -> bool:
        while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == "content"
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        return isinstance(node, jinja2.nodes.Name) and node.name in names

    names: set[str] = set()
    for assign in template.find_all(jinja2.nodes.Assign):
        if isinstance(assign.target, jinja2.nodes.Name) and content(assign.node, names):
            names.add(assign.target.name)
    return any(content(loop.iter, names) for loop in template.find_all(jinja2.nodes.For))


def _why(messages: Sequence[Mapping[str, Any]]) -> str:
    """What likely made a template fail: a history call's arguments that are not JSON reach it as the raw
    string, and templates that iterate a mapping there cannot render them ("": none such)."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            arguments = call.get("function", {}).get("arguments") if isinstance(call, Mapping) else None
            if isinstance(arguments, str):
                return (
                    f" (a tool call's arguments in the history are the text {arguments[:40]!r}, not a JSON "
                    "object; the template got that string and cannot render it: send them as JSON)"
                )
    return ""

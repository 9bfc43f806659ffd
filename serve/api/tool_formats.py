"""How `tool_choice: auto` reads calls out of a model's text: the tool-call format the chat template declares.

Each `ToolCallFormat` says how its template is recognized, where in the output the calls begin, and how the
calls are read from there; `tool_format(template)` picks the first one the template declares, and textgen's
convention (Hermes) when it declares none of them:

- Hermes / Qwen2.5 / Qwen3 (a template that writes `<tool_call>`): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>` blocks anywhere in the output; the text around them is the message's content.
- Mistral (a template that writes `[TOOL_CALLS]`): `[TOOL_CALLS]` then a JSON array of `{"name",
  "arguments"}` objects (v0.3), or `[TOOL_CALLS]name{...}` once per call (tokenizer v11 on, optionally
  `name[ARGS]{...}`); the text before it is content. `[TOOL_CALLS]` is a special token of Mistral's
  tokenizers, which the output text leaves out, so an output that begins with `[` is read as calls too.
- Llama 3.1 / 3.2 JSON (a template that asks for `{"name": function name, "parameters": ...}`): the whole
  output is one JSON object with "name" and "parameters" (or "arguments"), or several separated by `;`,
  optionally after `<|python_tag|>`. There is no marker: the output is calls only if it begins so (after
  blanks), which is decided at its first characters.

An output whose calls do not parse, or name a function the request does not declare, is content (a Hermes
block on its own: the other blocks are still calls). While the output streams, content goes out at once
except what may begin the calls (a marker's first characters, or the first characters of an output that may
open with calls); from where the calls begin, the rest is held and read at the end.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
LLAMA_TAG = "<|python_tag|>"

_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Content = str | None
# A format's reader: the output from where its calls begin → the content in it and the calls, or None when
# it holds no calls (all of it is content).
Reader = Callable[[str, Sequence[str]], tuple[str, list[ToolCall]] | None]


@dataclass(frozen=True)
class ToolCallFormat:
    """A tool-call format: `declared(template)` whether a chat template declares it; `markers` begin the
    calls wherever they appear, `openers` only at the start of the output (after blanks); `read` reads them
    from there."""

    name: str
    declared: Callable[[str], bool]
    read: Reader
    markers: tuple[str, ...] = ()
    openers: tuple[str, ...] = ()
    # Where an output must be calls or an answer (auto beside an output format): the calls as a Lark rule
    # body (llguidance's syntax) over `call`, one call object with its arguments under `arguments_key`, or
    # an array of them where `calls_array`; `parallel`: more than one call allowed.
    calls_rule: Callable[[bool], str] = lambda parallel: "call"
    arguments_key: str = "arguments"
    calls_array: bool = False

    def split(self, text: str, checked: int = 0) -> tuple[int, bool]:
        """Where the calls begin in the output so far (True), or how much of it is content for sure (False):
        the rest may still begin them. `checked`: the length already found to be content."""
        if checked == 0 and self.openers:
            rest = text.lstrip()
            if any(rest.startswith(opener) for opener in self.openers):
                return len(text) - len(rest), True
            if any(opener.startswith(rest) for opener in self.openers):  # blanks, or an opener's start
                return 0, False
        found = [i for i in (text.find(marker, checked) for marker in self.markers) if i >= 0]
        if found:
            return min(found), True
        return len(text) - max((_prefix_tail(text, marker) for marker in self.markers), default=0), False


def _prefix_tail(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that begins `marker` (and is shorter than it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _call(value: Any, names: Sequence[str], name: str | None = None) -> ToolCall | None:
    """`{"name", "arguments" | "parameters"}` (or, with `name` given, the arguments themselves) as a call of
    a declared function; None when it is not one."""
    if name is not None:
        value = {"name": name, "arguments": value}
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        return ToolCall(value["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str, separator: str = "") -> list[Any] | None:
    """The JSON values `text` consists of (blanks around them; `separator` between them, when given); None
    when it holds anything else."""
    values: list[Any] = []
    position = 0
    while True:
        position = len(text) - len(text[position:].lstrip())
        if position == len(text):
            return values or None
        if values and separator:
            if not text.startswith(separator, position):
                return None
            position = len(text) - len(text[position + len(separator) :].lstrip())
        try:
            value, position = _decoder.raw_decode(text, position)
        except ValueError:
            return None
        values.append(value)


def _one_value(text: str) -> Any:
    """The one JSON value `text` consists of (blanks around it); None when it is not one."""
    values = _json_values(text)
    return values[0] if values is not None and len(values) == 1 else None


def _all_calls(values: Sequence[Any] | None, names: Sequence[str]) -> list[ToolCall] | None:
    """Every value as a call, or None when one is not (the output is then content)."""
    calls = []
    for value in values or ():
        call = _call(value, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


# --- the formats ------------------------------------------------------------------------------------------


_HERMES_BLOCK = re.compile(re.escape(HERMES_START) + r"(.*?)" + re.escape(HERMES_END), re.DOTALL)


def _read_hermes(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]] | None:
    calls: list[ToolCall] = []
    content: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _call(_one_value(match.group(1)), names)
        if call is None:  # a block that is no call stays content
            continue
        content.append(text[position : match.start()])
        calls.append(call)
        position = match.end()
    content.append(text[position:])
    return ("".join(content), calls) if calls else None


_MISTRAL_NAME = re.compile(r"\s*([a-zA-Z0-9_-]+)(?:\[ARGS\])?")


def _read_mistral(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]] | None:
    calls: list[ToolCall] = []
    for segment in text.split(MISTRAL_MARKER):
        if not segment.strip():
            continue
        named = _MISTRAL_NAME.match(segment)
        if named is not None:  # v11: name{arguments}
            call = _call(_one_value(segment[named.end() :]), names, named.group(1))
            found = None if call is None else [call]
        else:  # v0.3: a JSON array of calls
            array = _one_value(segment)
            found = _all_calls(array if isinstance(array, list) else None, names)
        if found is None:
            return None
        calls.extend(found)
    return ("", calls) if calls else None


def _read_llama(text: str, names: Sequence[str]) -> tuple[str, list[ToolCall]] | None:
    calls = _all_calls(_json_values(text.lstrip().removeprefix(LLAMA_TAG), separator=";"), names)
    return None if calls is None else ("", calls)


_LLAMA_INSTRUCTION = re.compile(r'"name":\s*function name,\s*"parameters"')

# The blocks' newlines are optional and single: a run of blanks would let a weak model pad to its limit.
_HERMES_BLOCK_RULE = f'"{HERMES_START}" "\\n"? call "\\n"? "{HERMES_END}"'

HERMES = ToolCallFormat(
    "hermes",
    lambda template: HERMES_START in template,
    _read_hermes,
    markers=(HERMES_START,),
    calls_rule=lambda parallel: (
        f'{_HERMES_BLOCK_RULE} ("\\n"? {_HERMES_BLOCK_RULE})*' if parallel else _HERMES_BLOCK_RULE
    ),
)
MISTRAL = ToolCallFormat(
    "mistral",
    lambda template: MISTRAL_MARKER in template,
    _read_mistral,
    markers=(MISTRAL_MARKER,),
    openers=("[",),
    # A special token of Mistral's tokenizers, which the output text leaves out: the array alone is calls.
    calls_rule=lambda parallel: f'"{MISTRAL_MARKER}"? call',
    calls_array=True,
)
LLAMA_JSON = ToolCallFormat(
    "llama3_json",
    lambda template: _LLAMA_INSTRUCTION.search(template) is not None,
    _read_llama,
    openers=(LLAMA_TAG, "{"),
    calls_rule=lambda parallel: 'call (";" call)*' if parallel else "call",
    arguments_key="parameters",
)
FORMATS = (HERMES, MISTRAL, LLAMA_JSON)  # the first one a template declares is its format
DEFAULT_FORMAT = HERMES  # textgen's convention, for a template that declares none


def tool_format(template: str | None) -> ToolCallFormat:
    """The tool-call format a chat template declares (the convention when it declares none)."""
    for candidate in FORMATS:
        if template is not None and candidate.declared(template):
            return candidate
    return DEFAULT_FORMAT


class AutoStream:
    """`auto`'s output as it streams: `feed` returns the content that can go out now; from where the calls
    begin, the rest is held and read by `finish`."""

    def __init__(self, names: Sequence[str], form: ToolCallFormat = DEFAULT_FORMAT) -> None:
        self._names = names
        self._format = form
        self._text = ""
        self._sent = 0  # the length of the text that went out as content
        self._calls_from: int | None = None

    def feed(self, text: str) -> str:
        self._text += text
        if self._calls_from is not None:
            return ""
        safe, began = self._format.split(self._text, self._sent)
        if began:
            self._calls_from = safe
        out, self._sent = self._text[self._sent : safe], safe
        return out

    def finish(self) -> tuple[Content, list[ToolCall]]:
        """What was held: its content (None: none) and the calls in it."""
        held = self._text[self._sent :]
        read = None if self._calls_from is None else self._format.read(held, self._names)
        if read is None:
            return held or None, []
        content, calls = read
        return content or None, calls


def parse_auto(
    text: str, names: Sequence[str], form: ToolCallFormat = DEFAULT_FORMAT
) -> tuple[Content, list[ToolCall]]:
    """A whole output read as `form` says: its content (stripped when it made calls; None: none) and its
    calls of the declared functions."""
    stream = AutoStream(names, form)
    sent = stream.feed(text)
    rest, calls = stream.finish()
    content = sent + (rest or "")
    return (content.strip() if calls else content) or None, calls

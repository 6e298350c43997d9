"""Tool calls in model output: the formats real chat templates teach their models, how to
read calls back out of a reply, and the grammar that forces a call when one is required.

Formats (detected from the chat template's text):
- Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call;
  also what Baton teaches a model whose template cannot show tools.
- Llama 3.x: a JSON object `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`.
- Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": …, "arguments": {…}}`.
- Generic fallback: a reply that is only JSON — one call object, several, or a list.
Reading accepts every format whatever the template, and only names the request offered.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from baton_serve.router.openai_tools import FunctionCall, Tool, ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
LLAMA_MARK = "<|python_tag|>"
MARKERS = (HERMES_OPEN, MISTRAL_MARK, LLAMA_MARK)  # where a reply's tool section may start


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"
    GENERIC = "generic"

    @property
    def arguments_key(self) -> str:
        return "parameters" if self is ToolFormat.LLAMA3 else "arguments"


def detect_format(template_source: str) -> ToolFormat:
    """The call format a chat template teaches (Hermes where it teaches none)."""
    if HERMES_OPEN in template_source:
        return ToolFormat.HERMES
    if MISTRAL_MARK in template_source:
        return ToolFormat.MISTRAL
    if LLAMA_MARK in template_source or '"parameters"' in template_source:
        return ToolFormat.LLAMA3
    if "tools" in template_source:
        return ToolFormat.GENERIC
    return ToolFormat.HERMES


@dataclass(frozen=True)
class ParsedReply:
    content: str
    calls: list[ToolCall]


def parse_tool_calls(text: str, tools: Sequence[Tool], *, parallel: bool = True) -> ParsedReply:
    """The calls in `text` to functions of `tools`, and the text around them. Text that
    looks like a call but is not valid JSON, names another function, or — for a function
    marked `strict` — has arguments its schema rejects, stays content. Without `parallel`,
    only the first call counts (the request allowed one)."""
    by_name = {tool.function.name: tool for tool in tools}
    for parse in (_hermes, _mistral, _llama, _bare_json):
        found = parse(text)
        if found is None:
            continue
        content, objects = found
        calls = [call for obj in objects if (call := _call(obj, by_name)) is not None]
        if calls and len(calls) == len(objects):
            return ParsedReply(content.strip(), calls if parallel else calls[:1])
    return ParsedReply(text, [])


def format_calls(calls: Sequence[ToolCall], fmt: ToolFormat) -> str:
    """Calls written as the model would write them (for templates that cannot show calls)."""
    objects = [
        {"name": c.function.name, fmt.arguments_key: json.loads(c.function.arguments)}
        for c in calls
    ]
    if fmt is ToolFormat.MISTRAL:
        return f"{MISTRAL_MARK}{json.dumps(objects, ensure_ascii=False)}"
    if fmt is ToolFormat.HERMES:
        blocks = (
            f"{HERMES_OPEN}\n{json.dumps(o, ensure_ascii=False)}\n{HERMES_CLOSE}" for o in objects
        )
        return "\n".join(blocks)
    return "\n".join(json.dumps(o, ensure_ascii=False) for o in objects)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- reading -------------------------------------------------------------------------------

Found = tuple[str, list[Any]] | None  # (content around the calls, the call objects)


def _hermes(text: str) -> Found:
    if HERMES_OPEN not in text:
        return None
    objects, content = [], []
    rest = text
    while HERMES_OPEN in rest:
        before, _, after = rest.partition(HERMES_OPEN)
        body, closed, rest = after.partition(HERMES_CLOSE)
        content.append(before)
        value = _json(body)
        if value is None:
            return None
        objects.append(value)
        if not closed:
            rest = ""
    content.append(rest)
    return "".join(content), objects


def _mistral(text: str) -> Found:
    if MISTRAL_MARK not in text:
        return None
    before, _, after = text.partition(MISTRAL_MARK)
    value = _json(after)
    if value is None:
        return None
    return before, value if isinstance(value, list) else [value]


def _llama(text: str) -> Found:
    if LLAMA_MARK not in text:
        return None
    before, _, after = text.partition(LLAMA_MARK)
    objects = [_json(part) for part in after.split(";") if part.strip()]
    if not objects or any(o is None for o in objects):
        return None
    return before, objects


def _bare_json(text: str) -> Found:
    """A reply that is only JSON: a call, a list of calls, `{"tool_calls": [...]}`, or
    several call objects one after another."""
    decoder = json.JSONDecoder()
    objects: list[Any] = []
    position = 0
    stripped = text.strip()
    while position < len(stripped):
        try:
            value, end = decoder.raw_decode(stripped, position)
        except json.JSONDecodeError:
            return None
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
        objects.extend(value if isinstance(value, list) else [value])
        position = end
        while position < len(stripped) and stripped[position] in " \t\r\n;,":
            position += 1
    return ("", objects) if objects else None


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _call(obj: Any, tools: dict[str, Tool]) -> ToolCall | None:
    """A call object in any format's shape (OpenAI's own `function` wrapper too)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    if name not in tools or not isinstance(arguments, dict):
        return None
    function = tools[name].function
    if function.strict and not jsonschema.Draft202012Validator(function.parameters).is_valid(
        arguments
    ):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=text))


# ---- forcing a call ------------------------------------------------------------------------


def call_schema(tools: Sequence[Tool], fmt: ToolFormat) -> dict[str, Any]:
    """The JSON Schema of one call object to any of `tools`, in `fmt`'s shape."""
    key = fmt.arguments_key
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, key: t.function.parameters},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def wrap_call_grammar(call_rules: str, fmt: ToolFormat, *, parallel: bool) -> str:
    """A grammar for a reply that is one call (or, with `parallel`, one or more) in `fmt`,
    from `call_rules`: a GBNF grammar whose `root` is one call object."""
    renamed, count = re.subn(r"^root ::=", "tool-call ::=", call_rules, flags=re.MULTILINE)
    if count != 1 or re.search(r"(?<![\w\"-])root(?![\w\"-])", renamed):
        raise ValueError("the tool's schema refers to its own root; it cannot be forced")
    if fmt is ToolFormat.HERMES:
        item = f'"{HERMES_OPEN}\\n" tool-call "\\n{HERMES_CLOSE}"'
        root = f'{item} ("\\n" {item})*' if parallel else item
    elif fmt is ToolFormat.MISTRAL:
        root = f'"{MISTRAL_MARK}" "[" tool-call ' + (
            '("," " "? tool-call)* "]"' if parallel else '"]"'
        )
    elif fmt is ToolFormat.LLAMA3:
        root = "tool-call"  # Llama 3.x makes one call per turn
    else:
        root = 'tool-call ("\\n" tool-call)*' if parallel else "tool-call"
    return f"root ::= {root}\n{renamed}"

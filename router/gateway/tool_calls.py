"""Tool calls in model output: the formats real chat templates teach their models, how to
read calls back out of a reply, and the grammar that forces a call when one is required.

Formats (detected from the chat template's text):
- Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block per call;
  also what Baton teaches a model whose template cannot show tools.
- Llama 3.x: a JSON object `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`.
- Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": …, "arguments": {…}}`.
- Generic fallback: a reply that is only JSON — one call object, several, or a list.
Reading accepts every format whatever the template, and only names the request offered.
Every complete call is read, also from a reply cut off by `max_tokens`; the markup of a call
that cannot be read is dropped, never returned as content.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from baton_serve.router.gateway.grammar_limits import SCHEMA_TIMEOUT_S
from baton_serve.router.gateway.openai_tools import FunctionCall, Tool, ToolCall
from baton_serve.router.gateway.strict_calls import StrictCalls

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


def parse_tool_calls(
    text: str,
    tools: Sequence[Tool],
    *,
    parallel: bool = True,
    truncated: bool = False,
    strict: StrictCalls | None = None,
) -> ParsedReply:
    """The calls in `text` to functions of `tools`, and the text around them.

    Marked calls (Hermes blocks, `[TOOL_CALLS]`, `<|python_tag|>`): every complete call to
    an offered function is read; the markup of anything else — a call cut off by
    `max_tokens`, invalid JSON, a function not offered, a `strict` function's call that its
    schema rejects (or `strict` did not check in time) — is dropped, never returned as
    content. A reply that is only JSON is read as calls when every value in it is one, and
    is content otherwise; `truncated` (the reply was cut off) lets a trailing incomplete
    value go. Without `parallel`, only the first call counts (the request allowed one)."""
    by_name = {tool.function.name: tool for tool in tools}
    strict = strict or StrictCalls(SCHEMA_TIMEOUT_S)
    for read in (_hermes, _mistral, _llama):
        found = read(text)
        if found is not None:
            content, objects = found
            calls = [c for obj in objects if (c := _call(obj, by_name, strict)) is not None]
            return ParsedReply(content.strip(), calls if parallel else calls[:1])
    objects = _bare_json(text, truncated=truncated)
    calls = [call for obj in objects if (call := _call(obj, by_name, strict)) is not None]
    if calls and len(calls) == len(objects):
        return ParsedReply("", calls if parallel else calls[:1])
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

Found = tuple[str, list[Any]] | None  # (content around the markup, the call objects in it)


def _hermes(text: str) -> Found:
    if HERMES_OPEN not in text:
        return None
    objects, content = [], []
    rest = text
    while HERMES_OPEN in rest:
        before, _, after = rest.partition(HERMES_OPEN)
        body, _, rest = after.partition(HERMES_CLOSE)  # unclosed: the rest of the reply
        content.append(before)
        objects.append(_json(body))
    content.append(rest)
    return "".join(content), objects


def _mistral(text: str) -> Found:
    if MISTRAL_MARK not in text:
        return None
    before, _, after = text.partition(MISTRAL_MARK)
    body = after.lstrip()
    values, _ = _json_values(body[1:] if body.startswith("[") else body)
    return before, values


def _llama(text: str) -> Found:
    if LLAMA_MARK not in text:
        return None
    before, _, after = text.partition(LLAMA_MARK)
    values, _ = _json_values(after)
    return before, values


def _bare_json(text: str, *, truncated: bool) -> list[Any]:
    """The call objects of a reply that is only JSON: a call, a list of calls,
    `{"tool_calls": [...]}`, or several call objects one after another (none if the reply
    is anything else)."""
    stripped = text.strip()
    values, stopped = _json_values(stripped)
    if stopped < len(stripped) and not truncated:
        return []
    objects: list[Any] = []
    for value in values:
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            value = value["tool_calls"]
        objects.extend(value if isinstance(value, list) else [value])
    return objects


def _json_values(text: str) -> tuple[list[Any], int]:
    """The JSON values that `text` starts with, separated by whitespace, `,` or `;`, up to
    the first that does not decode (a call cut off, or what follows the calls); and where
    reading stopped."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    position = _skip_separators(text, 0)
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        values.append(value)
        position = _skip_separators(text, position)
    return values, position


def _skip_separators(text: str, position: int) -> int:
    while position < len(text) and text[position] in " \t\r\n;,":
        position += 1
    return position


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _call(obj: Any, tools: dict[str, Tool], strict: StrictCalls) -> ToolCall | None:
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
    if function.strict and not strict.match(function.parameters, arguments):
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
    from `call_rules`: a GBNF grammar whose `root` is one call object.

    The reply can end only where `root` is complete: llama.cpp's grammar sampler allows
    end-of-generation there and nowhere else (and nothing but it once `root` can go no
    further). So one call ends the reply; with `parallel`, the model may end after any
    call — also after the newline that would start another, the token models trained on
    Hermes calls pick after `</tool_call>`."""
    renamed, count = re.subn(r"^root ::=", "tool-call ::=", call_rules, flags=re.MULTILINE)
    if count != 1 or re.search(r"(?<![\w\"-])root(?![\w\"-])", renamed):
        raise ValueError("the tool's schema refers to its own root; it cannot be forced")
    if fmt is ToolFormat.HERMES:
        item = f'"{HERMES_OPEN}\\n" tool-call "\\n{HERMES_CLOSE}"'
        root = f'{item} ("\\n" {item})* "\\n"?' if parallel else item
    elif fmt is ToolFormat.MISTRAL:
        root = f'"{MISTRAL_MARK}" "[" tool-call ' + (
            '("," " "? tool-call)* "]"' if parallel else '"]"'
        )
    elif fmt is ToolFormat.LLAMA3:
        root = "tool-call"  # Llama 3.x makes one call per turn
    else:
        root = 'tool-call ("\\n" tool-call)* "\\n"?' if parallel else "tool-call"
    return f"root ::= {root}\n{renamed}"

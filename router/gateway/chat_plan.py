"""How one chat request is served: the messages and template variables its prompt is
rendered from, the grammar that constrains its reply, and how the reply is read back.

Tools go through the model's own chat template (its `tools` variable). A template that
cannot show tools gets them described in the system message, in the Hermes format; a
template that cannot show earlier calls gets them written into the assistant's content, and
tool results as user messages — so no part of the conversation is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_serve.cache_store.wire.prompt_types import ChatMessage
from baton_serve.replicas.engine.prompt import ChatTemplate, PromptError
from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.errors import invalid_request
from baton_serve.router.gateway.openai_tools import FunctionCall, Tool, ToolCall
from baton_serve.router.gateway.reply_parser import THINK_CLOSE, ReplyParser
from baton_serve.router.gateway.tool_calls import (
    ToolFormat,
    call_schema,
    detect_format,
    format_calls,
    wrap_call_grammar,
)

RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)
_PROBE = "baton_probe_function"


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template can show of tool use, found by rendering probes."""

    format: ToolFormat
    renders_tools: bool
    renders_calls: bool
    reasoning: bool  # it marks reasoning with <think>…</think>

    @classmethod
    def probe(cls, template: ChatTemplate) -> TemplateTools:
        tool = {"type": "function", "function": {"name": _PROBE, "parameters": {}}}
        call = ToolCall(
            id="call_000000000probe", function=FunctionCall(name=_PROBE, arguments="{}")
        )
        user = ChatMessage(role="user", content="hi")
        asked = ChatMessage(role="assistant", content=None, tool_calls=[call.template_view()])
        answered = ChatMessage(role="tool", content="ok", tool_call_id=call.id)
        return cls(
            format=detect_format(template.source),
            renders_tools=_renders(template, [user], {"tools": [tool]}),
            renders_calls=_renders(template, [user, asked, answered], {}),
            reasoning=THINK_CLOSE in template.source,
        )


def _renders(template: ChatTemplate, messages: list[ChatMessage], extras: dict) -> bool:
    try:
        return _PROBE in template.render(messages, add_generation_prompt=True, extras=extras)
    except PromptError:
        return False


@dataclass(frozen=True)
class ChatPlan:
    messages: list[ChatMessage]
    extras: dict[str, Any]
    tools: list[Tool] = field(default_factory=list)  # calls to read from the reply
    parallel: bool = True  # more than one call may be read
    grammar: str | None = None

    def reply_parser(self, caps: TemplateTools, in_reasoning: bool) -> ReplyParser:
        return ReplyParser(
            reasoning=caps.reasoning, in_reasoning=in_reasoning, tools=bool(self.tools)
        )


def plan_chat(
    body: api.ChatCompletionRequest,
    caps: TemplateTools,
    schema_grammar: Callable[[dict[str, Any]], str],
) -> ChatPlan:
    """The plan for `body`, or a 400 naming what cannot be served.

    `schema_grammar` turns a JSON Schema into a GBNF grammar (raising a 400 for a schema it
    cannot enforce)."""
    extras = _template_variables(body.chat_template_kwargs)
    tools = body.tools or []
    choice = body.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise invalid_request("tool_choice needs tools.", param="tool_choice")
    forced = _forced_tools(tools, choice)
    if caps.renders_calls:
        messages = [_chat_message(m) for m in body.messages]
    else:
        messages = [_spelled_out(m, caps.format) for m in body.messages]
    if tools and caps.renders_tools:
        extras["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
    elif tools:
        messages = _with_tools_described(messages, tools)
    fmt = caps.format if caps.renders_tools else ToolFormat.HERMES
    named = not isinstance(choice, str)
    parallel = body.parallel_tool_calls and not named  # a named function is called once
    grammar = None
    if forced:
        rules = schema_grammar(call_schema(forced, fmt))
        try:
            grammar = wrap_call_grammar(rules, fmt, parallel=parallel)
        except ValueError as exc:
            raise invalid_request(str(exc), param="tools") from None
    readable = tools if choice != "none" else []
    return ChatPlan(messages, extras, tools=readable, grammar=grammar, parallel=parallel)


def _template_variables(kwargs: dict[str, Any]) -> dict[str, Any]:
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(kwargs))
    if reserved:
        raise invalid_request(
            f"chat_template_kwargs may not set {', '.join(reserved)} (Baton sets it).",
            param="chat_template_kwargs",
        )
    return dict(kwargs)


def _forced_tools(tools: Sequence[Tool], choice: api.ToolChoice) -> list[Tool]:
    """The tools a reply must call one of (none unless the choice forces a call)."""
    if choice == "required":
        return list(tools)
    if isinstance(choice, str):
        return []
    named = [t for t in tools if t.function.name == choice.function.name]
    if not named:
        raise invalid_request(
            f"tool_choice names function {choice.function.name!r}, which is not in tools.",
            param="tool_choice",
        )
    return named


def _chat_message(message: api.InputMessage) -> ChatMessage:
    return ChatMessage(
        role=message.role,
        content=message.text,
        name=message.name,
        tool_calls=[c.template_view() for c in message.tool_calls] if message.tool_calls else None,
        tool_call_id=message.tool_call_id,
        reasoning_content=message.reasoning_content,
    )


def _spelled_out(message: api.InputMessage, fmt: ToolFormat) -> ChatMessage:
    """For a template that cannot show calls: calls written into the assistant's content,
    a tool result as a user message."""
    if message.tool_calls:
        text = "\n".join(filter(None, [message.text, format_calls(message.tool_calls, fmt)]))
        return ChatMessage(role="assistant", content=text)
    if message.role == "tool":
        return ChatMessage(
            role="user", content=f"<tool_response>\n{message.text}\n</tool_response>"
        )
    return _chat_message(message)


def _with_tools_described(messages: list[ChatMessage], tools: Sequence[Tool]) -> list[ChatMessage]:
    signatures = "\n".join(
        json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools
    )
    text = (
        "You may call one or more functions to assist with the user query. The function "
        f"signatures are within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\n"
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if messages and messages[0].role == "system":
        first = messages[0]
        system = ChatMessage(role="system", content=f"{first.content}\n\n{text}")
        return [system, *messages[1:]]
    return [ChatMessage(role="system", content=text), *messages]

"""The grammar a request gives its reply, built off the event loop within the server's
`GrammarLimits`: a forced tool call's (made while a chat with tools is planned),
`response_format`'s, or a guided field's (`guided_json`, `guided_choice`, `json_schema`,
`grammar`). At most one of them; each is built on the gateway's worker threads and refused
with a 400 naming its field if it takes longer than the limits allow. A strict function's
schema is compiled there too, so that the reply's readers can check its calls
(`strict_calls`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.chat_plan import ChatPlan, TemplateTools, plan_chat
from baton_serve.router.gateway.chunks import ReplyReader
from baton_serve.router.gateway.errors import invalid_request
from baton_serve.router.gateway.gateway_work import PromptThreads
from baton_serve.router.gateway.grammar_limits import GrammarLimits
from baton_serve.router.gateway.guided import check_grammar, guided_field, guided_grammar
from baton_serve.router.gateway.reply_parser import ReplyParser
from baton_serve.router.gateway.strict_calls import StrictCalls, strict_problem
from baton_serve.router.gateway.structured_output import (
    JsonSchemaFormat,
    ResponseFormat,
    SchemaNotEnforceable,
    TextFormat,
    response_grammar,
    schema_grammar,
)

T = TypeVar("T")


class ReplyGrammars:
    """Plans chats and builds their grammars, and completions', for one gateway."""

    def __init__(self, limits: GrammarLimits, threads: PromptThreads) -> None:
        self._limits = limits
        self._threads = threads

    def reader(self, parser: ReplyParser, plan: ChatPlan, *, reasoning: bool) -> ReplyReader:
        """A reader of one reply to a chat planned as `plan`, its strict calls checked
        within the time the limits allow. Reading calls takes a while: run its `finish`
        off the event loop."""
        strict = StrictCalls(self._limits.timeout_s)
        return ReplyReader(
            parser, plan.tools, parallel=plan.parallel, reasoning=reasoning, strict=strict
        )

    async def plan(self, body: api.ChatCompletionRequest, caps: TemplateTools) -> ChatPlan:
        """The chat's plan; with tools, made off the event loop (a forced call's grammar
        is built, strict schemas compiled)."""
        if not body.tools:
            return plan_chat(body, caps, self._call_grammar)
        return await self._build("tools", self._plan_with_tools, body, caps)

    async def chat(self, body: api.ChatCompletionRequest, plan: ChatPlan) -> str | None:
        """The grammar of `response_format` or a guided field, or else of the plan's forced
        call (None: free text)."""
        guide = guided_field(body)
        formatted = not isinstance(body.response_format, TextFormat | None)
        if formatted and guide is not None:
            raise invalid_request(
                "send response_format or a guided_* / json_schema / grammar field, not both.",
                param="response_format",
            )
        if (formatted or guide is not None) and plan.tools:
            raise invalid_request(
                "response_format (or a guided_* / json_schema / grammar field) cannot be "
                'combined with tools the model may call; send tool_choice "none", or no format.',
                param="response_format",
            )
        if formatted:
            return await self._response_format(body.response_format)
        if guide is not None:
            return await self.guided(body)
        return plan.grammar

    async def guided(self, body: api.ChatCompletionRequest | api.CompletionRequest) -> str | None:
        """The grammar of the guided field sent, if any."""
        guide = guided_field(body)
        if guide is None:
            return None
        return await self._build(guide, guided_grammar, body, self._limits)

    async def _response_format(self, response_format: ResponseFormat | None) -> str | None:
        if not isinstance(response_format, JsonSchemaFormat):  # a constant grammar, or none
            return response_grammar(response_format)
        return await self._build("response_format", self._response_grammar, response_format)

    def _response_grammar(self, response_format: JsonSchemaFormat) -> str | None:
        try:
            return response_grammar(response_format, self._limits)
        except SchemaNotEnforceable as exc:
            raise invalid_request(str(exc), param="response_format") from None

    def _plan_with_tools(self, body: api.ChatCompletionRequest, caps: TemplateTools) -> ChatPlan:
        for i, tool in enumerate(body.tools or ()):
            schema = tool.function.parameters
            if tool.function.strict and (problem := strict_problem(schema, self._limits.max_chars)):
                raise invalid_request(f"tools[{i}].function.parameters: {problem}.", param="tools")
        plan = plan_chat(body, caps, self._call_grammar)
        if plan.grammar is not None:
            check_grammar(plan.grammar, "tools", self._limits)
        return plan

    def _call_grammar(self, schema: dict[str, Any]) -> str:
        """A grammar for a tool call's JSON (its name first)."""
        try:
            order = ["name", "arguments", "parameters"]
            return schema_grammar(schema, prop_order=order, limits=self._limits)
        except SchemaNotEnforceable as exc:
            raise invalid_request(f"A tool's parameters: {exc}", param="tools") from None

    async def _build(self, param: str, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, which builds what field `param` asks for, off the event loop; a
        400 naming `param` if it takes longer than the limits allow."""
        try:
            return await self._threads.run_within(self._limits.timeout_s, fn, *args)
        except TimeoutError:
            raise invalid_request(
                f"{param}: building its grammar took more than {self._limits.timeout_s:g} s "
                "(this server's schema_timeout_s setting).",
                param=param,
            ) from None

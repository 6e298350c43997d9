"""Replies in OpenAI's shapes: a chat reply read into reasoning, content and tool calls
(whole, or as stream chunks), and text-completion stream chunks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pydantic import BaseModel

from baton_serve.cache_store.wire.protocol import Completion
from baton_serve.cache_store.wire.sampling_params import TokenLogprob
from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.event_stream import finish_reason
from baton_serve.router.gateway.logprobs import LogprobFormat
from baton_serve.router.gateway.openai_tools import Tool, ToolCall, call_deltas
from baton_serve.router.gateway.reply_parser import Part, Piece, ReplyParser
from baton_serve.router.gateway.strict_calls import StrictCalls
from baton_serve.router.gateway.tool_calls import parse_tool_calls


@dataclass(frozen=True)
class ReplyIds:
    """What every object of one response carries."""

    id: str
    created: int
    model: str


class ReplyReader:
    """Reads one chat reply's text: reasoning (left out unless `reasoning`), content, and
    calls to the offered tools (a strict function's checked by `strict`). `finish` may take
    a while with tools (it reads and checks the calls): callers run it off the event loop."""

    def __init__(
        self,
        parser: ReplyParser,
        tools: Sequence[Tool],
        *,
        parallel: bool,
        reasoning: bool = True,
        strict: StrictCalls | None = None,
    ) -> None:
        self._parser = parser
        self._tools = tools
        self._parallel = parallel
        self._reasoning = reasoning
        self._strict = strict

    def feed(self, text: str) -> list[Piece]:
        return self._shown(self._parser.feed(text))

    def _shown(self, pieces: list[Piece]) -> list[Piece]:
        return [p for p in pieces if self._reasoning or p.part is not Part.REASONING]

    def finish(self, *, truncated: bool) -> tuple[list[Piece], list[ToolCall]]:
        """The last pieces, and the calls (`truncated`: the reply was cut at max_tokens)."""
        pieces = self._shown(self._parser.finish())
        section = self._parser.tool_text
        if not section:
            return pieces, []
        parsed = parse_tool_calls(
            section, self._tools, parallel=self._parallel, truncated=truncated, strict=self._strict
        )
        if parsed.content:
            pieces.append(Piece(Part.CONTENT, parsed.content))
        return pieces, parsed.calls

    def message(self, text: str, *, truncated: bool) -> tuple[api.AssistantMessage, bool]:
        """The whole reply as a message, and whether it calls tools."""
        pieces = self.feed(text)
        rest, calls = self.finish(truncated=truncated)
        pieces += rest
        content = "".join(p.text for p in pieces if p.part is Part.CONTENT)
        reasoning = "".join(p.text for p in pieces if p.part is Part.REASONING)
        message = api.AssistantMessage(
            content=content if content or not calls else None,
            reasoning_content=reasoning or None,
            tool_calls=calls or None,
        )
        return message, bool(calls)


def chat_choice(done: Completion, reader: ReplyReader, logprobs: LogprobFormat) -> api.ChatChoice:
    message, called = reader.message(done.text, truncated=done.finish_reason == "length")
    return api.ChatChoice(
        index=done.index,
        message=message,
        finish_reason=_chat_finish_reason(done, called),
        logprobs=None if done.logprobs is None else logprobs.chat(done.logprobs),
    )


class ChatChunks:
    """A streamed chat reply: reasoning and content deltas as they come, tool calls at the
    end; each choice (n > 1) read by its own `ReplyReader` from `new_reader`."""

    def __init__(
        self, ids: ReplyIds, new_reader: Callable[[], ReplyReader], logprobs: LogprobFormat
    ) -> None:
        self._ids = ids
        self._readers: dict[int, ReplyReader] = defaultdict(new_reader)
        self._logprobs = logprobs

    def opening(self) -> list[BaseModel]:
        return [self._chunk(api.ChatDelta(role="assistant", content=""))]

    def text(
        self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0
    ) -> list[BaseModel]:
        formatted = self._logprobs.chat(logprobs) if logprobs else None
        pieces = self._readers[index].feed(text)
        chunks = [self._chunk(_delta(piece), index=index) for piece in pieces]
        if formatted is not None:
            if not chunks:  # the text is held back (a marker may be starting): keep the order
                chunks = [self._chunk(api.ChatDelta(content=""), index=index)]
            chunks[0].choices[0].logprobs = formatted
        return chunks

    def finish(self, done: Completion) -> list[BaseModel]:
        chunks = []
        for choice in done.choices:
            truncated = choice.finish_reason == "length"
            pieces, calls = self._readers[choice.index].finish(truncated=truncated)
            chunks += [self._chunk(_delta(piece), index=choice.index) for piece in pieces]
            for i, call in enumerate(calls):
                deltas = call_deltas(i, call)
                chunks += [
                    self._chunk(api.ChatDelta(tool_calls=[d]), index=choice.index) for d in deltas
                ]
            reason = _chat_finish_reason(choice, bool(calls))
            chunks.append(self._chunk(api.ChatDelta(), reason, index=choice.index))
        return chunks

    def usage(self, usage: api.Usage) -> BaseModel:
        return api.ChatCompletionChunk(**asdict(self._ids), choices=[], usage=usage)

    def _chunk(
        self, delta: api.ChatDelta, reason: api.FinishReason | None = None, *, index: int = 0
    ) -> api.ChatCompletionChunk:
        choice = api.ChatChunkChoice(index=index, delta=delta, finish_reason=reason)
        return api.ChatCompletionChunk(**asdict(self._ids), choices=[choice])


def _chat_finish_reason(done: Completion, called: bool) -> api.FinishReason:
    """The reason: `tool_calls` when the reply ended on its own after calls; `length` when
    max_tokens cut it, calls or not (its complete calls are still returned)."""
    reason = finish_reason(done)
    return "tool_calls" if called and reason != "length" else reason


def _delta(piece: Piece) -> api.ChatDelta:
    if piece.part is Part.REASONING:
        return api.ChatDelta(reasoning_content=piece.text)
    return api.ChatDelta(content=piece.text)


class TextChunks:
    """A streamed text completion; with `echo`, the prompt's text is the first chunk of each
    of the `n` choices."""

    def __init__(
        self, ids: ReplyIds, logprobs: LogprobFormat, *, echo: str = "", n: int = 1
    ) -> None:
        self._ids = ids
        self._logprobs = logprobs
        self._echo = echo
        self._n = n
        self._sent: dict[int, int] = defaultdict(int)  # characters sent, by choice

    def opening(self) -> list[BaseModel]:
        if not self._echo:
            return []
        return [self._chunk(api.CompletionChoice(index=i, text=self._echo)) for i in range(self._n)]

    def text(
        self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0
    ) -> list[BaseModel]:
        offset = self._sent[index]
        formatted = self._logprobs.completion(logprobs, offset) if logprobs else None
        self._sent[index] += len(text)
        return [self._chunk(api.CompletionChoice(index=index, text=text, logprobs=formatted))]

    def finish(self, done: Completion) -> list[BaseModel]:
        return [
            self._chunk(
                api.CompletionChoice(index=c.index, text="", finish_reason=finish_reason(c))
            )
            for c in done.choices
        ]

    def usage(self, usage: api.Usage) -> BaseModel:
        return api.TextCompletion(**asdict(self._ids), choices=[], usage=usage)

    def _chunk(self, choice: api.CompletionChoice) -> BaseModel:
        return api.TextCompletion(**asdict(self._ids), choices=[choice])

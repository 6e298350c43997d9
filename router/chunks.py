"""Replies in OpenAI's shapes: a chat reply read into reasoning, content and tool calls
(whole, or as stream chunks), and text-completion stream chunks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pydantic import BaseModel

from baton_serve.replicas.engine.protocol import Completion
from baton_serve.replicas.engine.sampling import TokenLogprob
from baton_serve.router import openai_types as api
from baton_serve.router.event_stream import finish_reason
from baton_serve.router.logprobs import LogprobFormat
from baton_serve.router.openai_tools import Tool, ToolCall, call_deltas
from baton_serve.router.reply_parser import Part, Piece, ReplyParser
from baton_serve.router.tool_calls import parse_tool_calls


@dataclass(frozen=True)
class ReplyIds:
    """What every object of one response carries."""

    id: str
    created: int
    model: str


class ReplyReader:
    """Reads one chat reply's text: reasoning, content, and calls to the offered tools."""

    def __init__(self, parser: ReplyParser, tools: Sequence[Tool], *, parallel: bool) -> None:
        self._parser = parser
        self._tools = tools
        self._parallel = parallel

    def feed(self, text: str) -> list[Piece]:
        return self._parser.feed(text)

    def finish(self) -> tuple[list[Piece], list[ToolCall]]:
        """The last pieces, and the calls; a tool section that holds no valid call is content."""
        pieces = self._parser.finish()
        section = self._parser.tool_text
        if not section:
            return pieces, []
        parsed = parse_tool_calls(section, self._tools, parallel=self._parallel)
        if parsed.content:
            pieces.append(Piece(Part.CONTENT, parsed.content))
        return pieces, parsed.calls

    def message(self, text: str) -> tuple[api.AssistantMessage, bool]:
        """The whole reply as a message, and whether it calls tools."""
        pieces = self.feed(text)
        rest, calls = self.finish()
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
    message, called = reader.message(done.text)
    return api.ChatChoice(
        index=done.index,
        message=message,
        finish_reason="tool_calls" if called else finish_reason(done),
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
            pieces, calls = self._readers[choice.index].finish()
            chunks += [self._chunk(_delta(piece), index=choice.index) for piece in pieces]
            for i, call in enumerate(calls):
                deltas = call_deltas(i, call)
                chunks += [
                    self._chunk(api.ChatDelta(tool_calls=[d]), index=choice.index) for d in deltas
                ]
            reason = "tool_calls" if calls else finish_reason(choice)
            chunks.append(self._chunk(api.ChatDelta(), reason, index=choice.index))
        return chunks

    def usage(self, usage: api.Usage) -> BaseModel:
        return api.ChatCompletionChunk(**asdict(self._ids), choices=[], usage=usage)

    def _chunk(
        self, delta: api.ChatDelta, reason: api.FinishReason | None = None, *, index: int = 0
    ) -> api.ChatCompletionChunk:
        choice = api.ChatChunkChoice(index=index, delta=delta, finish_reason=reason)
        return api.ChatCompletionChunk(**asdict(self._ids), choices=[choice])


def _delta(piece: Piece) -> api.ChatDelta:
    if piece.part is Part.REASONING:
        return api.ChatDelta(reasoning_content=piece.text)
    return api.ChatDelta(content=piece.text)


class TextChunks:
    """A streamed text completion."""

    def __init__(self, ids: ReplyIds, logprobs: LogprobFormat) -> None:
        self._ids = ids
        self._logprobs = logprobs
        self._sent: dict[int, int] = defaultdict(int)  # characters sent, by choice

    def opening(self) -> list[BaseModel]:
        return []

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

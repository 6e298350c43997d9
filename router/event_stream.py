"""OpenAI server-sent events from a replica's stream: headers once the replica admits the
request, a comment ping while nothing comes (a long prefill, a queue), the chunks, `[DONE]`."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from baton_serve.replicas.engine.protocol import Admitted, Completion, TokenEvent
from baton_serve.replicas.engine.sampling import TokenLogprob
from baton_serve.router import openai_types as api
from baton_serve.router.errors import from_exception

ReplicaStream = AsyncGenerator[Admitted | TokenEvent | Completion, None]
_PING = object()  # no item in time: an SSE comment keeps proxies from timing out


class ChunkFormat(Protocol):
    """The chunks of one endpoint's stream (chat or text completions)."""

    def opening(self) -> list[BaseModel]: ...

    def text(
        self, text: str, logprobs: Sequence[TokenLogprob] = (), index: int = 0
    ) -> list[BaseModel]:
        """Chunks for the next piece of choice `index`'s text (none while it is held back)."""
        ...

    def finish(self, done: Completion) -> list[BaseModel]: ...

    def usage(self, usage: api.Usage) -> BaseModel: ...


def finish_reason(done: Completion) -> api.FinishReason:
    """OpenAI's finish reason for a completion ("cancelled" never reaches a client)."""
    return "length" if done.finish_reason == "length" else "stop"


def usage_of(done: Sequence[Completion]) -> api.Usage:
    """The usage of one or several completions (n prompts of one request), summed; a
    prompt's choices share its prompt tokens."""
    prompt = sum(d.usage.prompt_tokens for d in done)
    completion = sum(c.usage.completion_tokens for d in done for c in d.choices)
    cached = sum(d.usage.cached_tokens for d in done)
    return api.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=api.PromptTokensDetails(cached_tokens=cached),
    )


_DONE = "data: [DONE]\n\n"


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def event_stream(
    items: ReplicaStream, chunks: ChunkFormat, include_usage: bool, ping_s: float
) -> _EventStream:
    """Start the request. A failure before the replica admits it is answered with an HTTP
    status; once admitted, the response's headers go out at once."""
    first = await anext(items)
    return _EventStream(_events(_pinged(items, first, ping_s), chunks, include_usage))


async def _events(
    items: AsyncGenerator[object, None], chunks: ChunkFormat, include_usage: bool
) -> AsyncGenerator[str, None]:
    """OpenAI's chunks, then `[DONE]`; a failure mid-stream is sent as an error event."""
    logprobs: dict[int, list[TokenLogprob]] = {}  # by choice: tokens whose text is not sent
    try:
        for chunk in chunks.opening():
            yield _sse(chunk.model_dump_json())
        async for item in items:
            if item is _PING:
                yield ": ping\n\n"
            elif isinstance(item, TokenEvent):
                pending = logprobs.setdefault(item.index, [])
                if item.logprob is not None:
                    pending.append(item.logprob)
                if item.text:
                    for chunk in chunks.text(item.text, pending, item.index):
                        yield _sse(chunk.model_dump_json())
                    pending.clear()
            elif isinstance(item, Completion):
                for index, pending in logprobs.items():  # tokens that showed no text
                    for chunk in chunks.text("", pending, index) if pending else []:
                        yield _sse(chunk.model_dump_json())
                for chunk in chunks.finish(item):
                    yield _sse(chunk.model_dump_json())
                if include_usage:
                    yield _sse(chunks.usage(usage_of([item])).model_dump_json())
                break
        else:
            raise RuntimeError("the replica's stream ended without a completion")
    except Exception as exc:
        yield _sse(json.dumps(from_exception(exc).body()))
    finally:
        await items.aclose()
    yield _DONE


async def _pinged(
    items: ReplicaStream, first: object, ping_s: float
) -> AsyncGenerator[object, None]:
    """`first`, then `items`, with `_PING` whenever `ping_s` passes without one (a long
    prefill or a queue); closing it closes `items`."""
    yield first
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(anext(items))
            while ping_s > 0:
                done, _ = await asyncio.wait({pending}, timeout=ping_s)
                if done:
                    break
                yield _PING
            try:
                item = await pending
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await items.aclose()


class _EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends: a client that
    goes away mid-stream cancels its generation."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()

"""OpenAI server-sent events from a replica's stream: headers once the replica admits the
request, a comment ping while nothing comes (a long prefill, a queue), the chunks, `[DONE]`.

With `include_usage` a last chunk carries the usage; with vLLM's `continuous_usage_stats`
too, every chunk carries the usage so far of its choice (the opening chunk waits for the
first token, when the replica has said how much of the prompt it had cached)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio.to_thread
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from baton_serve.cache_store.wire.protocol import Admitted, Completion, TokenEvent
from baton_serve.cache_store.wire.sampling_params import TokenLogprob
from baton_serve.router.gateway import openai_types as api
from baton_serve.router.gateway.errors import from_exception

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

    def finish(self, done: Completion) -> list[BaseModel]:
        """The last chunks; run off the event loop (a chat reads its tool calls here)."""
        ...

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


@dataclass(frozen=True)
class UsageChunks:
    """Which chunks carry the usage: the last one (`final`), or every one (`continuous`)."""

    final: bool = False
    continuous: bool = False
    prompt_tokens: int = 0


class _UsageSoFar:
    """Each choice's tokens so far, as the replica reports them, for continuous usage."""

    def __init__(self, prompt_tokens: int) -> None:
        self._prompt = prompt_tokens
        self._cached = 0
        self._generated: dict[int, int] = {}

    def cached(self, item: TokenEvent | Completion) -> None:
        """Learn the cached prompt tokens (known once the replica placed the request)."""
        self._cached = (
            item.cached_tokens if isinstance(item, TokenEvent) else item.usage.cached_tokens
        )

    def counted(self, item: TokenEvent | Completion) -> None:
        """Learn the tokens generated so far (all of them, from a `Completion`)."""
        if isinstance(item, TokenEvent):
            self._generated[item.index] = item.completion_tokens
        else:
            self._prompt = item.usage.prompt_tokens
            self._generated.update((c.index, c.usage.completion_tokens) for c in item.choices)

    def stamp(self, chunk: BaseModel) -> BaseModel:
        """`chunk` carrying the usage so far of its choice."""
        choices = getattr(chunk, "choices", None) or []
        completion = self._generated.get(choices[0].index if choices else 0, 0)
        usage = api.Usage(
            prompt_tokens=self._prompt,
            completion_tokens=completion,
            total_tokens=self._prompt + completion,
            prompt_tokens_details=api.PromptTokensDetails(cached_tokens=self._cached),
        )
        return chunk.model_copy(update={"usage": usage})


_DONE = "data: [DONE]\n\n"


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def event_stream(
    items: ReplicaStream, chunks: ChunkFormat, usage: UsageChunks, ping_s: float
) -> _EventStream:
    """Start the request. A failure before the replica admits it is answered with an HTTP
    status; once admitted, the response's headers go out at once."""
    first = await anext(items)
    return _EventStream(_events(_pinged(items, first, ping_s), chunks, usage))


async def _events(
    items: AsyncGenerator[object, None], chunks: ChunkFormat, usage: UsageChunks
) -> AsyncGenerator[str, None]:
    """OpenAI's chunks, then `[DONE]`; a failure mid-stream is sent as an error event."""
    logprobs: dict[int, list[TokenLogprob]] = {}  # by choice: tokens whose text is not sent
    so_far = _UsageSoFar(usage.prompt_tokens) if usage.continuous else None

    def sse(chunk: BaseModel) -> str:
        return _sse((so_far.stamp(chunk) if so_far else chunk).model_dump_json())

    opening = chunks.opening()
    try:
        if so_far is None:  # without usage on every chunk the opening needs no wait
            for chunk in opening:
                yield sse(chunk)
            opening = []
        async for item in items:
            if item is _PING:
                yield ": ping\n\n"
                continue
            if so_far is not None and isinstance(item, TokenEvent | Completion):
                so_far.cached(item)
                for chunk in opening:  # before any token: completion_tokens 0
                    yield sse(chunk)
                opening = []
                so_far.counted(item)
            if isinstance(item, TokenEvent):
                pending = logprobs.setdefault(item.index, [])
                if item.logprob is not None:
                    pending.append(item.logprob)
                if item.text:
                    for chunk in chunks.text(item.text, pending, item.index):
                        yield sse(chunk)
                    pending.clear()
            elif isinstance(item, Completion):
                for index, pending in logprobs.items():  # tokens that showed no text
                    for chunk in chunks.text("", pending, index) if pending else []:
                        yield sse(chunk)
                for chunk in await anyio.to_thread.run_sync(chunks.finish, item):
                    yield sse(chunk)
                if usage.final:
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

"""The routing benchmark's scenarios, as a client plays them against one deployed app.

- **chat**: a conversation opening with a document of its own under the shared system
  prompt, growing turn by turn, the previous reply sent back after a seeded pause;
- **burst**: sessions arriving at once that share a system prompt nobody holds yet;
- **agent**: agent loops with no pause at all — the next request the instant the previous
  answer arrives, a tool result appended;
- **moved**: a conversation whose replica is made busy (long requests on the same prefix)
  before its second turn, which is then better served elsewhere.

Every request streams; `Run` records each one (TTFT at the client, usage, tokens).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from baton_serve.cache_store.wire.prompt_types import ChatMessage
from baton_serve.loadtests.routing_workload import (
    BLOCKERS,
    Conversation,
    RequestRecord,
    RoutingWorkload,
)
from baton_serve.loadtests.sse import StreamError, aresponse_events
from baton_serve.replicas.engine.llama_model import LlamaModel
from baton_serve.replicas.engine.prompt import chat_prompt, model_chat_template

PUBLISH_WAIT_S = 1.0  # a finished turn's checkpoint reaches the index (heartbeat below)
STATS_WAIT_S = 1.0  # routing stats (every 0.5 s) show the busy replica's load


@dataclass
class Reply:
    text: str = ""
    ttft_s: float | None = None
    usage: dict = field(default_factory=dict)
    error: str | None = None


class Client:
    """Streams chat completions from one deployed app."""

    def __init__(self, http: httpx.AsyncClient, url: str, model_name: str) -> None:
        self._http = http
        self._url = url
        self._model_name = model_name

    async def chat(self, messages: list[dict], max_tokens: int | None) -> Reply:
        body = {
            "model": self._model_name,
            "messages": messages,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        reply = Reply()
        started = time.perf_counter()
        async with self._http.stream("POST", f"{self._url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                reply.error = f"HTTP {r.status_code}"
                return reply
            try:
                async for chunk in aresponse_events(r):
                    delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else ""
                    if delta:
                        reply.ttft_s = reply.ttft_s or time.perf_counter() - started
                        reply.text += delta
                    reply.usage = chunk.get("usage") or reply.usage
            except StreamError as exc:
                reply.error = (exc.error or {}).get("type") or "stream error"
                return reply
        if not reply.usage:
            reply.error = "no usage"
        return reply


class Run:
    """One policy's requests, recorded against a shared clock and tokeniser; `recorded` is
    told how many there are after each."""

    def __init__(
        self,
        policy: str,
        client: Client,
        model: LlamaModel,
        workload: RoutingWorkload,
        recorded: Callable[[int], None],
    ) -> None:
        self.policy = policy
        self._recorded = recorded
        self.records: list[RequestRecord] = []
        self._client = client
        self._model = model
        self._template = model_chat_template(model)
        self._workload = workload
        self._started = time.perf_counter()

    async def turn(self, conversation: Conversation, turn: int, messages: list[dict]) -> str:
        """Send `messages`; record the request; return the reply's text."""
        prompt = chat_prompt(self._model, self._template, [ChatMessage(**m) for m in messages])
        started = time.perf_counter()
        reply = await self._client.chat(messages, self._workload.reply_tokens)
        usage = reply.usage
        self.records.append(
            RequestRecord(
                policy=self.policy,
                scenario=conversation.scenario,
                session=conversation.session,
                turn=turn,
                started_s=started - self._started,
                ttft_s=reply.ttft_s,
                total_s=time.perf_counter() - started,
                prompt_tokens=usage.get("prompt_tokens", len(prompt)),
                cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                error=reply.error,
                prompt=prompt.tokens,
                reply=tuple(self._model.tokenize(reply.text)),
            )
        )
        self._recorded(len(self.records))
        return reply.text

    async def block(self, messages: list[dict]) -> None:
        """A request that generates until cancelled (or its context is full)."""
        await self._client.chat(messages, None)


def opening(system: str, conversation: Conversation) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{conversation.document}\n\n{conversation.questions[0]}"},
    ]


async def chat_session(run: Run, system: str, conversation: Conversation) -> None:
    messages = opening(system, conversation)
    for turn, (question, pause_s) in enumerate(zip(conversation.questions, conversation.pauses_s)):
        await asyncio.sleep(pause_s)
        if turn:
            messages.append({"role": "user", "content": question})
        reply = await run.turn(conversation, turn + 1, messages)
        messages.append({"role": "assistant", "content": reply})


async def moved_session(run: Run, system: str, conversation: Conversation) -> None:
    """Turn 1; then, while long requests on the same prefix keep its replica busy, turn 2."""
    messages = opening(system, conversation)
    reply = await run.turn(conversation, 1, messages)
    await asyncio.sleep(PUBLISH_WAIT_S)
    blockers = [asyncio.create_task(run.block(list(messages))) for _ in range(BLOCKERS)]
    try:
        await asyncio.sleep(STATS_WAIT_S)
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": conversation.questions[1]},
        ]
        await run.turn(conversation, 2, messages)
    finally:
        for blocker in blockers:
            blocker.cancel()  # closes the stream: the gateway cancels the generation
        await asyncio.gather(*blockers, return_exceptions=True)


async def burst(run: Run, system: str, conversations: list[Conversation]) -> None:
    """Every session's first (and only) request at the same instant."""
    await asyncio.gather(
        *(
            run.turn(
                c,
                1,
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": c.questions[0]},
                ],
            )
            for c in conversations
        )
    )


async def agent_session(run: Run, header: str, conversation: Conversation) -> None:
    """A task, then one step after another with no pause: each reply, then a tool result."""
    messages = [
        {"role": "system", "content": header},
        {"role": "user", "content": conversation.document},
    ]
    for step, result in enumerate((*conversation.questions, None)):
        reply = await run.turn(conversation, step + 1, messages)
        if result is not None:
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": result},
            ]

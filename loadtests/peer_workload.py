"""`baton bench peer`'s workload: seeded multi-turn sessions, the same for every server.

Two kinds of session, interleaved: a **chat** (a shared system prompt, a document of its
own — with `image_px`, an image of its own too — then a question each turn) and an **agent**
loop (a shared tool header and a task, then each step appends a tool result). Each session's next request is sent the instant the
previous reply has arrived, with that reply in the history; `concurrency` sessions at a time.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.llama_model import LlamaModel

CHAT, AGENT = "chat", "agent"
PATCH_PX = 14  # the smallest patch projectors cut: an image's tokens are at most (px / 14)²
TOOL_RESULT = "Tool result:"  # what an agent step's user message opens with


@dataclass(frozen=True)
class PeerWorkload:
    """The sessions every server is sent (sizes in tokens of the served model)."""

    chat_sessions: int = 6
    chat_turns: int = 4
    agent_sessions: int = 4
    agent_steps: int = 5
    concurrency: int = 2
    system_tokens: int = 600
    document_tokens: int = 400
    turn_tokens: int = 60
    tool_tokens: int = 150
    reply_tokens: int = 32
    image_px: int = 0  # a chat opens with an image this many pixels a side (0: none)
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.chat_turns, self.agent_steps, self.concurrency, self.reply_tokens) < 1:
            raise ValueError("chat_turns, agent_steps, concurrency and reply_tokens must be >= 1")
        if min(self.chat_sessions, self.agent_sessions) < 0:
            raise ValueError("chat_sessions and agent_sessions must be >= 0")
        if self.chat_sessions + self.agent_sessions < 1:
            raise ValueError("the workload needs at least one session")
        sizes = (self.system_tokens, self.document_tokens, self.turn_tokens, self.tool_tokens)
        if min(sizes) < 1:
            raise ValueError("token sizes must be >= 1")
        if self.image_px < 0:
            raise ValueError("image_px must be >= 0")

    def requests(self) -> int:
        return self.chat_sessions * self.chat_turns + self.agent_sessions * self.agent_steps

    def n_ctx(self) -> int:
        """A context (per slot) that holds the longest session, rounded up to 1024."""
        slack = self.reply_tokens + 32  # 32: template tokens
        image = (self.image_px // PATCH_PX + 1) ** 2 if self.image_px else 0
        chat = image + self.document_tokens + self.chat_turns * (self.turn_tokens + slack)
        agent = self.turn_tokens + self.agent_steps * (self.tool_tokens + slack)
        return 1024 * math.ceil((self.system_tokens + max(chat, agent) + 256) / 1024)


@dataclass(frozen=True)
class Session:
    """One session's script: its system message and the user message of each turn."""

    kind: str
    index: int
    system: str
    messages: tuple[str, ...]
    image_seed: int | None = None  # its first message's image (`image_data_url`), if any

    def first_content(self, image_px: int) -> str | list[dict]:
        """The first user message: its text, and the session's image as a data: URL part."""
        if self.image_seed is None:
            return self.messages[0]
        url = image_data_url(self.image_seed, image_px)
        return [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": self.messages[0]},
        ]


def image_data_url(seed: int, side: int) -> str:
    """A PNG of `side`² seeded random pixels, as a data: URL."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def make_sessions(workload: PeerWorkload, model: LlamaModel) -> list[Session]:
    """Every session, chats and agents interleaved, from `workload.seed` alone."""

    def text(n_tokens: int, topic: str) -> str:
        return filler_text(n_tokens, count, seed=rng.randrange(2**32), topic=topic)

    count = lambda s: len(model.tokenize(s))  # noqa: E731
    rng = random.Random(workload.seed)
    system = text(workload.system_tokens, "You are a helpful assistant.")
    tools = text(workload.system_tokens, "You are a coding agent. Tools: search, run, edit.")
    chats = [
        Session(
            CHAT,
            i,
            system,
            (
                text(workload.document_tokens, f"Document {i}:")
                + "\n\n"
                + text(workload.turn_tokens, "Question 1:"),
                *(
                    text(workload.turn_tokens, f"Question {t + 1}:")
                    for t in range(1, workload.chat_turns)
                ),
            ),
            image_seed=rng.randrange(2**32) if workload.image_px else None,
        )
        for i in range(workload.chat_sessions)
    ]
    agents = [
        Session(
            AGENT,
            i,
            tools,
            (
                text(workload.turn_tokens, f"Task {i}: fix the failing build."),
                *(
                    text(workload.tool_tokens, f"{TOOL_RESULT} step {s}")
                    for s in range(1, workload.agent_steps)
                ),
            ),
        )
        for i in range(workload.agent_sessions)
    ]
    mixed = [s for pair in zip(chats, agents, strict=False) for s in pair]
    longer = chats if len(chats) > len(agents) else agents
    return mixed + longer[min(len(chats), len(agents)) :]


def script_digest(sessions: list[Session]) -> str:
    """A short hash of every scripted message: equal digests, equal workloads."""
    digest = hashlib.sha256()
    for session in sessions:
        for part in (session.kind, session.system, *session.messages, str(session.image_seed)):
            digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]

"""The routing benchmark's workload: its sizes, its seeded conversations, and one record per
request (what `routing_bench` sends and measures, and `routing_report` sums up)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from baton_serve.loadtests.synthetic_text import filler_text
from baton_serve.replicas.engine.llama_model import LlamaModel

CHAT, MOVED, BURST, AGENT = "chat", "moved", "burst", "agent"
SCENARIOS = (CHAT, BURST, AGENT, MOVED)  # in the order they run
BLOCKERS = 2  # long requests that make a moved session's replica busy
KEPT_SHARE = 0.9  # an agent follow-up keeps its cache when this much of the last prompt is


@dataclass(frozen=True)
class RoutingWorkload:
    """The requests every policy is sent (sizes in tokens of the served model)."""

    sessions: int = 8
    turns: int = 5
    concurrency: int = 4
    system_tokens: int = 1000
    document_tokens: int = 800
    turn_tokens: int = 60
    reply_tokens: int = 24
    think_s: float = 2.0  # mean pause before each later turn (uniform in [0, 2 x think_s])
    moved_sessions: int = 2
    burst_sessions: int = 4  # arrive at once, sharing a system prompt nobody holds yet
    agent_sessions: int = 4  # concurrent agent loops, no pause between steps
    agent_steps: int = 6
    tool_tokens: int = 80  # each tool result an agent appends
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.concurrency, self.reply_tokens) < 1:
            raise ValueError("sessions, turns, concurrency and reply_tokens must be >= 1")
        if min(self.system_tokens, self.document_tokens, self.turn_tokens, self.tool_tokens) < 1:
            raise ValueError("token sizes must be >= 1")
        counts = (self.moved_sessions, self.burst_sessions, self.agent_sessions, self.think_s)
        if min(counts) < 0 or self.agent_steps < 1:
            raise ValueError(
                "moved_sessions, burst_sessions, agent_sessions and think_s must be >= 0, "
                "agent_steps >= 1"
            )

    def requests(self) -> int:
        """Requests one policy's run is measured on (the moved scenario's blockers aside)."""
        return (
            self.sessions * self.turns
            + self.burst_sessions
            + self.agent_sessions * self.agent_steps
            + 2 * self.moved_sessions
        )

    def n_ctx(self) -> int:
        """A context that holds the longest conversation, with room for long blockers."""
        per_turn = self.turn_tokens + self.reply_tokens + 32  # 32: template tokens and slack
        longest = self.system_tokens + self.document_tokens + self.turns * per_turn
        return 1024 * math.ceil((longest + 1024) / 1024)


@dataclass(frozen=True)
class Conversation:
    """One session's script: its document, the user message of each turn, and the user's
    pause before each turn (the first's is 0)."""

    scenario: str
    session: int
    document: str
    questions: tuple[str, ...]  # an agent's: the tool results it appends
    pauses_s: tuple[float, ...]


@dataclass(frozen=True)
class Script:
    """Every scenario's texts: chat and moved share `system`; a burst shares
    `burst_system`, which nothing before it computed; agents share `agent_header`."""

    system: str
    burst_system: str
    agent_header: str
    conversations: tuple[Conversation, ...]

    @classmethod
    def make(cls, workload: RoutingWorkload, model: LlamaModel) -> Script:
        def text(n_tokens: int, seed: int, topic: str = "") -> str:
            return filler_text(n_tokens, count, seed=seed, topic=topic)

        count = lambda s: len(model.tokenize(s))  # noqa: E731
        rng = random.Random(workload.seed)
        seeds = iter(lambda: rng.randrange(2**32), None)
        conversations = []
        for scenario, sessions, turns in (
            (CHAT, workload.sessions, workload.turns),
            (MOVED, workload.moved_sessions, 2),
        ):
            for session in range(sessions):
                document = text(workload.document_tokens, next(seeds), f"Document {session}:")
                questions = tuple(
                    text(workload.turn_tokens, next(seeds), f"Question {turn + 1}:")
                    for turn in range(turns)
                )
                pauses = (0.0, *(rng.uniform(0, 2 * workload.think_s) for _ in range(turns - 1)))
                conversations.append(Conversation(scenario, session, document, questions, pauses))
        for session in range(workload.burst_sessions):
            question = text(workload.turn_tokens, next(seeds), f"Burst question {session}:")
            conversations.append(Conversation(BURST, session, "", (question,), (0.0,)))
        for session in range(workload.agent_sessions):
            task = text(workload.turn_tokens, next(seeds), f"Task {session}: fix the build.")
            results = tuple(
                text(workload.tool_tokens, next(seeds), f"Result of step {step + 1}:")
                for step in range(workload.agent_steps - 1)
            )
            pauses = (0.0,) * workload.agent_steps
            conversations.append(Conversation(AGENT, session, task, results, pauses))
        return cls(
            system=text(workload.system_tokens, next(seeds), "You are a helpful assistant."),
            burst_system=text(workload.system_tokens, next(seeds), "You are a support agent."),
            agent_header=text(workload.document_tokens, next(seeds), "Tools: search, run, edit."),
            conversations=tuple(conversations),
        )


@dataclass
class RequestRecord:
    """One request of one policy's run."""

    policy: str
    scenario: str
    session: int
    turn: int
    started_s: float  # since the policy's run started
    ttft_s: float | None
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int = 0
    error: str | None = None
    prompt: tuple[int, ...] = field(default=(), repr=False)  # tokens, for counting new ones
    reply: tuple[int, ...] = field(default=(), repr=False)

    @property
    def computed_tokens(self) -> int:
        return 0 if self.error else self.prompt_tokens - self.cached_tokens

    @property
    def finished_s(self) -> float:
        return self.started_s + self.total_s

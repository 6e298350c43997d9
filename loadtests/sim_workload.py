"""The routing simulator's workloads, at token level.

A prompt is a tuple of *segments* — (id, tokens) runs of distinct tokens: a system prompt,
a document, a question, a reply, a tool result. Two prompts share exactly their equal
leading segments, so prefix reuse is exact to the token without materialising tokens; the
block hash chain the router looks up is derived from the segments (`block_chain`).

A session is a script of turns: each request's prompt is the previous prompt, its reply,
and the turn's new segment. Its next turn is sent `think_s` after the previous reply ends.

- `cluster_workload`: chat sessions under shared system prompts chosen with Zipf
  popularity, session lengths Zipf-distributed (a few long, popular conversations), agent
  loops (no think time, tool results appended), and bursts of sessions arriving at once on
  a system prompt nobody holds; arrivals scaled with the replica count, so the load per
  replica stays the same at every size.
- `routing_bench_phases`: `baton bench routing`'s four scenarios (same sizes, same seeded
  pauses), for validating the simulator against that benchmark's measurements.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass, field

from baton_serve.loadtests.routing_workload import RoutingWorkload

Segment = tuple[int, int]  # (id, tokens)
CHAT, AGENT, BURST, MOVED = "chat", "agent", "burst", "moved"
_SEED = hashlib.blake2b(b"baton-sim", digest_size=16).digest()


@dataclass(frozen=True)
class Turn:
    """One request of a session: the segment it adds, its reply's length, and the pause
    after the previous reply before it is sent."""

    added: tuple[Segment, ...]
    reply_tokens: int
    think_s: float = 0.0


@dataclass
class Session:
    kind: str
    sid: int
    start_s: float
    head: tuple[Segment, ...]  # sent before the first turn's segment (system prompt)
    turns: list[Turn]
    blockers: int = 0  # moved: long requests on its first prompt before turn 2


@dataclass
class Phase:
    """Sessions run together; the next phase starts once every request of this one ended.
    With `concurrency`, at most that many sessions run at once (in order)."""

    sessions: list[Session]
    concurrency: int | None = None
    name: str = ""


def n_tokens(segments: tuple[Segment, ...]) -> int:
    return sum(n for _, n in segments)


def prefix_keys(segments: tuple[Segment, ...]) -> tuple[list[int], list[int]]:
    """For each leading run of segments, a key naming it and its length in tokens."""
    keys, lengths, key, length = [], [], 0, 0
    for segment in segments:
        key = hash((key, segment))
        length += segment[1]
        keys.append(key)
        lengths.append(length)
    return keys, lengths


def block_chain(segments: tuple[Segment, ...], block_tokens: int) -> list[bytes]:
    """The prompt's block hash chain: entry i names its first (i + 1) × block tokens."""
    chain: list[bytes] = []
    digest, pieces, filled = _SEED, [], 0
    for sid, n in segments:
        offset = 0
        while offset < n:
            take = min(n - offset, block_tokens - filled)
            pieces.append((sid, offset, offset + take))
            offset, filled = offset + take, filled + take
            if filled == block_tokens:
                digest = hashlib.blake2b(digest + repr(pieces).encode(), digest_size=16).digest()
                chain.append(digest)
                pieces, filled = [], 0
    return chain


@dataclass(frozen=True)
class ClusterWorkload:
    """The scaled workload's shape (sizes in tokens)."""

    sessions_per_replica: int = 12
    load: float = 0.7  # ideal prefill work (new tokens) over the replicas' prefill capacity
    system_prompts_per_replica: float = 0.25  # shared system prompts (at least 4)
    zipf_s: float = 1.1  # popularity of system prompts and session lengths
    agent_share: float = 0.3
    burst_every_s: float = 60.0  # a burst of sessions on a new system prompt this often
    burst_sessions_per_replica: float = 0.5
    system_tokens: int = 1000
    document_tokens: int = 800
    turn_tokens: int = 60
    reply_tokens: int = 24
    max_turns: int = 12
    think_s: float = 2.0
    agent_steps: int = 6
    tool_tokens: int = 80
    seed: int = 0

    def __post_init__(self) -> None:
        if self.sessions_per_replica < 1 or not 0 < self.load or not 0 <= self.agent_share <= 1:
            raise ValueError("sessions_per_replica >= 1, load > 0, agent_share in [0, 1]")


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count(1)

    def segment(self, tokens: int) -> Segment:
        return (next(self._next), tokens)


def _zipf(rng: random.Random, n: int, s: float) -> int:
    """1..n with P(k) ∝ k^-s."""
    weights = [k**-s for k in range(1, n + 1)]
    return rng.choices(range(1, n + 1), weights)[0]


def _chat(ids: _Ids, rng: random.Random, w: ClusterWorkload, system: Segment, sid: int) -> Session:
    turns = _zipf(rng, w.max_turns, w.zipf_s)
    first = Turn((ids.segment(w.document_tokens),), w.reply_tokens)
    later = [
        Turn((ids.segment(w.turn_tokens),), w.reply_tokens, rng.uniform(0, 2 * w.think_s))
        for _ in range(turns - 1)
    ]
    return Session(CHAT, sid, 0.0, (system,), [first, *later])


def _agent(ids: _Ids, w: ClusterWorkload, header: Segment, sid: int) -> Session:
    first = Turn((ids.segment(w.turn_tokens),), w.reply_tokens)
    steps = [Turn((ids.segment(w.tool_tokens),), w.reply_tokens) for _ in range(w.agent_steps - 1)]
    return Session(AGENT, sid, 0.0, (header,), [first, *steps])


def ideal_new_tokens(sessions: list[Session]) -> int:
    """Prompt and reply tokens an ideal cluster-wide cache computes: each distinct segment
    once (replies are decoded, so they are not prompt work)."""
    seen: set[int] = set()
    total = 0
    for session in sessions:
        for segment in (*session.head, *(s for t in session.turns for s in t.added)):
            if segment[0] not in seen:
                seen.add(segment[0])
                total += segment[1]
    return total


def cluster_workload(w: ClusterWorkload, replicas: int, prefill_tokens_per_s: float) -> list[Phase]:
    """`w.sessions_per_replica` × `replicas` sessions (and the bursts) arriving over a
    span that makes the ideal prefill work `w.load` of the replicas' capacity."""
    rng = random.Random(w.seed)
    ids = _Ids()
    n_systems = max(4, round(w.system_prompts_per_replica * replicas))
    systems = [ids.segment(w.system_tokens) for _ in range(n_systems)]
    headers = [ids.segment(w.document_tokens) for _ in range(max(1, n_systems // 4))]
    sessions = []
    for sid in range(w.sessions_per_replica * replicas):
        if rng.random() < w.agent_share:
            header = headers[_zipf(rng, len(headers), w.zipf_s) - 1]
            sessions.append(_agent(ids, w, header, sid))
        else:
            system = systems[_zipf(rng, n_systems, w.zipf_s) - 1]
            sessions.append(_chat(ids, rng, w, system, sid))
    span_s = ideal_new_tokens(sessions) / (w.load * prefill_tokens_per_s * replicas)
    for session in sessions:
        session.start_s = rng.uniform(0, span_s)
    bursts, at = [], w.burst_every_s / 2
    per_burst = max(2, round(w.burst_sessions_per_replica * replicas))
    while at < span_s:
        system = ids.segment(w.system_tokens)
        for _ in range(per_burst):
            question = Turn((ids.segment(w.turn_tokens),), w.reply_tokens)
            bursts.append(Session(BURST, len(sessions) + len(bursts), at, (system,), [question]))
        at += w.burst_every_s
    everything = sorted(sessions + bursts, key=lambda s: s.start_s)
    return [Phase(everything, name="cluster")]


# ---- `baton bench routing`'s workload ---------------------------------------------------------

TEMPLATE_TOKENS = 8  # chat template tokens around each message (measured prompts run ~this)


@dataclass
class _Script:
    ids: _Ids = field(default_factory=_Ids)

    def seg(self, tokens: int) -> Segment:
        return self.ids.segment(tokens + TEMPLATE_TOKENS)


def routing_bench_phases(w: RoutingWorkload = RoutingWorkload()) -> list[Phase]:
    """The routing benchmark's scenarios in its order (chat, burst, agent, moved), with its
    sizes and its seeded think pauses (`Script.make`'s draws, in the same order)."""
    rng = random.Random(w.seed)
    script = _Script()
    system = script.seg(w.system_tokens)

    def conversation(kind: str, sid: int, turns: int, pauses: list[float]) -> Session:
        first = Turn((script.seg(w.document_tokens + w.turn_tokens),), w.reply_tokens)
        later = [
            Turn((script.seg(w.turn_tokens),), w.reply_tokens, pause) for pause in pauses[1:turns]
        ]
        return Session(kind, sid, 0.0, (system,), [first, *later])

    chats, moved = [], []
    for kind, count, turns, into in (
        (CHAT, w.sessions, w.turns, chats),
        (MOVED, w.moved_sessions, 2, moved),
    ):
        for sid in range(count):
            for _ in range(1 + turns):  # the texts' seeds `Script.make` draws first
                rng.randrange(2**32)
            pauses = [0.0, *(rng.uniform(0, 2 * w.think_s) for _ in range(turns - 1))]
            into.append(conversation(kind, sid, turns, pauses))
    for session in moved:  # its second turn waits for the blockers (1 s + 1 s in the bench)
        session.turns[1] = Turn(session.turns[1].added, w.reply_tokens, 2.0)
        session.blockers = 2
    burst_system = script.seg(w.system_tokens)
    bursts = [
        Session(
            BURST, sid, 0.0, (burst_system,), [Turn((script.seg(w.turn_tokens),), w.reply_tokens)]
        )
        for sid in range(w.burst_sessions)
    ]
    header = script.seg(w.document_tokens)
    agents = []
    for sid in range(w.agent_sessions):
        first = Turn((script.seg(w.turn_tokens),), w.reply_tokens)
        steps = [
            Turn((script.seg(w.tool_tokens),), w.reply_tokens) for _ in range(w.agent_steps - 1)
        ]
        agents.append(Session(AGENT, sid, 0.0, (header,), [first, *steps]))
    return [
        Phase(chats, concurrency=w.concurrency, name=CHAT),
        Phase(bursts, name=BURST),
        Phase(agents, name=AGENT),
        Phase(moved, concurrency=1, name=MOVED),
    ]

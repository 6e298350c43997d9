"""One simulated run: a workload's phases against N simulated replicas under one policy.

Sessions send their turns through the policy to replicas (`sim_replica`), on one event
loop; every request's TTFT (from the moment it is sent to its first token), prompt, reused
and *new* tokens (not in the prompt and reply of any request finished before it was sent,
as `bench routing` counts them) and shipped bytes are recorded, and each replica's work.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from baton_serve.cache_store.index.memory_index import ModelIndex
from baton_serve.loadtests.sim_policies import BATON, make_policy
from baton_serve.loadtests.sim_profile import Profile
from baton_serve.loadtests.sim_replica import EventLoop, Job, SimReplica
from baton_serve.loadtests.sim_workload import (
    Phase,
    Segment,
    Session,
    block_chain,
    prefix_keys,
)

BLOCKER_S = 4.0  # a moved session's blockers decode this long (cancelled in the bench)
BLOCKERS_AFTER_S = 1.0  # after the session's first turn


@dataclass
class Record:
    """One measured request."""

    kind: str
    session: int
    turn: int
    replica: str
    sent_s: float
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    new_tokens: int
    shipped_bytes: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


@dataclass
class RunResult:
    policy: str
    replicas: int
    records: list[Record]
    busy_s: list[float]  # per replica
    reasons: Counter[str] = field(default_factory=Counter)  # baton's decisions by reason
    phases_s: dict[str, float] = field(default_factory=dict)


class Cluster:
    """Replicas, a policy and the sessions' progress, on one event loop."""

    def __init__(self, profile: Profile, n_replicas: int, policy: str, seed: int = 0) -> None:
        self.profile = profile
        self.loop = EventLoop()
        self.index = ModelIndex()
        self.replicas: dict[str, SimReplica] = {}
        for i in range(n_replicas):
            rid = f"r{i:03d}"
            self.replicas[rid] = SimReplica(
                rid,
                profile,
                self.loop,
                self.index,
                self.replicas,
                self._done,
                baton=policy == BATON,
                seed=seed,
            )
        self.policy = make_policy(
            policy, self.replicas, self.index, lambda: self.loop.now, profile.block_tokens, seed
        )
        self.records: list[Record] = []
        self._finished: set[int] = set()  # prefix keys of finished prompts with their replies
        self._reply_ids = itertools.count(-1, -1)
        self._sent: dict[int, _Sent] = {}
        self._keys = itertools.count()
        self._open: dict[int, int] = {}  # id(session) -> requests of it not ended
        self._waiting: list[Session] = []
        self._phase_left = 0

    def run(self, phases: list[Phase]) -> RunResult:
        """Every phase, one after the other."""
        phases_s = {}
        for phase in phases:
            started = self.loop.now
            self._phase_left = len(phase.sessions)
            limit = phase.concurrency or len(phase.sessions)
            self._waiting = list(phase.sessions[limit:])
            for session in phase.sessions[:limit]:
                self.loop.at(started + session.start_s, self._begin, session)
            self.loop.run()
            phases_s[phase.name] = self.loop.now - started
        busy = [r.busy_s for r in self.replicas.values()]
        reasons = self.policy.reasons
        return RunResult(
            self.policy.name, len(self.replicas), self.records, busy, reasons, phases_s
        )

    # ---- sessions ------------------------------------------------------------------------

    def _begin(self, session: Session) -> None:
        self._open[id(session)] = 1
        self._send(session, 0, session.head, True)

    def _schedule(
        self, at: float, session: Session, turn: int, before: tuple[Segment, ...], recorded: bool
    ) -> None:
        self._open[id(session)] += 1
        self.loop.at(at, self._send, session, turn, before, recorded)

    def _send(
        self, session: Session, turn: int, before: tuple[Segment, ...], recorded: bool
    ) -> None:
        """Turn `turn` of `session` after `before` (its head, or the last prompt and reply);
        not `recorded`: a moved session's blocker (a long request on its first prompt)."""
        spec = session.turns[turn]
        segments = before + spec.added
        keys, lengths = prefix_keys(segments)
        reply_tokens = (
            spec.reply_tokens if recorded else int(BLOCKER_S / self.profile.decode_step_s(1))
        )
        reply = (next(self._reply_ids), reply_tokens)
        reply_keys, reply_lengths = prefix_keys(segments + (reply,))
        size = self.profile.block_tokens
        job = Job(
            key=f"{session.kind}-{session.sid}-{turn}-{next(self._keys)}",
            keys=keys,
            lengths=lengths,
            chain=block_chain(segments, size),
            reply_tokens=reply_tokens,
            reply_keys=(reply_keys, reply_lengths, block_chain(segments + (reply,), size)),
        )
        seen = max((n for k, n in zip(keys, lengths) if k in self._finished), default=0)
        self._sent[id(job)] = _Sent(
            session, turn, segments, reply, self.loop.now, lengths[-1] - seen, recorded
        )
        rid = self.policy.choose(job, session.turns[0].added[0][0])
        self.replicas[rid].arrive(job)

    def _done(self, job: Job, replica: SimReplica) -> None:
        self.policy.completed(replica.rid, job)
        sent = self._sent.pop(id(job))
        session, turn = sent.session, sent.turn
        self._finished.update(job.reply_keys[0])
        self._open[id(session)] -= 1
        if sent.recorded:
            assert job.first_token_s is not None
            self.records.append(
                Record(
                    session.kind,
                    session.sid,
                    turn + 1,
                    replica.rid,
                    sent.sent_s,
                    job.first_token_s - sent.sent_s,
                    job.n_prompt,
                    job.reused,
                    sent.new_tokens,
                    job.shipped_bytes,
                )
            )
            if turn + 1 < len(session.turns):
                now = self.loop.now
                if session.blockers and turn == 0:
                    for _ in range(session.blockers):
                        self._schedule(now + BLOCKERS_AFTER_S, session, 0, session.head, False)
                after = sent.segments + (sent.reply,)
                self._schedule(
                    now + session.turns[turn + 1].think_s, session, turn + 1, after, True
                )
        if self._open[id(session)] == 0:
            del self._open[id(session)]
            if self._waiting:
                self._begin(self._waiting.pop(0))


@dataclass
class _Sent:
    session: Session
    turn: int
    segments: tuple[Segment, ...]
    reply: Segment
    sent_s: float
    new_tokens: int
    recorded: bool

"""What one router has sent where, known the moment it decides — before any replica or
index has heard of it (a decision is recorded when it is made, and moved if Ray then sends
the request to another replica of the ranking).

- Per replica, the requests in flight and the prompt tokens they still make it compute:
  exact for this router, where routing stats are a second old; and of those, the ones
  that compute only once a state they wait for arrives (`gated`). A replica's report counts
  every caller's requests as they were when it sampled them; `load_given_report` adds the
  other callers' share of it to this router's count now (a request this router has seen
  finish is not counted again until the next report).
- The prefixes those requests make the replicas hold, as index entries: *in flight*
  (`ready_at` > 0) until the request completes, held after; they expire `ttl_s` after
  completion, by which time the replica's own publications have reached the index.
  Attention models serve every prefix of a state, so each block of the prompt is recorded;
  hybrid and recurrent states serve only where they were saved, so only the positions the
  engine checkpoints are.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton_serve.cache_store.index.index import IndexMatch
from baton_serve.cache_store.index.index_entries import index_entries, prefix_ready_at
from baton_serve.cache_store.index.memory_index import HeldPrefix, ModelIndex
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.replicas.engine.checkpoint_policy import prefill_checkpoints

LOAD_HISTORY_S = 5.0  # how far back this router can tell its own in-flight count
LOAD_HISTORY_CHANGES = 4096  # per replica, whichever bound comes first


@dataclass
class _Sent:
    replica_id: str
    entries: list[HeldPrefix]  # plain tuples: see `memory_index.HeldPrefix`
    tokens: int  # prompt tokens the replica computes for it
    state_at: float = 0.0  # Unix time the state it reuses is ready, if it waits for one


class RoutingLedger:
    """Requests this router sent and the prefixes they leave; one event loop, no locks."""

    def __init__(
        self,
        block_tokens: int,
        *,
        every_block: bool,
        ttl_s: float = 30.0,
        now: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.block_tokens = block_tokens
        self.every_block = every_block
        self.ttl_s = ttl_s
        self._now = now
        self._wall = wall  # the clock replicas stamp their reports with
        self._prefixes = ModelIndex()
        # (replica, request id) -> what was sent; a list, as sibling calls of one parent
        # request share its id
        self._sent: dict[tuple[str, str], list[_Sent]] = {}
        self._load: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._gated: dict[str, list[_Sent]] = {}  # replica -> its sends that wait for a state
        # replica -> (wall time, +1 sent / -1 finished or withdrawn), oldest first
        self._changes: dict[str, deque[tuple[float, int]]] = {}
        self._history_from: dict[str, float] = {}  # the newest change dropped from it

    def load(self, replica_id: str) -> int:
        return self._load.get(replica_id, 0)

    def load_given_report(self, replica_id: str, reported: int, reported_at: float | None) -> int:
        """Requests in flight at `replica_id`: this router's now, plus the other callers'
        as of the replica's last report (`reported` requests at wall time `reported_at`,
        less this router's own then). Where that time is unknown or older than this
        router's history, the larger of the two counts."""
        mine = self.load(replica_id)
        mine_then = None if reported_at is None else self._load_at(replica_id, reported_at)
        if mine_then is None:
            return max(mine, reported)
        return mine + max(0, reported - mine_then)

    def _load_at(self, replica_id: str, at: float) -> int | None:
        if at < self._history_from.get(replica_id, -math.inf):
            return None
        load = self.load(replica_id)
        for t, delta in reversed(self._changes.get(replica_id, ())):  # newest first
            if t <= at:
                break
            load -= delta
        return load

    def _count(self, replica_id: str, delta: int) -> None:
        self._load[replica_id] = self.load(replica_id) + delta
        now = self._wall()
        changes = self._changes.setdefault(replica_id, deque())
        changes.append((now, delta))
        while changes and (
            changes[0][0] < now - LOAD_HISTORY_S or len(changes) > LOAD_HISTORY_CHANGES
        ):
            self._history_from[replica_id] = changes.popleft()[0]

    def queued_tokens(self, replica_id: str) -> int:
        return self._tokens.get(replica_id, 0)

    def gated(self, replica_id: str) -> tuple[tuple[float, int], ...]:
        """(Unix time, prompt tokens) of the requests in flight at `replica_id` that
        compute once the state they wait for is ready then, soonest first."""
        gated = self._gated.get(replica_id)  # every candidate of every decision: mostly none
        return tuple(sorted((s.state_at, s.tokens) for s in gated)) if gated else ()

    def entries_for(self, prompt: Prompt, chain: Sequence[bytes]) -> list[tuple[bytes, int]]:
        """(block hash, tokens) the replica serving `prompt` will hold, as it publishes them
        (`index_entries`): for attention the prompt's whole blocks; else the positions the
        engine checkpoints (`prefill_checkpoints`, less the periodic ones, whose interval is
        the replica's setting)."""
        size = self.block_tokens
        if self.every_block:
            return index_entries(chain, len(chain) * size, size, every_block=True)
        positions = prefill_checkpoints(prompt, cached=0, interval=0, max_interval=0)
        return [
            entry
            for p in positions
            if p // size <= len(chain)
            for entry in index_entries(chain, p, size, every_block=False)
        ]

    def sent(
        self,
        replica_id: str,
        request_key: str,
        held: list[tuple[bytes, int]],
        tokens: int,
        ready_at: float,
        *,
        reused: int = 0,
        prefill_tokens_per_s: float = 0.0,
        state_at: float = 0.0,
    ) -> None:
        """Record a request routed to `replica_id` that reuses `reused` prompt tokens
        (ready at `state_at` if it waits for them), computes the next `tokens` and gives
        its first token at `ready_at` (Unix time); each prefix of `held` is ready then —
        or, given the replica's prefill speed, as its prefill passes it (a shared system
        prompt long before the request's end)."""
        now = self._now()

        speed, end = prefill_tokens_per_s, reused + tokens
        entries = [
            (h, n, 0, prefix_ready_at(ready_at, end, n, speed, computed_from=reused))
            for h, n in held
        ]
        sent = _Sent(replica_id, entries, tokens, state_at)
        self._sent.setdefault((replica_id, request_key), []).append(sent)
        if state_at > 0:
            self._gated.setdefault(replica_id, []).append(sent)
        self._count(replica_id, +1)
        self._tokens[replica_id] = self.queued_tokens(replica_id) + tokens
        expires = now + self.ttl_s + max(0.0, ready_at - time.time())
        self._prefixes.alive[replica_id] = max(self._prefixes.alive.get(replica_id, 0), expires)
        self._prefixes.hold(replica_id, entries, expires)

    def completed(self, replica_id: str, request_key: str) -> None:
        """The request finished (or failed): its replica holds its prefixes now."""
        siblings = self._sent.get((replica_id, request_key))
        if not siblings:
            return
        sent = siblings.pop(0)
        if not siblings:
            del self._sent[(replica_id, request_key)]
        self._settle(sent)
        expires = self._now() + self.ttl_s
        held = [(h, n_tokens, nbytes, 0.0) for h, n_tokens, nbytes, _ in sent.entries]
        self._prefixes.alive[replica_id] = max(self._prefixes.alive.get(replica_id, 0), expires)
        self._prefixes.hold(replica_id, held, expires)

    def withdraw(self, replica_id: str, request_key: str) -> None:
        """A request recorded for `replica_id` went elsewhere (or nowhere): it counts there
        no more, and the prefixes only it would have left there are forgotten."""
        siblings = self._sent.get((replica_id, request_key))
        if not siblings:
            return
        sent = siblings.pop()
        if not siblings:
            del self._sent[(replica_id, request_key)]
        self._settle(sent)
        self._prefixes.forget(replica_id, [entry[0] for entry in sent.entries])
        expires = self._now() + self.ttl_s
        for (rid, _), others in self._sent.items():  # what other requests there still leave
            if rid == replica_id:
                for other in others:
                    self._prefixes.hold(replica_id, other.entries, expires)

    def _settle(self, sent: _Sent) -> None:
        """`sent` is no longer in flight at its replica."""
        self._count(sent.replica_id, -1)
        self._tokens[sent.replica_id] -= sent.tokens
        if sent.state_at > 0:
            gated = self._gated.get(sent.replica_id, [])
            gated[:] = [s for s in gated if s is not sent]

    def forget_replica(self, replica_id: str) -> None:
        """A replica died: nothing it was sent counts any more."""
        for key in [k for k in self._sent if k[0] == replica_id]:
            del self._sent[key]
        self._load.pop(replica_id, None)
        self._tokens.pop(replica_id, None)
        self._gated.pop(replica_id, None)
        self._changes.pop(replica_id, None)
        self._history_from.pop(replica_id, None)
        self._prefixes.forget(replica_id, None)

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, IndexMatch]:
        now = self._now()
        self._prefixes.expire(now)
        return self._prefixes.lookup(hashes, now)

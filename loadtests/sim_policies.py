"""The routing policies the simulator compares; each picks a replica id for a request.

- **baton**: Baton's own decision code (`router/routing/route_decision.py` → `route_cost.rank`),
  with its `RoutingLedger` and the cluster's index, exactly as `BatonRouter` calls it; the
  plan (`plan_of`) travels with the request to the replica, which executes it.
- **pow2**: Ray Serve's default — two replicas at random, the one with fewer requests.
- **prefix-affinity**: Ray Serve LLM's `PrefixCacheAffinityRouter` rules: a tree of the
  prompts sent to each replica; the replicas with the longest match if it covers at least
  10% of the prompt (the least-loaded of them), else the replicas whose trees are smallest;
  power of two when the queue lengths differ by more than `imbalanced_threshold` (Ray's
  default, and Baton's deployment of it: never). Ray's tree evicts past 400,000 characters
  per replica; the simulated tree does not.
- **chwbl**: KubeAI's consistent hashing with bounded load: the prompt's first user message
  (its first 100 characters, about 25 tokens) hashed onto a ring of 256 points per replica,
  then clockwise to the first replica whose load stays within 1.25 × the mean.
- **round-robin**: each request to the next replica in turn.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable

from baton_serve.cache_store.index.index_entries import index_entries
from baton_serve.cache_store.index.memory_index import ModelIndex
from baton_serve.loadtests.sim_replica import Job, SimReplica
from baton_serve.router.routing.route_cost import CostSettings
from baton_serve.router.routing.route_decision import (
    decide,
    merge_ledger,
    plan_of,
    record_sent,
    replica_state,
)
from baton_serve.router.routing.routing_ledger import RoutingLedger

BATON, POW2, AFFINITY, CHWBL, ROUND_ROBIN = (
    "baton",
    "pow2",
    "prefix-affinity",
    "chwbl",
    "round-robin",
)
POLICIES = (BATON, POW2, AFFINITY, CHWBL, ROUND_ROBIN)
MATCH_RATE_THRESHOLD = 0.1
CHWBL_LOAD_FACTOR = 1.25
CHWBL_POINTS = 256


class Policy:
    """Picks where a request goes; told when it ends."""

    name = ""

    def __init__(self, replicas: dict[str, SimReplica], seed: int) -> None:
        self.replicas = replicas
        self.ids = sorted(replicas)
        self.rng = random.Random(seed)
        self.reasons: Counter[str] = Counter()

    def choose(self, job: Job, first_user: int) -> str:
        """The replica for `job`; `first_user` names its first user message."""
        raise NotImplementedError

    def completed(self, rid: str, job: Job) -> None:
        """`job` ended on `rid`."""

    def _pow2(self) -> str:
        a, b = self.rng.sample(self.ids, 2) if len(self.ids) > 1 else (self.ids[0],) * 2
        return a if self.replicas[a].in_flight <= self.replicas[b].in_flight else b


class BatonPolicy(Policy):
    name = BATON

    def __init__(
        self,
        replicas: dict[str, SimReplica],
        seed: int,
        index: ModelIndex,
        now: Callable[[], float],
        block_tokens: int,
        settings: CostSettings = CostSettings(),
    ) -> None:
        super().__init__(replicas, seed)
        self.index = index
        self.now = now
        self.block_tokens = block_tokens
        self.settings = settings
        self.ledger = RoutingLedger(block_tokens, every_block=True, now=now)

    def choose(self, job: Job, first_user: int) -> str:
        now = self.now()
        holdings, reason = {}, "no_prefix"
        if job.chain:
            found = self.index.lookup(job.chain, now)
            holdings, reason = merge_ledger(found, self.ledger.lookup(job.chain)), "load_fallback"
        # Each replica reports its prefill speed and pull bandwidth, as a real one does
        # (here the profile's: as if measured, or set by `pull_bandwidth_gb_s`).
        states = [
            replica_state(
                rid,
                self.ledger,
                r.in_flight,
                r.profile.prefill_tokens_per_s,
                holdings.get(rid),
                pull_bytes_per_s=r.ship.bandwidth_bytes_per_s,
            )
            for rid, r in self.replicas.items()
        ]
        estimates, reason = decide(states, job.n_prompt, now, self.settings, reason)
        self.reasons[reason] += 1
        chosen = estimates[0]
        # what RoutingLedger.entries_for gives an attention model: every block of the prompt
        size = self.block_tokens
        held = index_entries(job.chain, len(job.chain) * size, size, every_block=True)
        record_sent(self.ledger, chosen, job.key, job.n_prompt, held, now)
        job.plan = plan_of(chosen)  # the replica executes it, as a real one does
        return chosen.replica_id

    def completed(self, rid: str, job: Job) -> None:
        self.ledger.completed(rid, job.key)


class Pow2Policy(Policy):
    name = POW2

    def choose(self, job: Job, first_user: int) -> str:
        return self._pow2()


class RoundRobinPolicy(Policy):
    name = ROUND_ROBIN

    def __init__(self, replicas: dict[str, SimReplica], seed: int) -> None:
        super().__init__(replicas, seed)
        self._turn = itertools.cycle(self.ids)

    def choose(self, job: Job, first_user: int) -> str:
        return next(self._turn)


class PrefixAffinityPolicy(Policy):
    name = AFFINITY

    def __init__(
        self,
        replicas: dict[str, SimReplica],
        seed: int,
        imbalanced_threshold: float = math.inf,
    ) -> None:
        super().__init__(replicas, seed)
        self.imbalanced_threshold = imbalanced_threshold
        self._tenants: dict[int, set[str]] = {}  # prompt prefix -> replicas it was sent to
        self._size = dict.fromkeys(self.ids, 0)  # tokens in each replica's tree

    def choose(self, job: Job, first_user: int) -> str:
        loads = [r.in_flight for r in self.replicas.values()]
        if max(loads) - min(loads) > self.imbalanced_threshold:
            rid = self._pow2()
        else:
            matched, tenants = 0, set()
            for key, length in zip(reversed(job.keys), reversed(job.lengths)):
                if key in self._tenants:
                    matched, tenants = length, self._tenants[key]
                    break
            if matched / job.n_prompt >= MATCH_RATE_THRESHOLD:
                candidates = sorted(tenants)
            else:
                smallest = min(self._size.values())
                candidates = [rid for rid in self.ids if self._size[rid] == smallest]
            least = min(self.replicas[rid].in_flight for rid in candidates)
            rid = self.rng.choice([c for c in candidates if self.replicas[c].in_flight == least])
        previous = 0
        for key, length in zip(job.keys, job.lengths):
            holders = self._tenants.setdefault(key, set())
            if rid not in holders:
                holders.add(rid)
                self._size[rid] += length - previous
            previous = length
        return rid


class ChwblPolicy(Policy):
    name = CHWBL

    def __init__(self, replicas: dict[str, SimReplica], seed: int) -> None:
        super().__init__(replicas, seed)
        points = sorted(
            (_hash(f"{rid}#{i}".encode()), rid) for rid in self.ids for i in range(CHWBL_POINTS)
        )
        self._points = [p for p, _ in points]
        self._owners = [rid for _, rid in points]

    def choose(self, job: Job, first_user: int) -> str:
        total = sum(r.in_flight for r in self.replicas.values())
        bound = math.ceil(CHWBL_LOAD_FACTOR * (total + 1) / len(self.ids))
        start = bisect.bisect(self._points, _hash(f"prefix {first_user}".encode()))
        for i in range(len(self._owners)):
            rid = self._owners[(start + i) % len(self._owners)]
            if self.replicas[rid].in_flight + 1 <= bound:
                return rid
        return self._owners[start % len(self._owners)]


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def make_policy(
    name: str,
    replicas: dict[str, SimReplica],
    index: ModelIndex,
    now: Callable[[], float],
    block_tokens: int,
    seed: int,
) -> Policy:
    """The policy `name` over `replicas`."""
    if name == BATON:
        return BatonPolicy(replicas, seed, index, now, block_tokens)
    simple = {
        POW2: Pow2Policy,
        AFFINITY: PrefixAffinityPolicy,
        CHWBL: ChwblPolicy,
        ROUND_ROBIN: RoundRobinPolicy,
    }
    if name not in simple:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    return simple[name](replicas, seed)

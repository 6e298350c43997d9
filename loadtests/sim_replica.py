"""A simulated replica: an engine's slots, prefill and decode at a profile's speeds, a
prefix cache of checkpoints under a byte budget, and peer pulls by the replica's own rule.

- **Slots and steps**: `profile.slots` requests run at once (the engine's `n_slots`); the
  rest queue in order. The engine's own `plan_step` decides what is admitted and what each
  step does; the replica executes it one step at a time: a token for every decoding slot
  and prompt pieces of at most `prefill_chunk` tokens (no checkpoint cuts here) within
  `step_tokens`, timed as the emulated engine times it (`step_seconds`). A prompt's last
  piece gives its first token. Every step's time carries the host's noise (`step_noise`).
- **Replays**: once a reply is sent, its tokens are prefilled in its slot (the engine's
  replay, which makes the stored state exact), first in line; then the slot is free.
- **Prefix cache** (attention): a checkpoint serves every prefix of itself; one is stored
  when a prompt is prefilled, and replaced by the prompt + reply when the request ends;
  least recently used ones are evicted past `cache_bytes`. Each is published to the index
  under every block it covers (as the replica's `index_publisher` does); a prefill in
  progress is announced there as in flight, with its expected end (under Baton's router,
  the index's only reader; the others never look it up).
- **The same prefix twice**: a request extending what another slot is prefilling, or
  (planned in flight here) what a pull under way here brings, waits in the queue.
- **Pulls** (`replicas/prefix_pull.py`'s; only under Baton's router, which alone honours
  `target_replica=`): before queueing, the router's plan is executed (the planned donor's
  state pulled), decided again only when the donor or the state the plan counts on is gone;
  then (and without a plan) a peer's state is pulled when `pull_pays` (`pull_cost`).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from baton_serve.cache_store.index.index import IndexEntry
from baton_serve.cache_store.index.index_entries import index_entries, prefix_ready_at
from baton_serve.cache_store.index.memory_index import ModelIndex
from baton_serve.cache_store.pull_cost import pull_pays, pull_seconds
from baton_serve.cache_store.wire.route_plan import IN_FLIGHT, PULL, RoutePlan
from baton_serve.loadtests.sim_cache import SimCheckpoint, SimPrefixCache
from baton_serve.loadtests.sim_profile import Profile, ship_cost
from baton_serve.replicas.engine import step_plan as steps
from baton_serve.replicas.engine.checkpoint_policy import MIN_PIECE
from baton_serve.replicas.pull_choice import (
    HELD_HERE,
    STATE_GONE,
    best_donor,
    pull_gain,
    stale_plan,
)

FOREVER = float("inf")


class EventLoop:
    """A heap of timed callbacks; `now` is the time of the one running."""

    def __init__(self, start_s: float = 1.0) -> None:
        self.now = start_s  # > 0: a `ready_at` of 0 means "held now" to the index
        self._heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._order = itertools.count()

    def at(self, when: float, callback: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), callback, args))

    def run(self) -> None:
        while self._heap:
            self.now, _, callback, args = heapq.heappop(self._heap)
            callback(*args)


@dataclass(eq=False)
class Job:
    """One request at a replica, and what happened to it."""

    key: str
    keys: list[int]  # `sim_workload.prefix_keys` of the prompt
    lengths: list[int]
    chain: list[bytes]
    reply_tokens: int
    reply_keys: tuple[list[int], list[int], list[bytes]]  # the prompt and its reply
    reused: int = 0
    shipped_bytes: int = 0
    plan: RoutePlan | None = None  # the router's decision (Baton's router only)
    submitted_s: float = 0.0  # when it reached its replica
    done: int = 0  # prompt (then reply, replaying) tokens computed...
    end: int = 0  # ...of these
    replaying: bool = False
    decode_left: float = 0.0  # reply tokens left to decode
    prefill_s: float = 0.0  # compute time it cost its replica
    first_token_s: float | None = None
    done_s: float | None = None
    prefilled: bool = False
    dominates: int | None = None  # a checkpoint its prompt's state will serve all of
    on_prefilled: list[Callable[[], None]] = field(default_factory=list)

    @property
    def n_prompt(self) -> int:
        return self.lengths[-1]


def shared_tokens(job: Job, keys: list[int], lengths: list[int]) -> int:
    """Tokens `job`'s prompt shares with a prompt of `keys` (whole segments)."""
    n = 0
    for mine, theirs, length in zip(job.keys, keys, lengths):
        if mine != theirs:
            break
        n = length
    return n


class SimReplica:
    """One replica; `peers` maps every replica id to its replica (itself included)."""

    def __init__(
        self,
        rid: str,
        profile: Profile,
        loop: EventLoop,
        index: ModelIndex,
        peers: dict[str, SimReplica],
        on_done: Callable[[Job, SimReplica], None],
        baton: bool,
        seed: int = 0,
    ) -> None:
        self.rid = rid
        self.profile = profile
        self.cache = SimPrefixCache(profile.cache_bytes)
        self.in_flight = 0  # requests here (pulling, queued, running)
        self.busy_s = 0.0  # prefill seconds + decode slot-seconds / slots
        self._loop, self._index, self._peers = loop, index, peers
        self._on_done = on_done
        self._baton = baton  # only Baton's router and its replicas' pulls read the index
        self.ship = ship_cost(profile)
        self._queue: deque[Job] = deque()
        self._running = 0
        self._prefilling: list[Job] = []
        self._pulling: list[Job] = []  # their peer's state is on its way here
        self._decoding: list[Job] = []
        self._stepping = False  # a step is under way, until its effects are applied
        self._noise = random.Random(f"{seed}-{rid}")
        self._prompt_checkpoint: dict[int, int] = {}  # id(job) -> its prompt's checkpoint
        index.alive[rid] = FOREVER

    def arrive(self, job: Job) -> None:
        """A request routed here: pull a peer's state first if that pays, then queue."""
        self.in_flight += 1
        job.submitted_s = self._loop.now
        if not (self._baton and self._pull(job)):
            self._enqueue(job)

    # ---- pulls ---------------------------------------------------------------------------

    def _pull(self, job: Job) -> bool:
        """Start pulling a peer's state for `job` as its plan says, or (without one, or on
        evidence against it) when `pull_pays`; False if it computes instead."""
        local, _ = self.cache.match(job.keys, job.lengths)
        usable = job.n_prompt - MIN_PIECE
        least, plan, not_from = self.ship.min_gain_tokens, job.plan, None
        if plan is not None and plan.kind == PULL and plan.donor_id:
            if stale_plan(plan, local, usable, least) == HELD_HERE:
                return False
            if self._pull_from(self._peers[plan.donor_id], job, plan.ready_at > 0):
                return True
            not_from = plan.donor_id  # the donor no longer has it: decide again
        elif plan is not None and stale_plan(plan, local, usable, least) != STATE_GONE:
            return False  # as planned (the state a cached plan counts on is here)
        if usable - local < least:
            return False  # no peer can hold enough more: no lookup
        now = self._loop.now
        best = best_donor(self._index.lookup(job.chain, now), exclude=(self.rid, not_from))
        if best is None:
            return False
        gain = pull_gain(best.n_tokens, usable, local)
        wait_s = max(0.0, best.ready_at - now) if best.in_flight else 0.0
        speed = self.profile.prefill_tokens_per_s
        if not pull_pays(gain, best.nbytes, wait_s, speed, self.ship):
            return False
        return self._pull_from(self._peers[best.replica_id], job, best.in_flight)

    def _pull_from(self, peer: SimReplica, job: Job, in_flight: bool) -> bool:
        """Ship `peer`'s state for `job` now, or once the prefill it is waiting for ends;
        False if `peer` is computing nothing of it."""
        if in_flight:
            if (computing := peer.computing(job)) is None:
                return False
            computing.on_prefilled.append(lambda: self._ship_from(peer, job))
        self._pulling.append(job)
        if not in_flight:
            self._ship_from(peer, job)
        return True

    def computing(self, job: Job) -> Job | None:
        """The prefill here sharing the longest prefix with `job`'s prompt (not a replay:
        the engine waits only for prompts)."""
        found = max(
            (j for j in self._prefilling if not j.replaying),
            key=lambda j: shared_tokens(j, job.keys, job.lengths),
            default=None,
        )
        return found if found and shared_tokens(found, job.keys, job.lengths) else None

    def _ship_from(self, peer: SimReplica, job: Job) -> None:
        tokens, cid = peer.cache.match(job.keys, job.lengths)
        if cid is None:  # evicted meanwhile: compute it
            self._pulling.remove(job)
            self._enqueue(job)
            return
        checkpoint = peer.cache.get(cid)
        move_s = pull_seconds(checkpoint.nbytes, self.ship)
        job.shipped_bytes += checkpoint.nbytes
        self._loop.at(self._loop.now + move_s, self._pulled, job, checkpoint)

    def _pulled(self, job: Job, checkpoint: SimCheckpoint) -> None:
        self._store(checkpoint)
        self._pulling.remove(job)
        self._enqueue(job)

    # ---- slots and prefill ---------------------------------------------------------------

    def _enqueue(self, job: Job) -> None:
        self._queue.append(job)
        self._schedule()

    def _schedule(self) -> None:
        """Admit what the engine's plan admits (at once, even mid-step: the index hears of
        it then), then start the plan's step unless one is under way."""
        while (job := (plan := self._plan()).admit) is not None:
            self._queue.remove(job)
            self._running += 1
            self._start(job)
        if self._stepping or plan.empty:
            return
        # The engine's order (its exact-reuse calls): the decode rows, then the piece.
        pace = self._noisy(1.0)
        at = self._loop.now
        if plan.decode:
            at += pace * self.profile.decode_step_s(len(plan.decode))
            self._loop.at(at, self._decoded_step, plan.decode)
        for piece in plan.prefill:
            at += pace * self.profile.step_s(0, piece.end - piece.start)
            self._loop.at(at, self._piece_done, piece)
        self._loop.at(at, self._step_done)
        self._stepping = True  # mid-step plans only admit

    def _plan(self) -> steps.StepPlan[Job, Job]:
        p = self.profile
        runs = [self._view(j) for j in self._prefilling]
        runs += [steps.RunView(j, i, decoding=True) for i, j in enumerate(self._decoding)]
        view = steps.StepView(
            queue=tuple(steps.Queued(j) for j in self._queue),
            free_slots=p.slots - self._running,
            runs=tuple(runs),
            step_tokens=p.step_tokens,
            max_piece=p.prefill_chunk,
            one_call=False,  # the engine's calls where reuse is exact
            prefill_speed=p.prefill_tokens_per_s,
            now=self._loop.now,
        )
        return steps.plan_step(view, self._must_wait)

    def _view(self, job: Job) -> steps.RunView[Job]:
        """A prefill as `plan_step` sees it (aged from its arrival here)."""
        return steps.RunView(job, 0, done=job.done, end=job.end, since=job.submitted_s)

    def _rank(self, job: Job) -> tuple[float, float]:
        now, speed = self._loop.now, self.profile.prefill_tokens_per_s
        return steps.prefill_priority(self._view(job), speed, now)

    def _must_wait(self, job: Job) -> bool:
        """Another slot is prefilling more of `job`'s prompt than is held here (a block at
        least: `worth_waiting`, the engine's rule), or (for a job planned to join a prefix in
        flight here) a pull under way here brings it."""
        local, _ = self.cache.match(job.keys, job.lengths)
        pending = [c] if (c := self.computing(job)) is not None else []
        if job.plan is not None and job.plan.kind == IN_FLIGHT:
            pending += self._pulling
        block = self.profile.block_tokens
        shared = (shared_tokens(p, job.keys, job.lengths) for p in pending)
        return any(steps.worth_waiting(local, tokens, block) for tokens in shared)

    def _start(self, job: Job) -> None:
        local, cid = self.cache.match(job.keys, job.lengths)
        if cid is not None:
            used = self.cache.get(cid)
            if used.keys == job.keys[: len(used.keys)]:  # the new one will serve all of it
                job.dominates = cid
        job.reused = min(local, job.n_prompt - 1)  # the last token is always computed
        job.done, job.end = job.reused, job.n_prompt
        self._prefilling.append(job)
        ahead = sum(j.end - j.done for j in self._prefilling if self._rank(j) <= self._rank(job))
        speed = self.profile.prefill_speed(len(self._decoding))
        ends = self._loop.now + ahead / speed
        coming = [
            IndexEntry(
                h,
                n,
                n * self.profile.bytes_per_token,
                prefix_ready_at(ends, job.end, n, speed, computed_from=job.reused),
            )
            for h, n in self._entries(job.chain)
            if n > job.reused
        ]
        if self._baton:
            self._index.publish(self.rid, coming, FOREVER)

    def _noisy(self, seconds: float) -> float:
        """A step's duration with the host's noise: without it, simulated replicas fall
        into a lockstep that real ones never keep (requests arriving in the same order
        every round, so round robin sends a session to the same replica every time)."""
        sigma = self.profile.step_noise
        if not sigma:
            return seconds
        return seconds * self._noise.lognormvariate(-sigma * sigma / 2, sigma)  # mean 1

    def _decoded_step(self, decoded: tuple[Job, ...]) -> None:
        for job in decoded:
            job.decode_left -= 1
            if job.decode_left <= 0:
                self._decoding.remove(job)
                self._decoded(job)

    def _piece_done(self, piece: steps.Piece[Job]) -> None:
        job = piece.key
        job.done = piece.end
        if job.done >= job.end:
            self._prefilling.remove(job)
            (self._finish if job.replaying else self._prefilled)(job)

    def _step_done(self) -> None:
        self._stepping = False
        self._schedule()

    def _prefilled(self, job: Job) -> None:
        now, p = self._loop.now, self.profile
        job.prefilled = True
        computed = job.n_prompt - job.reused
        job.prefill_s = computed / p.prefill_tokens_per_s
        self.busy_s += job.prefill_s + job.reply_tokens / p.batch_decode_tokens_per_s
        job.first_token_s = now  # sampled from the prompt's last prefill step
        state = SimCheckpoint(job.keys, job.lengths, job.chain, job.n_prompt * p.bytes_per_token)
        cid = self._store(state)
        if cid is not None:
            self._prompt_checkpoint[id(job)] = cid
            if job.dominates is not None:
                self._forget(self.cache.remove(job.dominates))
        for callback in job.on_prefilled:
            callback()
        job.decode_left = job.reply_tokens - 1
        if job.decode_left > 0:
            self._decoding.append(job)
        else:
            self._decoded(job)

    def _decoded(self, job: Job) -> None:
        """The reply is sent; its slot replays it."""
        job.done_s = self._loop.now
        self.in_flight -= 1
        job.replaying, job.done, job.end = True, 0, job.reply_tokens
        self.busy_s += job.reply_tokens / self.profile.prefill_tokens_per_s
        self._prefilling.append(job)
        self._on_done(job, self)

    def _finish(self, job: Job) -> None:
        """Replayed: the prompt and its reply are stored, the slot is free."""
        keys, lengths, chain = job.reply_keys
        self._store(SimCheckpoint(keys, lengths, chain, lengths[-1] * self.profile.bytes_per_token))
        cid = self._prompt_checkpoint.pop(id(job), None)
        if cid is not None:  # the prompt's state, served by the one with its reply now
            self._forget(self.cache.remove(cid))
        self._running -= 1  # the next plan (after this step) admits in its place

    # ---- the cache and the index ---------------------------------------------------------

    def _store(self, checkpoint: SimCheckpoint) -> int | None:
        cid, gone = self.cache.add(checkpoint)
        self._forget(gone)
        if cid is not None and self._baton:
            held = [IndexEntry(h, n, checkpoint.nbytes) for h, n in self._entries(checkpoint.chain)]
            self._index.publish(self.rid, held, FOREVER)
        return cid

    def _entries(self, chain: list[bytes]) -> list[tuple[bytes, int]]:
        """Where a state of `chain`'s whole blocks is published, as a replica publishes an
        attention state (the simulated model)."""
        size = self.profile.block_tokens
        return index_entries(chain, len(chain) * size, size, every_block=True)

    def _forget(self, hashes: list[bytes]) -> None:
        if hashes and self._baton:
            self._index.forget(self.rid, hashes)

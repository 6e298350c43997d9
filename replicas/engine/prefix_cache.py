"""The policy of prefix reuse, exact to the bit: which state serves a prompt, which slot it
goes to, when a queued request waits for a prefix being computed, and what is kept.

- Attention-only models keep each idle slot's KV and cut it back to the matched prefix; a
  slot's state is saved to the checkpoint store when the slot is given to another prompt,
  where that is worth it, and a stored state serves any prompt sharing its beginning.
- Hybrid and recurrent models cannot cut their recurrent state back, so as a prompt is
  computed, partial states (no attention KV: `anchor`) are kept in its slot at exact
  positions (`checkpoint_policy`): the slot is rewound to one by loading it and cutting
  the attention cells, copying no attention byte. Full sequence states are stored for a
  shared system prompt (once), for positions a peer or a queued request waits for, and
  for a finished conversation when the engine is idle (`write_back`) or its slot is given
  away; the longest stored one that prefixes a new prompt serves another slot or a peer.

The mechanism (slot states, the store, signed blobs) is `prefix_states`. Everything here
runs on the engine thread, except `local_reuse` (a read-only estimate).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from baton_serve.cache_store.prefix_hash import common_prefix_length
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.replicas.engine.checkpoint_policy import (
    MIN_PIECE,
    interval_checkpoints,
    prefill_checkpoints,
    worth_saving,
)
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.engine.prefix_states import PrefixStates
from baton_serve.replicas.engine.slots import Phase, Running, Slot
from baton_serve.replicas.engine.stats import EngineStats
from baton_serve.replicas.engine.step_plan import worth_waiting

logger = logging.getLogger("baton.engine")

InFlightShare = tuple[Running, int]  # a prefill in progress, and where a queued prompt parts


@dataclass
class PeerAsk:
    """A peer waiting until `until` (time.monotonic()) for more than `min_tokens` of
    `tokens`; `seen`: the prefills already looked at for it (held, not their ids: a new
    run may take a finished one's id)."""

    tokens: tuple[int, ...]
    min_tokens: int
    until: float
    seen: list[Running] = field(default_factory=list)


class PrefixCache:
    """Decides how one engine reuses prefixes; `states` carries the decisions out."""

    def __init__(self, states: PrefixStates, config: EngineConfig, stats: EngineStats) -> None:
        self.states = states
        self.config = config
        self.stats = stats
        self.kind = states.kind
        self._waits: dict[Hashable, InFlightShare] = {}  # queued request -> its wait

    # ---- estimates (any thread) ----------------------------------------------------------

    def local_reuse(
        self, tokens: Sequence[int], slots: list[Slot], chain: Sequence[bytes] = ()
    ) -> tuple[int, float]:
        """About how many tokens of `tokens` this engine could reuse right now, and the
        estimated seconds to read that state from disk first (0 in RAM or in a slot).

        An estimate (idle slots are read without stopping the engine loop) for deciding
        whether pulling a longer prefix from a peer is worth it.
        """
        limit = max(0, len(tokens) - MIN_PIECE)
        found, stored = self.states.stored_prefix(tokens, limit, touch=False, chain=chain)
        live = max(
            (self.states.reusable(s, tokens, limit) for s in slots if s.running is None),
            default=0,
        )
        if live >= stored:
            return live, 0.0
        return stored, self.states.restore_seconds(found)

    def checkpoints_for(self, prompt: Prompt, cached: int) -> tuple[list[int], list[int]]:
        """Positions of `prompt` after which, as it is computed, its full state is stored
        and its partial state is kept in its slot (anchors).

        Full states are what other slots and peers share: a shared system prompt's, the
        moment it is computed (once per prompt: the store has it after), and a long
        prefill's interval positions, which peers wait for while it is computed (the index
        announces them). Hybrid and recurrent models anchor at every `checkpoint_policy`
        position; attention models keep their own live KV.
        """
        if not self.config.prefix_cache:
            return [], []
        end, config = prompt.system_end, self.config
        shared = end is not None and end >= config.block_tokens and cached < end < len(prompt)
        full = [end] if shared else []
        if not self.kind.needs_checkpoints:
            return full, []
        interval, most = config.checkpoint_interval, config.max_interval_checkpoints
        full += interval_checkpoints(cached, len(prompt), interval, most)
        anchors = prefill_checkpoints(prompt, cached=cached, interval=interval, max_interval=most)
        return sorted(set(full)), anchors

    # ---- waiting for a prefix ------------------------------------------------------------

    def replay_pending_for(self, prompt: tuple[int, ...], running: list[Running]) -> bool:
        """True while one of `running` replays the conversation `prompt` continues.

        The next turn of a chat often arrives while the previous reply is still being
        replayed into the cache; waiting those few steps beats recomputing the reply.
        """
        limit = len(prompt) - MIN_PIECE
        for run in running:
            if run.phase is Phase.REPLAY:
                common = common_prefix_length(run.feed, prompt, limit)
                if common > 0 and common >= min(limit, len(run.prompt) - MIN_PIECE):
                    return True
        return False

    def should_wait(
        self, key: Hashable, prompt: tuple[int, ...], running: list[Running], slots: list[Slot]
    ) -> bool | InFlightShare:
        """Whether another slot computes what the queued request `key` would reuse: the
        reply of the conversation it continues (a replay), or a long prefix of its prompt.
        False releases it: `place` then finds whatever there is. True: it waits (a replay, or
        a checkpoint reserved already). A share: it waits for that prefill's checkpoint, which
        `hold_wait` reserves once the step plan left it waiting. Changes nothing (the plan
        asks it)."""
        if not self.config.prefix_cache:
            return False
        if self.replay_pending_for(prompt, running):
            return True
        if (waits := self._waits.get(key)) is not None:
            run, position = waits
            return run.slot.running is run and len(run.slot.tokens) < position
        return self._in_flight_share(prompt, running, slots) or False

    def hold_wait(self, key: Hashable, share: InFlightShare) -> None:
        """The queued request `key`, which a step plan left waiting for `share`
        (`should_wait`), waits for a checkpoint added to that prefill where the prompts part."""
        run, position = share
        if run.checkpoint_at(position, self.config.prefill_chunk):
            self._waits[key] = share
            self.stats.prefix_waits += 1

    def stop_waiting(self, key: Hashable) -> None:
        """The queued request `key` is admitted, or gone (cancelled)."""
        self._waits.pop(key, None)

    def _in_flight_share(
        self, prompt: tuple[int, ...], running: list[Running], slots: list[Slot]
    ) -> InFlightShare | None:
        """A prefill in progress that will compute a long prefix of `prompt` this engine
        does not hold yet and can checkpoint there: that run and the shared length.

        That run is computing the prefix already, so a request waiting for its
        checkpoint waits no longer than computing it would take, and it is computed once.
        """
        limit = len(prompt) - MIN_PIECE
        best: tuple[Running, int] | None = None
        for run in running:
            if run.phase is not Phase.PREFILL:
                continue
            shared = common_prefix_length(run.feed, prompt, limit)
            if best is None or shared > best[1]:
                best = (run, shared)
        if best is None:
            return None
        run, shared = best
        block = self.config.block_tokens
        if not worth_waiting(0, shared, block):  # too short whatever is held: no lookup
            return None
        if not worth_waiting(self.local_reuse(prompt, slots)[0], shared, block):
            return None
        return best if run.can_checkpoint_at(shared, self.config.prefill_chunk) else None

    def checkpoint_for_peers(self, asks: deque[PeerAsk], running: list[Running]) -> None:
        """For each live ask (`Engine.keep_for_peer`), a checkpoint where the asked
        prompt parts from each prefill (once per run, also one admitted after the ask) that
        shares more than the tokens asked for and has not passed that point. Engine thread."""
        now = time.monotonic()
        for _ in range(len(asks)):
            ask = asks.popleft()
            if ask.until < now:
                continue
            for run in running:
                if run.phase is Phase.PREFILL and all(run is not s for s in ask.seen):
                    ask.seen.append(run)
                    # at most the prompt less its last piece: the state a prompt leaves
                    shared = min(
                        common_prefix_length(run.feed, ask.tokens), len(run.feed) - MIN_PIECE
                    )
                    if shared > ask.min_tokens:
                        run.checkpoint_at(shared, self.config.prefill_chunk)
            asks.append(ask)

    # ---- placement -----------------------------------------------------------------------

    def place(
        self, prompt: tuple[int, ...], free: list[Slot], chain: Sequence[bytes] = ()
    ) -> tuple[Slot, int]:
        """Pick a slot for `prompt` (whose block hashes `chain` begins) and load the longest
        reusable prefix into it."""
        slot, cached = self._place(prompt, free, chain)
        slot.follows(chain)  # it holds a prefix of `prompt` now
        return slot, cached

    def _place(
        self, prompt: tuple[int, ...], free: list[Slot], chain: Sequence[bytes]
    ) -> tuple[Slot, int]:
        if not self.config.prefix_cache:
            slot = self._victim(free)
            self._evict(slot)
            return slot, 0
        limit = max(0, len(prompt) - MIN_PIECE)  # the rest is computed as one exact piece
        live_slot, live = max(
            ((s, self.states.reusable(s, prompt, limit)) for s in free), key=lambda p: p[1]
        )
        checkpoint, stored = self.states.stored_prefix(prompt, limit, chain=chain)
        if checkpoint is not None and stored > live:
            slot = self._victim(free)
            self._evict(slot)
            if self.states.restore(slot, checkpoint):
                self.states.served(checkpoint)
                if stored < len(slot.tokens) and not self.states.cut(slot, stored):
                    return slot, 0  # attention KV: keep only the shared prefix, if it can
                return slot, stored
            return slot, 0
        if live:
            if len(live_slot.tokens) > live:
                if live_slot.unsaved:  # a finished conversation not stored yet
                    self._keep(live_slot)
                if not self.states.cut(live_slot, live):
                    return live_slot, 0
            return live_slot, live
        slot = self._victim(free)
        self._evict(slot)
        return slot, 0

    def _victim(self, free: list[Slot]) -> Slot:
        """The free slot whose contents are least worth keeping: empty first, then LRU."""
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    # ---- keeping and dropping ------------------------------------------------------------

    def keep_slots(self, slots: list[Slot]) -> None:
        """Save what idle slots hold to the store (attention models: a slot's KV is saved
        only when the slot is given away). Only once the engine loop has ended: no request
        waits for the copies, so each is saved whatever recomputing it would cost."""
        for slot in sorted(slots, key=lambda s: s.last_used):  # the most recent stored last
            if slot.running is None:
                self._keep(slot, someone_waits=False)

    def _evict(self, slot: Slot) -> None:
        """Empty a slot; an attention model's KV is saved to the store first where worth it."""
        self._keep(slot)
        self.states.empty(slot)

    def write_back(self, slots: list[Slot], busy: Callable[[], bool]) -> None:
        """Store the full state of each idle slot holding a finished conversation not
        stored yet (the state peers may pull), the most recent first, until `busy()`:
        done while the engine has nothing else to do, so no stream waits for it."""
        unsaved = [s for s in slots if s.running is None and s.unsaved]
        for slot in sorted(unsaved, key=lambda s: s.last_used, reverse=True):
            if busy():
                break
            try:
                self.states.save(slot)
                self.stats.written_back += 1
            except Exception:  # a cached state lost, no request: the engine loop goes on
                logger.exception("storing an idle slot's conversation failed")
                slot.stored()  # not tried again

    def _keep(self, slot: Slot, *, someone_waits: bool = True) -> None:
        """Save a slot's state before it is given away, where that is worth it: an attention
        slot's KV, a hybrid slot's finished conversation not stored yet (its other states
        were anchored or stored as they were computed). While `someone_waits` (the request
        taking the slot pays for the copy) only a copy faster than recomputing is made."""
        if not slot.tokens or not self.config.prefix_cache:
            return
        if self.kind.needs_checkpoints and not slot.unsaved:
            return
        tokens = slot.tokens
        stored = self.states.prefixing(tokens, len(tokens), touch=False, chain=slot.chain)
        stored_tokens = stored.n_tokens if stored is not None else 0
        if stored_tokens >= len(tokens):
            return
        if stored_tokens and someone_waits:
            extra, nbytes = len(tokens) - stored_tokens, self.states.state_bytes(len(tokens))
            speeds = self.stats.prefill_speed, self.stats.save_bytes_per_s
            if not worth_saving(extra, nbytes, *speeds):
                return  # the request taking the slot would wait longer for the copy
        self.states.save(slot)

    def rewind_to_prompt(self, run: Running) -> None:
        """Bring the slot back to an exact state within its prompt, dropping decode-time state."""
        slot, n_prompt = run.slot, len(run.prompt)
        if len(slot.tokens) <= n_prompt:
            return
        if not self.kind.needs_checkpoints:
            self.states.cut(slot, n_prompt)
            return
        chain = slot.chain  # the prompt's
        anchor = max((n for n in slot.anchors if n <= n_prompt), default=0)
        checkpoint = None
        if anchor < n_prompt - MIN_PIECE:  # the usual anchor, two tokens before the end
            checkpoint = self.states.prefixing(run.prompt, n_prompt, chain=chain)
        if checkpoint is not None and checkpoint.n_tokens > anchor:
            if not self.states.restore(slot, checkpoint, chain):
                self.states.empty(slot)
        elif not anchor or not self.states.rewind(slot, anchor):
            self.states.empty(slot)

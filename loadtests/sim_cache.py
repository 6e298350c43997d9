"""A simulated replica's prefix cache: checkpoints under a byte budget, least recently used
evicted first, each found by the prompt segments it covers."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class SimCheckpoint:
    """A stored state: the prompt segments it covers (keys, cumulative lengths), its block
    hashes (what the index lists) and its size."""

    keys: list[int]
    lengths: list[int]
    chain: list[bytes]
    nbytes: int


class SimPrefixCache:
    """Checkpoints under a byte budget, least recently used evicted first."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self._lru: OrderedDict[int, SimCheckpoint] = OrderedDict()
        self._by_key: dict[int, set[int]] = {}
        self._blocks: dict[bytes, int] = {}  # block hash -> checkpoints covering it
        self._ids = itertools.count()

    def match(self, keys: list[int], lengths: list[int]) -> tuple[int, int | None]:
        """The longest prefix of the prompt held (tokens) and the checkpoint holding it."""
        for i in range(len(keys) - 1, -1, -1):
            holders = self._by_key.get(keys[i])
            if holders:
                return lengths[i], max(holders)  # the newest
        return 0, None

    def get(self, cid: int) -> SimCheckpoint:
        """The checkpoint `cid`, now the most recently used."""
        self._lru.move_to_end(cid)
        return self._lru[cid]

    def add(self, checkpoint: SimCheckpoint) -> tuple[int | None, list[bytes]]:
        """Store `checkpoint` (if it fits the budget at all); returns its id and the block
        hashes no checkpoint covers any more."""
        if checkpoint.nbytes > self.budget:
            return None, []
        gone: list[bytes] = []
        while self.used + checkpoint.nbytes > self.budget:
            gone += self.remove(next(iter(self._lru)))
        cid = next(self._ids)
        self._lru[cid] = checkpoint
        self.used += checkpoint.nbytes
        for key in checkpoint.keys:
            self._by_key.setdefault(key, set()).add(cid)
        for block in checkpoint.chain:
            self._blocks[block] = self._blocks.get(block, 0) + 1
        return cid, [b for b in gone if b not in self._blocks]

    def remove(self, cid: int) -> list[bytes]:
        checkpoint = self._lru.pop(cid, None)
        if checkpoint is None:
            return []
        self.used -= checkpoint.nbytes
        for key in checkpoint.keys:
            holders = self._by_key[key]
            holders.discard(cid)
            if not holders:
                del self._by_key[key]
        gone = []
        for block in checkpoint.chain:
            self._blocks[block] -= 1
            if not self._blocks[block]:
                del self._blocks[block]
                gone.append(block)
        return gone

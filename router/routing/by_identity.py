"""A map keyed by an object's identity that never outlives the object.

Ray's routing objects (`RequestMetadata`, `PendingRequest`) are unhashable dataclasses, so a
router that wants to remember something per request is tempted to key by `id(obj)`. That id
is reused by the next object allocated at the same address once the first is freed, and a
plain `dict[int, ...]` then hands the successor its predecessor's value. This map holds a
weak reference beside each value, answers only for the very object that was stored, and
drops the entry when that object is freed.
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByIdentity(Generic[K, V]):
    """`obj → value` by identity, weakly held (`obj` must support weak references)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[K], V]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, obj: K) -> V | None:
        entry = self._entries.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def put(self, obj: K, value: V) -> None:
        key = id(obj)

        def freed(ref: weakref.ref[K]) -> None:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]

        self._entries[key] = (weakref.ref(obj, freed), value)

    def pop(self, obj: K) -> V | None:
        value = self.get(obj)
        if value is not None:
            del self._entries[id(obj)]
        return value

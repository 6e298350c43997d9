"""Open a checkpoint index by name: "embedded" (a Ray actor) or a Redis address.

Apart from `index` (the contract both backends implement) so that the backends import the
contract and this module imports the backends — no cycle.
"""

from __future__ import annotations

from typing import Any

from baton_serve.cache_store.index.embedded_index import EmbeddedIndex
from baton_serve.cache_store.index.index import EMBEDDED_SPEC, CheckpointIndex
from baton_serve.cache_store.index.redis_address import REDIS_FORMS, is_redis_address
from baton_serve.cache_store.index.redis_index import RedisIndex


async def connect_index(spec: str, fingerprint: bytes, **settings: Any) -> CheckpointIndex:
    """Open the index named by `spec`: "embedded" (a Ray actor) or a Redis address (one
    server, a Sentinel-watched master or a Cluster: `redis_address` lists the forms).

    `settings` are the backend's keyword arguments (`IndexSettings` fields and its own).
    """
    if spec == EMBEDDED_SPEC:
        return await EmbeddedIndex.connect(fingerprint, **settings)
    if is_redis_address(spec):
        return RedisIndex(spec, fingerprint, **settings)
    raise ValueError(f"unknown index {spec!r}: expected {EMBEDDED_SPEC!r} or {REDIS_FORMS}")


async def connect_cluster_index(spec: str, fingerprint: bytes, **settings: Any) -> CheckpointIndex:
    """`connect_index` for Serve replicas and routers: the embedded actor is detached, so
    it outlives whichever replica happened to create it."""
    if spec == EMBEDDED_SPEC:
        settings = {"detached": True, **settings}
    return await connect_index(spec, fingerprint, **settings)

"""The router's per-request records follow the request object, never a reused `id()`."""

from __future__ import annotations

import asyncio
import gc

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.router.routing.by_identity import ByIdentity
from baton_serve.router.routing.request_router import BatonRouter

DEPLOYMENT = DeploymentID(name="Replica", app_name="plans")


class _Replica:
    """What `BatonRouter` reads of a `RunningReplica`: its id and routing stats."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats: dict = {}


def _metadata_at(address: int) -> tuple[RequestMetadata | None, list[RequestMetadata]]:
    """A new `RequestMetadata` whose id() is `address` (CPython reuses a freed object's
    memory) or None if none was, and the others made while looking (keep them alive)."""
    made = []
    for _ in range(10_000):
        metadata = RequestMetadata(request_id="B", internal_request_id="B")
        if id(metadata) == address:
            return metadata, made
        made.append(metadata)
    return None, made


def test_a_plan_is_not_handed_to_a_later_request_that_reuses_the_id() -> None:
    """Request A is ranked (its plan recorded) and dropped unsent; request B, a call that
    carries no prompt, gets a metadata object at A's old address and is sent to the other
    replica. Keyed by id(), B's routing moved A's plan there: the ledger claimed that
    replica would hold A's prefix."""
    replicas = [_Replica("a"), _Replica("b")]
    tokens = tuple(range(640))
    chain = tuple(PrefixHasher(b"fp", 64).chain(tokens))
    request = ReplicaRequest(
        generation=GenerationRequest(prompt=Prompt(tokens=tokens)), prefix_hashes=chain
    )

    async def scenario() -> set[str] | None:
        router = BatonRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(
            index="redis://127.0.0.1:1", fingerprint_hex="ab" * 32, follow_index=False
        )
        metadata = RequestMetadata(request_id="A", internal_request_id="A")
        pending = PendingRequest(args=[request], kwargs={}, metadata=metadata)
        ranks = await router.choose_replicas(replicas, pending)
        first = ranks[0][0]
        other = next(r for r in replicas if r is not first)
        address = id(metadata)
        del metadata, pending
        gc.collect()
        reused, _alive = _metadata_at(address)
        if reused is None:
            return None  # another object took the freed memory this time
        later = PendingRequest(args=["not a ReplicaRequest"], kwargs={}, metadata=reused)
        await router.choose_replicas([other], later)
        router.request_routed(later, other)
        return set(router._ledger.lookup(chain)) - {first.replica_id.unique_id}

    # Whether CPython hands the freed address to a new RequestMetadata depends on what else
    # allocates meanwhile: try a few times; every time it does, the plan must not follow.
    outcomes = [asyncio.run(scenario()) for _ in range(5)]
    reused = [outcome for outcome in outcomes if outcome is not None]
    if not reused:
        pytest.skip("CPython reused no freed RequestMetadata's address in 5 tries")
    assert all(outcome == set() for outcome in reused)


def test_an_entry_goes_when_its_object_is_freed() -> None:
    class Key:
        pass

    by_identity: ByIdentity[Key, str] = ByIdentity()
    kept, dropped = Key(), Key()
    by_identity.put(kept, "kept")
    by_identity.put(dropped, "dropped")
    del dropped
    gc.collect()
    assert len(by_identity) == 1 and by_identity.get(kept) == "kept"
    assert by_identity.get(Key()) is None
    assert by_identity.pop(kept) == "kept" and len(by_identity) == 0


def test_the_plan_is_set_for_the_replica_ray_picked() -> None:
    """Ray may send a request to a replica of a later rank (the first was full): the plan
    on the request it sends is that replica's, and the ledger counts it there."""
    replicas = [_Replica("a"), _Replica("b")]
    tokens = tuple(range(640))
    request = ReplicaRequest(
        generation=GenerationRequest(prompt=Prompt(tokens=tokens)),
        prefix_hashes=tuple(PrefixHasher(b"fp", 64).chain(tokens)),
    )

    async def scenario() -> tuple[str, PendingRequest]:
        router = BatonRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(
            index="redis://127.0.0.1:1", fingerprint_hex="ab" * 32, follow_index=False
        )
        metadata = RequestMetadata(request_id="A", internal_request_id="A")
        pending = PendingRequest(args=[request], kwargs={}, metadata=metadata)
        ranks = await router.choose_replicas(replicas, pending)
        second = ranks[1][0]
        router.request_routed(pending, second)
        assert router._ledger.load(second.replica_id.unique_id) == 1
        assert router._ledger.load(ranks[0][0].replica_id.unique_id) == 0
        return second.replica_id.unique_id, pending

    picked, pending = asyncio.run(scenario())
    sent = pending.args[0]
    assert sent.plan is not None and sent.plan.replica_id == picked
    assert sent.plan.kind == "compute" and sent.generation == request.generation
    assert request.plan is None  # the gateway's request itself is left as it was

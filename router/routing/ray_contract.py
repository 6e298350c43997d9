"""What Baton's request routers rely on in Ray Serve beyond its public API, checked against
the installed Ray.

`SafeRequestRouter` overrides private methods of `RequestRouter` (so two sibling calls that
share an internal request id are both routed) and calls others, and every router reads
fields of Ray's routing dataclasses. A Ray upgrade may rename, drop or stop calling any of
it, and an override of a method Ray no longer calls fails silently: the sibling-call hang
comes back. `check_ray_contract` fails loudly instead, naming each thing that changed; a
router checks it when it is made, and tests/test_ray_contract.py pins it in the suite.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, fields, is_dataclass


class RayContractError(RuntimeError):
    """The installed Ray Serve lacks, or changed, something Baton's router relies on."""


@dataclass(frozen=True)
class Method:
    """A method of `RequestRouter`: its parameters after `self`, and whether Baton overrides
    it (then Ray's own code must still call it, or the override is dead)."""

    name: str
    params: tuple[str, ...]
    overridden: bool


METHODS = (
    # private: SafeRequestRouter's matching of a pending request by its metadata object
    Method("_add_pending_request_to_indices", ("pending_request",), overridden=True),
    Method("_remove_pending_request_from_indices", ("pending_request",), overridden=True),
    Method("_fulfill_next_pending_request", ("replica", "request_metadata"), overridden=True),
    Method("_cancel_routing_task_for_pending_request", ("pending_request",), overridden=False),
    Method("_record_queue_wait_time", ("pending_request",), overridden=False),
    # public hooks, pinned too: a renamed parameter breaks a keyword call
    Method("choose_replicas", ("candidate_replicas", "pending_request"), overridden=False),
    Method("initialize_state", ("kwargs",), overridden=False),
    Method("on_request_completed", ("replica_id", "internal_request_id"), overridden=False),
    Method("on_replica_actor_died", ("replica_id",), overridden=False),
)

# Fields of Ray's routing dataclasses that Baton's routers read or set.
FIELDS = {
    "PendingRequest": ("args", "kwargs", "metadata", "future", "routing_context"),
    "RequestMetadata": ("request_id", "internal_request_id"),
    "RequestRoutingContext": ("should_backoff",),
    "ReplicaID": ("unique_id",),
}
RUNNING_REPLICA_ATTRIBUTES = ("replica_id", "routing_stats")


def _classes() -> dict[str, type]:
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import RequestRoutingContext
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

    return {
        "RequestRouter": RequestRouter,
        "RunningReplica": RunningReplica,
        "PendingRequest": PendingRequest,
        "RequestMetadata": RequestMetadata,
        "RequestRoutingContext": RequestRoutingContext,
        "ReplicaID": ReplicaID,
    }


def problems(classes: dict[str, type] | None = None) -> list[str]:
    """Each way the Ray classes (the installed ones by default) break the contract."""
    classes = classes or _classes()
    router = classes["RequestRouter"]
    found = []
    try:  # where Ray calls the methods Baton overrides
        ray_source: str | None = inspect.getsource(inspect.getmodule(router))
    except (OSError, TypeError):  # installed without its sources: that check is skipped
        ray_source = None
    for method in METHODS:
        what = f"RequestRouter.{method.name}"
        function = getattr(router, method.name, None)
        if not callable(function):
            found.append(f"{what} is gone")
            continue
        params = tuple(inspect.signature(function).parameters)[1:]
        if params != method.params:
            found.append(f"{what} takes {params}, not {method.params}")
        if method.overridden and ray_source and f"self.{method.name}(" not in ray_source:
            found.append(f"{what} is no longer called by Ray (Baton's override would be dead)")
    for name, wanted in FIELDS.items():
        cls = classes[name]
        have = {f.name for f in fields(cls)} if is_dataclass(cls) else set()
        found += [f"{name}.{field} is gone" for field in wanted if field not in have]
    replica = classes["RunningReplica"]
    found += [
        f"RunningReplica.{a} is gone" for a in RUNNING_REPLICA_ATTRIBUTES if not hasattr(replica, a)
    ]
    if not hasattr(classes["RequestMetadata"], "__weakref__"):
        found.append("RequestMetadata takes no weak references (router.by_identity needs them)")
    return found


@functools.cache
def check_ray_contract() -> None:
    """Raise `RayContractError` naming everything the installed Ray no longer provides."""
    found = problems()
    if found:
        import ray

        raise RayContractError(
            f"Baton's request router does not fit Ray {ray.__version__}: " + "; ".join(found)
        )

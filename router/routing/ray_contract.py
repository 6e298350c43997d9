"""What Baton's request routers rely on in Ray Serve beyond its public API, checked against
the installed Ray.

`SafeRequestRouter` overrides private methods of `RequestRouter` (so two sibling calls that
share an internal request id are both routed) and calls others, and every router reads
fields of Ray's routing dataclasses. A Ray upgrade may rename, drop or stop calling any of
it, and an override of a method Ray no longer calls fails silently: the sibling-call hang
comes back. The router's plan reaches the replica only because Ray sends the very pending
request it routed, with its `args` (a list) as they are once routed (`plan_delivery`): a Ray
that copied them first would drop every plan. `check_ray_contract` fails loudly instead,
naming each thing that changed; a router checks it when it is made, and
tests/test_ray_contract.py pins it in the suite.
"""

from __future__ import annotations

import functools
import inspect
import typing
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


@dataclass(frozen=True)
class Statement:
    """Code Ray's `owner.method` must hold (whitespace aside) for the plan to reach the
    replica: what it means, if it is gone."""

    owner: str
    method: str
    code: str
    meaning: str


# How a handle's call is routed and sent (`AsyncioRouter`: every handle's router), and how
# a pending request goes to a replica (an actor call, or gRPC).
DELIVERY = (
    Statement(
        "AsyncioRouter",
        "_route_and_send_request_once",
        "_choose_replica_for_request(pr,",
        "Ray routes the pending request it sends",
    ),
    Statement(
        "AsyncioRouter",
        "_route_and_send_request_once",
        "try_send_request(pr,",
        "Ray sends the pending request it routed",
    ),
    Statement(
        "ActorReplicaWrapper",
        "send_request_python",
        "*pr.args",
        "an actor call sends the pending request's args as they are once routed",
    ),
    Statement(
        "gRPCReplicaWrapper",
        "send_request_python",
        "dumps_request(pr.args)",
        "a gRPC call sends the pending request's args as they are once routed",
    ),
)


def _classes() -> dict[str, type]:
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import RequestRoutingContext
    from ray.serve._private.request_router.replica_wrapper import (
        ActorReplicaWrapper,
        gRPCReplicaWrapper,
    )
    from ray.serve._private.router import AsyncioRouter
    from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

    return {
        "RequestRouter": RequestRouter,
        "RunningReplica": RunningReplica,
        "PendingRequest": PendingRequest,
        "RequestMetadata": RequestMetadata,
        "RequestRoutingContext": RequestRoutingContext,
        "ReplicaID": ReplicaID,
        "AsyncioRouter": AsyncioRouter,
        "ActorReplicaWrapper": ActorReplicaWrapper,
        "gRPCReplicaWrapper": gRPCReplicaWrapper,
    }


def _source(function: object) -> str | None:
    """`function`'s source with all whitespace removed; None where Ray has no sources."""
    try:
        return "".join(inspect.getsource(function).split())  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def _annotation(cls: type, name: str) -> object:
    """The type of `cls`'s field `name`, resolved where Ray's module lets it be."""
    try:
        return typing.get_type_hints(cls).get(name)
    except (NameError, TypeError):  # not resolvable here: as written
        return next((f.type for f in fields(cls) if f.name == name), None)


def _is_list(annotation: object) -> bool:
    if isinstance(annotation, str):
        return annotation.split("[")[0] in ("list", "List", "typing.List")
    return annotation is list or typing.get_origin(annotation) is list


def delivery_problems(classes: dict[str, type]) -> list[str]:
    """Each way the Ray classes would drop the plan `plan_delivery` puts on a request."""
    found = []
    args = _annotation(classes["PendingRequest"], "args")
    if not _is_list(args):
        found.append(f"PendingRequest.args is {args}, not a list the router can put a plan in")
    for statement in DELIVERY:
        what = f"{statement.owner}.{statement.method}"
        function = getattr(classes[statement.owner], statement.method, None)
        if not callable(function):
            found.append(f"{what} is gone (it is how Ray sends a routed request)")
            continue
        source = _source(function)
        if source is not None and "".join(statement.code.split()) not in source:
            found.append(
                f"{what} no longer holds `{statement.code}`: the plan on a request relies on "
                f"it ({statement.meaning})"
            )
    return found


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
    return found + delivery_problems(classes)


@functools.cache
def check_ray_contract() -> None:
    """Raise `RayContractError` naming everything the installed Ray no longer provides."""
    found = problems()
    if found:
        import ray

        raise RayContractError(
            f"Baton's request router does not fit Ray {ray.__version__}: " + "; ".join(found)
        )

"""The router's plan put on the request Ray sends: the one place that does it, and that says
so when it cannot.

Ray Serve (2.60) gives a custom `RequestRouter` no supported way to hand data to the replica
it picks: a replica receives the caller's arguments and Ray's own request metadata, nothing
the router chose. So the plan rides in the request itself. `BatonRouter.request_routed` runs
after Ray picked the replica and before it sends the pending request, whose `args` Ray sends
as they are then; their first is the gateway's `ReplicaRequest`, and `attach_plan` replaces
it with a copy carrying the plan (the gateway's own is left as it was).

`ray_contract` checks when a router is made that the installed Ray still routes and sends
that way; `attach_plan` checks each request. When the shape is not the one relied on (the
arguments are not a list, or their first is not a `ReplicaRequest`), or the router holds no
plan for the replica Ray picked, it attaches nothing, logs a warning (once per reason in a
process: a changed Ray would otherwise log on every request) and counts every one in
`baton_router_plans_unattached{reason}`. The replica, which then decides itself, counts the
request too (`replicas/plan_receipt.py`). Module state lives here, not in `request_router`:
Ray ships a router's module to callers by value (see `routing_metrics`).
"""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest

from baton_serve.cache_store.telemetry.logs import request_fields
from baton_serve.cache_store.wire.protocol import ReplicaRequest
from baton_serve.cache_store.wire.route_plan import RoutePlan
from baton_serve.router.routing.routing_metrics import record_unattached_plan

logger = logging.getLogger("baton.router")

ARGS_NOT_A_LIST = "args_not_a_list"
NO_REQUEST_FIRST = "no_replica_request_first"
REPLICA_NOT_RANKED = "replica_not_ranked"
WHY = {
    ARGS_NOT_A_LIST: "Ray's pending request holds its arguments in something other than a list",
    NO_REQUEST_FIRST: "the first argument Ray sends is no longer the gateway's ReplicaRequest",
    REPLICA_NOT_RANKED: "Ray sent it to a replica this router did not rank",
}

_warned: set[str] = set()  # reasons already logged in this process


def attach_plan(pending_request: PendingRequest, plan: RoutePlan | None) -> bool:
    """Put `plan` on the `ReplicaRequest` Ray is about to send (`pending_request.args[0]`).
    False when it cannot (`plan` None: the router has none for the replica Ray picked),
    each time counted, and warned of once per reason."""
    args = pending_request.args
    if plan is None:
        reason = REPLICA_NOT_RANKED
    elif not isinstance(args, list):
        reason = ARGS_NOT_A_LIST
    elif not args or not isinstance(args[0], ReplicaRequest):
        reason = NO_REQUEST_FIRST
    else:
        args[0] = args[0].model_copy(update={"plan": plan})
        return True
    record_unattached_plan(reason)
    if reason not in _warned:
        _warned.add(reason)
        logger.warning(
            "routing plan not delivered (%s): %s. Its replica decides again (an index lookup); "
            "every such request is counted in baton_router_plans_unattached (this warning is "
            "logged once per process)",
            reason,
            WHY[reason],
            extra=request_fields(pending_request.metadata.request_id),
        )
    return False

"""Whether a request came with the router's plan for this replica.

Under Baton's router every `ReplicaRequest` should reach its replica with that replica's
plan on it (`router/routing/plan_delivery.py` puts it there). One without — no plan, or the
plan of another replica — is decided here again, which works but costs an index lookup and
may pull what the router did not count, so it is never silent: each is counted by reason
(`none`, `other_replica`) in `baton_plans_missing{reason}` and `ReplicaStats.plans_missing`,
and logged at most once every `LOG_EVERY_S` (a Ray that stopped carrying plans would
otherwise log on every request), with the count since the last line. Under another router
(`router: pow2`, ...) no plan is expected and nothing is counted.
"""

from __future__ import annotations

import logging
import time

from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.telemetry.logs import request_fields
from baton_serve.cache_store.wire.protocol import ReplicaRequest
from baton_serve.cache_store.wire.route_plan import RoutePlan

logger = logging.getLogger("baton.replica")

LOG_EVERY_S = 60.0
NO_PLAN, OTHER_REPLICA = "none", "other_replica"


class PlanReceipt:
    """Reads the plan off each request for `replica_id`; when plans are `expected` (Baton's
    router), counts each request without one into `counts` (by reason) and logs it."""

    def __init__(self, replica_id: str, *, expected: bool, counts: dict[str, int]) -> None:
        self.replica_id = replica_id
        self.expected = expected
        self.counts = counts
        self._unlogged = 0
        self._logged_at: float | None = None  # time.monotonic()

    def plan_for_here(self, request: ReplicaRequest) -> RoutePlan | None:
        """The request's plan if it is this replica's; None otherwise (then counted)."""
        plan = request.plan
        if plan is not None and plan.replica_id == self.replica_id:
            return plan
        if self.expected:
            self._missing(NO_PLAN if plan is None else OTHER_REPLICA, request)
        return None

    def _missing(self, reason: str, request: ReplicaRequest) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        metrics.PLANS_MISSING.inc(reason=reason)
        self._unlogged += 1
        now = time.monotonic()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            return
        logger.warning(
            "%d request(s) from Baton's router came without this replica's plan (this one: "
            "%s) since the last such line: each is decided here again (an index lookup); "
            "counted in baton_plans_missing",
            self._unlogged,
            reason,
            extra=request_fields(request.generation.request_id),
        )
        self._unlogged, self._logged_at = 0, now

"""The router's decision for one request, carried to the replica it chose."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

CACHED, IN_FLIGHT, PULL, COMPUTE = "cached", "in_flight", "pull", "compute"
PlanKind = Literal["cached", "in_flight", "pull", "compute"]


class RoutePlan(BaseModel):
    """How `replica_id` gets the prompt's prefix: it holds `reused_tokens` of it (`cached`),
    is computing them (`in_flight`), pulls them from `donor_id` (`pull`: the donor's state of
    `donor_tokens` tokens, `nbytes`, expected at Unix time `ready_at`, 0 if held now), or
    computes the prompt (`compute`). `start_at`: for a pull, the Unix time the router expected
    `replica_id` could start computing the prompt itself, after its queue (0: at once) — a
    pull may wait for the donor's state until then, and the usual budget after."""

    model_config = ConfigDict(frozen=True)

    replica_id: str
    kind: PlanKind
    reused_tokens: int = 0
    donor_id: str | None = None
    donor_tokens: int = 0
    nbytes: int = 0
    ready_at: float = 0.0
    start_at: float = 0.0

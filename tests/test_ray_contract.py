"""Baton's router against the installed Ray Serve: every private method it overrides or calls,
and every field it reads, is still there with the same parameters, and Ray still sends the
pending request the router put its plan on (`router.ray_contract`)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from baton_serve.router.routing import ray_contract
from baton_serve.router.routing.ray_contract import (
    DELIVERY,
    METHODS,
    RayContractError,
    problems,
)
from baton_serve.router.routing.request_router import BatonRouter


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_the_installed_ray_has_each_method_the_router_relies_on(method) -> None:
    found = [p for p in problems() if f"RequestRouter.{method.name} " in p]
    assert not found, "; ".join(found)


def test_the_installed_ray_fits_the_whole_contract() -> None:
    assert problems() == []


def _changed_ray(name: str, replacement: object = None) -> dict[str, type]:
    """The installed Ray's classes, with `RequestRouter.<name>` gone (None) or replaced: the
    only way to see a Ray that changed, short of installing another release."""
    classes = ray_contract._classes()
    router = classes["RequestRouter"]
    attributes = {name: replacement, "__module__": router.__module__}
    classes["RequestRouter"] = type("RequestRouter", (router,), attributes)
    return classes


def test_a_missing_or_changed_method_is_named() -> None:
    gone = problems(_changed_ray("_fulfill_next_pending_request"))
    assert gone == ["RequestRouter._fulfill_next_pending_request is gone"]

    def fulfill(self, replica, metadata=None): ...  # a renamed parameter

    changed = problems(_changed_ray("_fulfill_next_pending_request", fulfill))
    assert changed == [
        "RequestRouter._fulfill_next_pending_request takes ('replica', 'metadata'), "
        "not ('replica', 'request_metadata')"
    ]


@pytest.mark.parametrize("statement", DELIVERY, ids=lambda s: f"{s.owner}-{s.code}")
def test_the_installed_ray_sends_the_request_the_plan_was_put_on(statement) -> None:
    """Each statement of Ray's that carries the plan to the replica is in the installed Ray."""
    what = f"{statement.owner}.{statement.method} "
    found = [p for p in problems() if p.startswith(what)]
    assert not found, "; ".join(found)


def test_a_ray_that_would_drop_the_plan_is_named() -> None:
    """A Ray whose router sends a copy of the pending request it routed (the plan is on the
    one routed), and one whose pending requests hold their arguments in a tuple: built here
    from the installed classes, the only way to see such a Ray short of installing one."""
    classes = ray_contract._classes()
    ray_router = classes["AsyncioRouter"]

    async def _route_and_send_request_once(self, pr, response_id, is_retry):
        replica = await self._active_request_router._choose_replica_for_request(pr, is_retry)
        return replica.try_send_request(copy.copy(pr), with_rejection=False)

    classes["AsyncioRouter"] = type(
        "AsyncioRouter",
        (ray_router,),
        {"_route_and_send_request_once": _route_and_send_request_once},
    )

    @dataclass
    class TuplePendingRequest(classes["PendingRequest"]):
        args: tuple

    classes["PendingRequest"] = TuplePendingRequest
    assert problems(classes) == [
        "PendingRequest.args is <class 'tuple'>, not a list the router can put a plan in",
        "AsyncioRouter._route_and_send_request_once no longer holds `try_send_request(pr,`: "
        "the plan on a request relies on it (Ray sends the pending request it routed)",
    ]


def test_a_router_refuses_to_start_on_a_ray_that_does_not_fit(monkeypatch) -> None:
    monkeypatch.setattr(ray_contract, "problems", lambda: ["RequestRouter._x is gone"])
    ray_contract.check_ray_contract.cache_clear()
    try:
        with pytest.raises(RayContractError, match=r"RequestRouter\._x is gone"):
            BatonRouter(
                deployment_id=DeploymentID(name="R", app_name="contract"),
                handle_source=DeploymentHandleSource.UNKNOWN,
            )
    finally:
        ray_contract.check_ray_contract.cache_clear()

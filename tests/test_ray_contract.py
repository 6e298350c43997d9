"""Baton's router against the installed Ray Serve: every private method it overrides or calls,
and every field it reads, is still there with the same parameters (`router.ray_contract`)."""

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from baton_serve.router.routing import ray_contract
from baton_serve.router.routing.ray_contract import METHODS, RayContractError, problems
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

"""Baton's request router against the Ray Serve 2.60 pitfalls measured in RAY_SERVE_NOTES:
sibling calls that hang, routing loops that spin without backoff, exceptions that hang a
request — each reproduced in a real Serve app, plus every routing policy serving."""

from __future__ import annotations

import asyncio
import secrets
import sys
import time

import httpx
import pytest
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.deploy.app import build_app
from baton_serve.deploy.config import BatonConfig, RouterPolicy
from baton_serve.loadtests.serve_app import replica_stats
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.routing.routing_metrics import decision_counts

# Serve's workers cannot import this test module: ship its deployment classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROUTER = RequestRouterConfig(
    request_router_class="baton_serve.router.routing.request_router:BatonRouter",
    request_router_kwargs={"index": "embedded", "fingerprint_hex": "ab" * 32},
)


def _request(hashes: tuple[bytes, ...] = ()) -> ReplicaRequest:
    return ReplicaRequest(
        generation=GenerationRequest(prompt=Prompt(tokens=(1, 2, 3))), prefix_hashes=hashes
    )


# No logical CPUs: the session's cluster has two, kept for the apps of other tests.
@serve.deployment(
    max_ongoing_requests=1, request_router_config=ROUTER, ray_actor_options={"num_cpus": 0}
)
class Worker:
    async def work(self, request: ReplicaRequest, delay_s: float = 0.0) -> str:
        await asyncio.sleep(delay_s)
        return serve.get_replica_context().replica_id.unique_id


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Caller:
    """Calls `Worker` through a handle, so Baton's router runs in this replica's process."""

    def __init__(self, worker: DeploymentHandle) -> None:
        self.worker = worker

    def decisions(self) -> dict[str, int]:
        return decision_counts()

    async def siblings(self) -> list[str]:
        # Two concurrent child calls of one parent request share its internal request id.
        return list(
            await asyncio.gather(
                self.worker.work.remote(_request()), self.worker.work.remote(_request())
            )
        )

    async def crowd(self, n: int, delay_s: float) -> list[str]:
        return list(
            await asyncio.gather(*(self.worker.work.remote(_request(), delay_s) for _ in range(n)))
        )

    async def malformed(self) -> str:
        return await self.worker.work.remote(_request(hashes=(b"\x01\x02\x03",)))


@serve.deployment(
    num_replicas=2,
    max_ongoing_requests=1,
    request_router_config=ROUTER,
    ray_actor_options={"num_cpus": 0},
)
class Planned:
    async def planned(self, request: ReplicaRequest) -> tuple[str, dict | None]:
        """Which replica got `request`, and the plan it came with."""
        await asyncio.sleep(0.05)
        plan = request.plan.model_dump() if request.plan else None
        return serve.get_replica_context().replica_id.unique_id, plan


@serve.deployment(ray_actor_options={"num_cpus": 0})
class PlanCaller:
    def __init__(self, planned: DeploymentHandle) -> None:
        self.planned = planned

    async def burst(self, n: int) -> list[tuple[str, dict | None]]:
        return list(
            await asyncio.gather(*(self.planned.planned.remote(_request()) for _ in range(n)))
        )


def test_the_plan_reaches_the_replica_that_serves_the_request(serve_port) -> None:
    """Baton's router puts its plan on the request before Ray sends it, for the replica Ray
    picked — whichever rank that was (one slot each: a burst spills over)."""
    handle = serve.run(PlanCaller.bind(Planned.bind()), name="router-plans", route_prefix=None)
    try:
        served = handle.burst.remote(8).result(timeout_s=60)
    finally:
        serve.delete("router-plans")
    assert len({rid for rid, _ in served}) == 2
    for rid, plan in served:
        assert plan is not None and plan["replica_id"] == rid and plan["kind"] == "compute"


@pytest.fixture(scope="module")
def caller(serve_port) -> DeploymentHandle:
    handle = serve.run(Caller.bind(Worker.bind()), name="router-pitfalls", route_prefix=None)
    yield handle
    serve.delete("router-pitfalls")


def test_sibling_calls_of_one_request_both_complete(caller) -> None:
    assert len(caller.siblings.remote().result(timeout_s=30)) == 2


def test_a_full_deployment_is_polled_with_backoff_not_spun(caller) -> None:
    before = sum(caller.decisions.remote().result().values())
    started = time.monotonic()
    # one slot, three 1-second calls: two wait about 1 s and 2 s in the router
    assert len(caller.crowd.remote(3, 1.0).result(timeout_s=60)) == 3
    elapsed = time.monotonic() - started
    calls = sum(caller.decisions.remote().result().values()) - before
    assert elapsed >= 2.5
    assert calls < 100, f"{calls} routing decisions while waiting {elapsed:.1f} s"


def test_an_exception_while_routing_falls_back_instead_of_hanging(caller) -> None:
    before = caller.decisions.remote().result().get("error_fallback", 0)
    assert caller.malformed.remote().result(timeout_s=30)
    assert caller.decisions.remote().result().get("error_fallback", 0) == before + 1


# Ray's own routers: Baton's serves (with its plans) in every other app test, and round
# robin in test_routing_bench.py's.
@pytest.mark.parametrize("policy", [RouterPolicy.POW2, RouterPolicy.PREFIX_AFFINITY])
def test_rays_routing_policies_serve(policy, serve_port, tiny_model) -> None:
    config = BatonConfig(
        model=str(tiny_model("llama")),
        replicas=2,
        num_cpus_per_replica=0.5,
        engine=EngineConfig(n_ctx=512, n_slots=1, n_threads=1),
        router=policy,
        hmac_key=secrets.token_hex(16),
    )
    name = f"policy-{policy.value}"
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    try:
        base = f"http://127.0.0.1:{serve_port}/{name}"
        for body in (
            {
                "model": config.served_model_name,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            {"model": config.served_model_name, "prompt": "Once upon", "max_tokens": 4},
        ):
            path = "chat/completions" if "messages" in body else "completions"
            response = httpx.post(f"{base}/v1/{path}", json=body, timeout=60)
            assert response.status_code == 200, response.text
        # under another router than Baton's no plan is expected, and none is counted missing
        assert [s["plans_missing"] for s in asyncio.run(replica_stats(name))] == [{}, {}]
    finally:
        serve.delete(name)

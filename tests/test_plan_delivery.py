"""The router's plan is never dropped silently: where the router cannot put it on the request
Ray sends, it warns and counts (`router.routing.plan_delivery`); a replica under Baton's
router that receives a request without its plan counts and logs it (`replicas.plan_receipt`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from baton_serve.cache_store.prefix_hash import PrefixHasher
from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest, ReplicaRequest
from baton_serve.cache_store.wire.route_plan import COMPUTE, RoutePlan
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.replicas.engine.engine import Engine
from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.replicas.plan_receipt import NO_PLAN, OTHER_REPLICA, PlanReceipt
from baton_serve.replicas.replica import Replica
from baton_serve.router.routing import plan_delivery
from baton_serve.router.routing.plan_delivery import (
    ARGS_NOT_A_LIST,
    NO_REQUEST_FIRST,
    REPLICA_NOT_RANKED,
    attach_plan,
)
from baton_serve.router.routing.request_router import BatonRouter
from baton_serve.router.routing.routing_metrics import unattached_plan_counts

DEPLOYMENT = DeploymentID(name="Replica", app_name="plan-delivery")
HMAC_KEY = b"test-cluster-key"


class _Replica:
    """What `BatonRouter` reads of a `RunningReplica`: its id and routing stats."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)
        self.routing_stats: dict = {}


def _request(tokens: tuple[int, ...], plan: RoutePlan | None = None) -> ReplicaRequest:
    generation = GenerationRequest(
        prompt=Prompt(tokens=tokens), sampling=SamplingParams(max_tokens=2, ignore_eos=True)
    )
    return ReplicaRequest(
        generation=generation, prefix_hashes=tuple(PrefixHasher(b"fp", 64).chain(tokens)), plan=plan
    )


def _pending(args: object, request_id: str) -> PendingRequest:
    metadata = RequestMetadata(request_id=request_id, internal_request_id=request_id)
    return PendingRequest(args=args, kwargs={}, metadata=metadata)  # type: ignore[arg-type]


def _counted_since(before: dict[str, int]) -> dict[str, int]:
    now = unattached_plan_counts()
    return {k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0)}


@pytest.fixture
def router_warnings(monkeypatch, caplog) -> Callable[[], list[str]]:
    """Warnings of `baton.router`, with the once-per-process record emptied for this test."""
    monkeypatch.setattr(plan_delivery, "_warned", set())
    caplog.set_level(logging.WARNING, logger="baton.router")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "baton.router"]


def test_a_plan_that_cannot_be_attached_is_warned_once_and_counted_each_time(
    router_warnings,
) -> None:
    """The real router ranks and is told where Ray sent each request. Installed Ray makes
    every pending request's arguments a list (`ray_contract` checks it): a tuple here is
    built by hand, the fault of a Ray that changed, and the only way to cause it. A replica
    the router did not rank is a real call of `request_routed`."""
    tokens = tuple(range(640))
    a, b, c = _Replica("a"), _Replica("b"), _Replica("c")
    before = unattached_plan_counts()

    async def scenario() -> list[PendingRequest]:
        router = BatonRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(
            index="redis://127.0.0.1:1", fingerprint_hex="ab" * 32, follow_index=False
        )
        sent = []
        for n, (args, to) in enumerate(
            [
                ((_request(tokens),), a),  # a tuple: twice, one warning
                ((_request(tokens),), b),
                ([_request(tokens)], c),  # c was not among the candidates ranked
                ([_request(tokens)], a),  # as relied on: the plan goes on
            ]
        ):
            pending = _pending(args, f"req-{n}")
            await router.choose_replicas([a, b], pending)
            router.request_routed(pending, to)
            sent.append(pending)
        return sent

    sent = asyncio.run(scenario())
    assert _counted_since(before) == {ARGS_NOT_A_LIST: 2, REPLICA_NOT_RANKED: 1}
    assert [arg.plan for p in sent[:3] for arg in p.args] == [None, None, None]
    assert sent[3].args[0].plan is not None and sent[3].args[0].plan.replica_id == "a"
    warnings = router_warnings()
    assert len(warnings) == 2, warnings
    assert ARGS_NOT_A_LIST in warnings[0] and "baton_router_plans_unattached" in warnings[0]
    assert REPLICA_NOT_RANKED in warnings[1]


def test_a_first_argument_that_is_no_replica_request_is_not_replaced(router_warnings) -> None:
    """Were Ray to wrap the arguments after routing, the router would find no
    `ReplicaRequest` to copy: nothing is replaced, and it is warned of and counted."""
    before = unattached_plan_counts()

    async def route() -> tuple[bool, PendingRequest]:  # a pending request has a future
        pending = _pending(["wrapped by a changed Ray"], "req-wrapped")
        return attach_plan(pending, RoutePlan(replica_id="a", kind=COMPUTE)), pending

    attached, pending = asyncio.run(route())
    assert attached is False and pending.args == ["wrapped by a changed Ray"]
    assert _counted_since(before) == {NO_REQUEST_FIRST: 1}
    assert len(router_warnings()) == 1


def test_only_a_replica_under_batons_router_expects_plans() -> None:
    counts: dict[str, int] = {}
    receipt = PlanReceipt("r0", expected=False, counts=counts)
    assert receipt.plan_for_here(_request((1, 2, 3))) is None
    other = RoutePlan(replica_id="r1", kind=COMPUTE)
    assert receipt.plan_for_here(_request((1, 2, 3), other)) is None
    assert counts == {}


def test_a_replica_counts_and_logs_requests_that_come_without_its_plan(
    tiny_model: Callable[[str], Path], caplog
) -> None:
    """A real replica on a real engine, told Baton's router sends its requests: two without
    a plan and one with another replica's are counted by reason, one warning names the
    first (the next ones fall within its minute); one with its own plan is not counted."""
    caplog.set_level(logging.WARNING, logger="baton.replica")
    tokens = tuple(range(1, 40))
    own = RoutePlan(replica_id="r0", kind=COMPUTE)
    other = RoutePlan(replica_id="r1", kind=COMPUTE)
    requests = [_request(tokens), _request(tokens, own), _request(tokens, other), _request(tokens)]

    async def serve(engine: Engine) -> dict[str, int]:
        replica = Replica("r0", engine, expects_plans=True)
        for request in requests:
            await replica.generate(request)
        await replica.close()
        return replica.stats.plans_missing

    config = EngineConfig(n_ctx=256, n_slots=1, n_threads=1)
    with Engine(str(tiny_model("llama")), config, hmac_key=HMAC_KEY) as engine:
        missing = asyncio.run(serve(engine))
    assert missing == {NO_PLAN: 2, OTHER_REPLICA: 1}
    lines = [r for r in caplog.records if r.name == "baton.replica" and "plan" in r.getMessage()]
    assert len(lines) == 1
    assert "baton_plans_missing" in lines[0].getMessage()
    assert lines[0].request_id == requests[0].generation.request_id

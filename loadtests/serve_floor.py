"""Ray Serve's floor for `baton bench gateway`: the same two hops with no Baton code in them.

What a Ray Serve user writes first for a streamed completion: a FastAPI ingress that reads
the request, calls an engine deployment through a `DeploymentHandle` (Ray's default request
router, power of two choices) and streams its one token back as OpenAI SSE events. It runs
on the same kind of local Ray as Baton's app, with the same Serve settings (HAProxy straight
to the ingress replica, gRPC between deployments) and the same load generator, so what
separates it from Baton's added latency is Baton's own work: the OpenAI request handling,
the prompt's blocks and hashes, the prefix-aware router, the index and the engine's
bookkeeping.
"""

# No `from __future__ import annotations`: FastAPI reads the route methods' annotations, and
# as strings in Serve's rewrapped class they no longer resolve (the body becomes a query
# parameter: 422). `serve.ingress` pickles the FastAPI app as it decorates the class, so what
# its routes call is defined above it.

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.deployment import Application
from ray.serve.handle import DeploymentHandle

from baton_serve.deploy.app import GATEWAY_CPUS
from baton_serve.deploy.config import GATEWAY_MAX_ONGOING
from baton_serve.router.gateway.serve_gateway import own_handle

INGRESS_DEPLOYMENT = "FloorIngress"
ENGINE_DEPLOYMENT = "FloorEngine"
TOKEN = "x"
ENGINE_CPUS = 0.01  # Ray CPUs an engine replica asks, so any number fit the machine


async def _events(tokens: AsyncIterator[str], prompt_tokens: int) -> AsyncIterator[str]:
    completion = 0
    async for text in tokens:
        completion += 1
        yield _data({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion}
    yield _data({"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _data(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


_api = FastAPI()


@serve.deployment(name=ENGINE_DEPLOYMENT)
class FloorEngine:
    """Answers at once: one token a request, whatever the prompt."""

    async def generate(self, prompt: list[int]) -> AsyncIterator[str]:
        yield TOKEN


@serve.deployment(name=INGRESS_DEPLOYMENT)
@serve.ingress(_api)
class FloorIngress:
    """`POST /v1/completions` streamed through the engine deployment; `GET /health`."""

    def __init__(self, engine: DeploymentHandle) -> None:
        self._engine = own_handle(engine).options(stream=True)  # gRPC, as Baton's gateway

    @_api.get("/health")
    def health(self) -> dict[str, str]:
        return {"status": "ok", "engine": "ray-serve-floor"}

    @_api.post("/v1/completions")
    async def completions(self, request: Request) -> StreamingResponse:
        body = await request.json()
        tokens = self._engine.generate.remote(body["prompt"])
        return StreamingResponse(
            _events(tokens, len(body["prompt"])), media_type="text/event-stream"
        )


def floor_app(replicas: int, replica_max_ongoing: int) -> Application:
    """One ingress replica (placed and bounded as Baton's gateway) over `replicas` engine
    replicas, each taking `replica_max_ongoing` requests at once (as Baton's replicas in the
    bench) and a hundredth of a CPU, so any number fit the machine."""
    engine = FloorEngine.options(
        num_replicas=replicas,
        max_ongoing_requests=replica_max_ongoing,
        ray_actor_options={"num_cpus": ENGINE_CPUS},
    )
    ingress = FloorIngress.options(
        num_replicas=1,
        max_ongoing_requests=GATEWAY_MAX_ONGOING,
        ray_actor_options={"num_cpus": GATEWAY_CPUS},
    )
    return ingress.bind(engine.bind())

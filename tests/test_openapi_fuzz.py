"""Schemathesis against the gateway's own OpenAPI schema, over real HTTP, with a real engine
behind it: whatever a client sends, the answer is never a 5xx."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import schemathesis
from gateway_harness import serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from baton_serve.replicas.engine.engine_config import EngineConfig
from baton_serve.router.gateway.gateway import GatewaySettings

MODEL = "baton-tiny"
EXAMPLES_PER_OPERATION = 40
N_CTX = 512
MAX_TOKENS_CAP = 8  # keeps generated requests short; larger asks get a 400


def test_no_generated_request_gets_a_server_error(tiny_model: Callable[[str], Path]) -> None:
    # Schemathesis's pytest integration (`from_fixture`) does not run under pytest 9, so each
    # operation's strategy is driven by Hypothesis directly.
    gateway = GatewaySettings(
        MODEL, str(tiny_model("qwen35")), n_ctx=N_CTX, max_tokens_cap=MAX_TOKENS_CAP
    )
    with serving(gateway, EngineConfig(n_ctx=N_CTX, n_slots=2, n_threads=2)) as served:
        schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
        statuses: dict[str, set[int]] = {}
        for operation in operations:
            _fuzz(operation, statuses.setdefault(operation.label, set()))
        assert all(code < 500 for codes in statuses.values() for code in codes), statuses
        # The fuzzing reached the engine as well as the validation: some requests succeeded.
        assert 200 in statuses["POST /v1/chat/completions"] | statuses["POST /v1/completions"]


def _fuzz(operation: schemathesis.APIOperation, statuses: set[int]) -> None:
    """`EXAMPLES_PER_OPERATION` generated calls of `operation`; no 5xx allowed."""

    cases = operation.as_strategy().map(_naming_the_served_model)
    steered = st.tuples(cases, st.booleans()).map(lambda pair: _servable(pair[0], pair[1]))

    @given(case=steered)
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def call(case: schemathesis.Case) -> None:
        response = case.call(timeout=60)
        statuses.add(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    call()


def _naming_the_served_model(case: schemathesis.Case) -> schemathesis.Case:
    """A random `model` only ever gets a 404; the served one lets the body reach the engine."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL
    return case


def _servable(case: schemathesis.Case, steer: bool) -> schemathesis.Case:
    """Half the cases, made likelier to reach the engine: fields whose valid values depend
    on the served model (token ids) dropped, every message given text content. The other
    half stay as generated."""
    if not steer or not isinstance(case.body, dict):
        return case
    case.body.pop("logit_bias", None)
    case.body.pop("stop_token_ids", None)
    if "prompt" in case.body:
        case.body["prompt"] = "Hello"
    for message in case.body.get("messages") or []:
        if isinstance(message, dict):
            message["content"] = "Hello"
            message.pop("tool_calls", None)
    return case

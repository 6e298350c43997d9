"""`router/gateway/poison_requests`: the fingerprint of a request's work, and the quarantine
of requests whose replica died running them (the Serve path, a replica killed mid-request,
is in `test_resilience.py`)."""

from __future__ import annotations

import time

import pytest
from ray.exceptions import ActorUnavailableError

from baton_serve.cache_store.wire.prompt_types import Prompt
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.cache_store.wire.sampling_params import SamplingParams
from baton_serve.router.gateway.errors import APIError
from baton_serve.router.gateway.poison_requests import (
    PoisonQuarantine,
    QuarantineSettings,
    fingerprint,
)

DIED = ActorUnavailableError("Actor is unavailable.", None)  # what Ray 2.60 raises over gRPC
POISON = GenerationRequest(
    prompt=Prompt(tokens=(1, 2, 3)), sampling=SamplingParams(max_tokens=64, grammar='root ::= "a"')
)


def _again(request: GenerationRequest, **changes: object) -> GenerationRequest:
    """The same request sent again (a new id), with `changes`."""
    return request.model_copy(update={"request_id": "another", **changes})


def test_the_fingerprint_is_the_work_not_the_request_id() -> None:
    assert fingerprint(_again(POISON)) == fingerprint(POISON)
    changed = [
        _again(POISON, prompt=Prompt(tokens=(1, 2, 4))),
        _again(POISON, prompt=Prompt(tokens=(1, 2, 3, 0))),
        _again(POISON, sampling=POISON.sampling.model_copy(update={"max_tokens": 65})),
        _again(POISON, sampling=POISON.sampling.model_copy(update={"grammar": None})),
        _again(POISON, n=2),
        _again(POISON, return_logits=True),
    ]
    assert len({fingerprint(r) for r in [POISON, *changed]}) == len(changed) + 1


def test_a_request_lost_with_its_replica_is_answered_500_and_its_repeat_refused_400() -> None:
    quarantine = PoisonQuarantine(QuarantineSettings(quarantine_s=600, max_entries=8))
    quarantine.check(POISON)  # nothing lost yet

    lost = quarantine.lost(POISON, DIED)
    assert (lost.status, lost.code) == (500, "replica_died")
    assert POISON.request_id in lost.message and "not sent to another replica" in lost.message
    assert "600 s (the poison_quarantine_s setting)" in lost.message

    with pytest.raises(APIError) as refused:
        quarantine.check(_again(POISON))
    assert (refused.value.status, refused.value.code) == (400, "request_quarantined")
    assert "poison_quarantine_s" in refused.value.message
    assert "600 s left" in refused.value.message or "599 s left" in refused.value.message
    quarantine.check(_again(POISON, n=2))  # a different request is sent


def test_the_quarantine_ends_after_its_time_and_holds_at_most_its_entries() -> None:
    quarantine = PoisonQuarantine(QuarantineSettings(quarantine_s=0.2, max_entries=2))
    quarantine.lost(POISON, DIED)
    with pytest.raises(APIError):
        quarantine.check(POISON)
    time.sleep(0.3)
    quarantine.check(POISON)  # forgotten

    requests = [_again(POISON, n=n) for n in (1, 2, 3)]
    for request in requests:
        quarantine.lost(request, DIED)
    quarantine.check(requests[0])  # the oldest made room
    for request in requests[1:]:
        with pytest.raises(APIError):
            quarantine.check(request)


def test_no_quarantine_still_answers_500_and_refuses_nothing() -> None:
    quarantine = PoisonQuarantine(QuarantineSettings(quarantine_s=0, max_entries=8))
    lost = quarantine.lost(POISON, DIED)
    assert lost.status == 500 and "refused" not in lost.message
    quarantine.check(POISON)

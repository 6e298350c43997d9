"""Requests whose replica died while running them: not resent, and refused for a while.

A replica process that dies with a request in flight (a crash in native code, the kernel's
OOM killer) may have been killed by that request; resending it would risk the next replica.
So the gateway answers it with a 500 saying so, and keeps its fingerprint (what determines
the work: prompt tokens, sampling parameters, choices) for `quarantine_s`: an identical
request within that time is refused with a 400 before it reaches any replica. Every request
in flight on the dead replica is marked, since which one killed it cannot be told apart.

Each gateway process keeps its own quarantine: with several gateway replicas a repeat that
reaches another gateway is sent once more, so a poison body costs at most one replica per
gateway per quarantine (sharing it would add an index round trip before every request).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import numpy as np
from cachetools import TTLCache

from baton_serve.cache_store.telemetry import metrics
from baton_serve.cache_store.wire.protocol import GenerationRequest
from baton_serve.router.gateway.errors import APIError, replica_died, request_quarantined

logger = logging.getLogger("baton.gateway")

LOST_WITH_REPLICA = metrics.Counter(
    "baton_requests_lost_with_replica",
    "Requests whose replica died while running them (answered 500, not resent)",
)
QUARANTINED = metrics.Counter(
    "baton_requests_quarantined",
    "Requests refused (400) because an identical one was running on a replica that died",
)


@dataclass(frozen=True)
class QuarantineSettings:
    """How long (0: not at all) and how many request fingerprints a gateway keeps."""

    quarantine_s: float
    max_entries: int


def fingerprint(generation: GenerationRequest) -> bytes:
    """A digest of what determines a generation's work (its id left out)."""
    digest = hashlib.blake2b(digest_size=16)
    tokens = np.asarray(generation.prompt.tokens, dtype=np.int64)
    digest.update(len(tokens).to_bytes(8, "little"))
    digest.update(tokens)
    digest.update(generation.sampling.model_dump_json().encode())
    digest.update(f"n={generation.n};logits={generation.return_logits}".encode())
    return digest.digest()


class PoisonQuarantine:
    """The fingerprints of requests lost with their replica, each kept `quarantine_s`
    (at most `max_entries`: past that, the oldest go first)."""

    def __init__(self, settings: QuarantineSettings) -> None:
        self._quarantine_s = settings.quarantine_s
        self._lost: TTLCache[bytes, float] | None = None
        if settings.quarantine_s > 0:
            self._lost = TTLCache(settings.max_entries, settings.quarantine_s, timer=time.monotonic)

    def check(self, generation: GenerationRequest) -> None:
        """Raise the 400 refusal if an identical request was lost with its replica lately."""
        if not self._lost:  # none lost lately: no request is hashed
            return
        lost_at = self._lost.get(fingerprint(generation))
        if lost_at is None:
            return
        left_s = max(1, round(self._quarantine_s - (time.monotonic() - lost_at)))
        QUARANTINED.inc()
        logger.warning(
            "request %s refused: an identical request was lost with its replica %.0f s ago",
            generation.request_id,
            time.monotonic() - lost_at,
        )
        raise request_quarantined(self._quarantine_s, left_s)

    def lost(self, generation: GenerationRequest, cause: Exception) -> APIError:
        """Record that the replica running `generation` died (Ray's `cause`); the error to
        answer it with."""
        if self._lost is not None:
            self._lost[fingerprint(generation)] = time.monotonic()
        LOST_WITH_REPLICA.inc()
        logger.error(
            "replica died while running request %s (%s): not resent; identical requests "
            "refused for %g s",
            generation.request_id,
            type(cause).__name__,
            self._quarantine_s,
        )
        return replica_died(generation.request_id, self._quarantine_s)

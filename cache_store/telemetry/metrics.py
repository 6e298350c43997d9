"""Baton's Prometheus metrics, recorded through Ray Serve's metrics API.

Ray exports them from every node's metrics agent (`ray_` is prepended to each name, and
counters get `_total`). Recording is off until `enable()` is called in a process (the
Serve deployments do): engines run in benchmarks and tests without Ray. Each metric is
created on first use in a process, never at import: Ray ships some modules to other
processes by value, and a Ray metric belongs to the process that made it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:  # imported where a metric is first made: `ray.serve` is slow to import
    from ray.serve import metrics as serve_metrics

M = TypeVar("M")

_enabled = False
_lock = threading.Lock()

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
LOOKUP_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25)


def enable() -> None:
    """Record metrics in this process (off until called)."""
    global _enabled
    _enabled = True


def enabled() -> bool:
    return _enabled


class _Metric(Generic[M]):
    """A Ray Serve metric, made by the first record in each process."""

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...] = ()) -> None:
        self.name = name
        self.description = description
        self.tag_keys = tag_keys or None
        self._metric: M | None = None

    def _get(self) -> M:
        if self._metric is None:
            with _lock:
                if self._metric is None:
                    self._metric = self._make()
        return self._metric

    def _make(self) -> M:
        raise NotImplementedError


class Counter(_Metric["serve_metrics.Counter"]):
    def inc(self, value: float = 1, **tags: str) -> None:
        if _enabled and value > 0:  # Ray rejects an increment of 0
            self._get().inc(value, tags or None)

    def _make(self) -> serve_metrics.Counter:
        from ray.serve.metrics import Counter

        return Counter(self.name, self.description, tag_keys=self.tag_keys)


class Gauge(_Metric["serve_metrics.Gauge"]):
    def set(self, value: float, **tags: str) -> None:
        if _enabled:
            self._get().set(value, tags or None)

    def _make(self) -> serve_metrics.Gauge:
        from ray.serve.metrics import Gauge

        return Gauge(self.name, self.description, tag_keys=self.tag_keys)


class Histogram(_Metric["serve_metrics.Histogram"]):
    def __init__(
        self,
        name: str,
        description: str,
        boundaries: Sequence[float],
        tag_keys: tuple[str, ...] = (),
    ) -> None:
        super().__init__(name, description, tag_keys)
        self.boundaries = list(boundaries)

    def observe(self, value: float, **tags: str) -> None:
        if _enabled:
            self._get().observe(value, tags or None)

    def _make(self) -> serve_metrics.Histogram:
        from ray.serve.metrics import Histogram

        return Histogram(
            self.name, self.description, boundaries=self.boundaries, tag_keys=self.tag_keys
        )


# ---- the replica ---------------------------------------------------------------------------

TTFT = Histogram(
    "baton_time_to_first_token_seconds",
    "From a request reaching its replica to its first token (pull, queue, restore, prefill)",
    SECONDS,
)
INTER_TOKEN = Histogram(
    "baton_inter_token_latency_seconds",
    "Time between two consecutive tokens of one request, on the engine",
    TOKEN_SECONDS,
)
PROMPT_TOKENS = Counter("baton_prompt_tokens", "Prompt tokens of finished requests")
CACHED_TOKENS = Counter(
    "baton_prompt_tokens_cached", "Prompt tokens reused from a cached state (not computed)"
)
COMPUTED_TOKENS = Counter("baton_prompt_tokens_computed", "Prompt tokens computed by prefill")
GENERATED_TOKENS = Counter("baton_generated_tokens", "Tokens generated")

CHECKPOINTS_TAKEN = Counter("baton_checkpoints_taken", "States saved to the checkpoint store")
CHECKPOINTS_RESTORED = Counter(
    "baton_checkpoints_restored", "Stored states restored into a slot for a request"
)
CHECKPOINTS_EVICTED = Counter(
    "baton_checkpoints_evicted", "States evicted from the checkpoint store to make room"
)
CHECKPOINTS_SHIPPED = Counter("baton_checkpoints_shipped", "States exported to a peer replica")
SHIPPED_BYTES = Counter("baton_shipped_bytes", "Bytes of state blobs exported to peers")
PULLS = Counter(
    "baton_state_pulls",
    "Pulls of a prefix state from a peer, by outcome (pulled, skipped, miss, failed, rejected)",
    ("outcome",),
)
PULLED_BYTES = Counter("baton_pulled_bytes", "Bytes of state blobs pulled from peers")
REPLANS = Counter(
    "baton_replans",
    "Router plans a replica decided again, on evidence the router lacked, by reason "
    "(state_gone, held_here, donor_failed, donor_miss, donor_rejected)",
    ("reason",),
)
PLANS_MISSING = Counter(
    "baton_plans_missing",
    "Requests from Baton's router that reached the replica without its plan, by reason "
    "(none, other_replica): each decided there again",
    ("reason",),
)
BLOBS_REJECTED = Counter(
    "baton_state_blobs_rejected",
    "State blobs refused on import, by reason (bad_hmac, bad_checksum, wrong_model, ...)",
    ("reason",),
)

QUEUE_LENGTH = Gauge("baton_queue_length", "Requests waiting for a slot")
SLOTS_IN_USE = Gauge("baton_slots_in_use", "Slots serving a request (prefill, decode or replay)")
STORE_BYTES = Gauge("baton_store_bytes", "Bytes held in the checkpoint store")
DEVICE = Gauge(
    "baton_device",
    "1, labelled with the device the replica's model layers run on (CPU where none)",
    ("device",),
)

# ---- shared by the router (in the gateway) and the replica ---------------------------------

INDEX_LOOKUP = Histogram(
    "baton_index_lookup_seconds",
    "Checkpoint index lookups, by caller (router, replica)",
    LOOKUP_SECONDS,
    ("caller",),
)
INDEX_ERRORS = Counter(
    "baton_index_errors",
    "Index calls that failed or timed out, by caller (router, replica)",
    ("caller",),
)

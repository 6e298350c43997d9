"""Baton's counters as Ray's metrics agent exports them (`/metrics`), for one Serve app."""

from __future__ import annotations

import logging
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton_serve.deploy.local_ray import metrics_export_port

SETTLE_TIMEOUT_S = 30.0

logger = logging.getLogger("baton.bench")


def app_counters(app: str, url: str) -> dict[str, float]:
    """Every `ray_baton_*` counter and histogram sample of `app` served at `url`, summed over
    its replicas, keyed by name and by `name{label=value}` for each label Baton sets (e.g.
    `ray_baton_routing_decisions_total{reason=prefix_hit}`). Gauges are left out: some (the
    router's index view age) change on every scrape, and nothing settles on them."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        if family.type == "gauge":
            continue
        for sample in family.samples:
            if not sample.name.startswith("ray_baton_"):
                continue
            if sample.labels.get("application") != app:
                continue
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            for label in ("reason", "outcome", "status", "caller"):
                if label in sample.labels:
                    key = f"{sample.name}{{{label}={sample.labels[label]}}}"
                    sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def settled_counters(app: str, requests: int) -> dict[str, float]:
    """`app_counters` once the agent has seen at least `requests` API requests of `app` and
    two scrapes a second apart agree (Ray flushes metrics every few seconds)."""
    url = f"http://127.0.0.1:{metrics_export_port()}/metrics"
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    last: dict[str, float] | None = None
    while True:
        counters = app_counters(app, url)
        seen = counters.get("ray_baton_requests_total", 0)
        if seen >= requests and counters == last:
            return counters
        if time.monotonic() > deadline:
            logger.warning(
                "metrics of %s did not settle within %g s (%d of %d requests counted)",
                app,
                SETTLE_TIMEOUT_S,
                seen,
                requests,
            )
            return counters
        last = counters
        time.sleep(1.0)

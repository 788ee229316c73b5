"""Prometheus metrics of the API process.

With several server processes (``ledger serve --workers N``) the CLI points
prometheus-client's multiprocess mode at a private directory, so ``/metrics`` reports the
sum over processes.
"""

from __future__ import annotations

from functools import cache
from typing import TypeVar

from prometheus_client import Counter, Histogram

M = TypeVar("M", Counter, Histogram)

INGESTED = Counter("ledger_envelopes_ingested_total",
                   "Envelopes accepted by ingest, by outcome (created or existing).",
                   ["outcome"])
REJECTED = Counter("ledger_ingest_rejections_total",
                   "Envelopes rejected by ingest, by reason code.", ["reason"])
BATCH_SIZE = Histogram("ledger_ingest_batch_items", "Items per ingest request.",
                       buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
REQUEST_LATENCY = Histogram(
    "ledger_http_request_duration_seconds", "HTTP request latency by route and status.",
    ["method", "route", "status"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
SHED = Counter("ledger_requests_shed_total",
               "Requests refused with 503 because the process was at capacity.")


@cache
def labelled(metric: M, *values: str) -> M:
    """``metric.labels(*values)``, made once per process: the API labels every request
    (route, status; ingest outcome), and ``labels`` formats and looks up its values under
    a lock each time. The label sets are few (routes, status codes, reason codes)."""
    return metric.labels(*values)

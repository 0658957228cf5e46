"""Prometheus metrics of one Tollgate process (a registry per app, so tests can run several)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)


M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """A labelled metric's children by label values, cached: prometheus_client validates the
    values and takes a lock on every `labels()` call, and the request path makes about ten
    per request. (Children are never removed, so a cached one stays the registered one.)"""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child  # type: ignore[no-any-return]


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "tollgate_ttft_seconds", "Time to first token seen by the edge.", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.tpot = Histogram(
            "tollgate_tpot_seconds", "Mean time per output token of a finished request.", ["model"],
            buckets=TPOT_BUCKETS_S, registry=r,
        )
        self.admitted = Counter(
            "tollgate_requests_admitted", "Requests admitted.", ["tier", "model"], registry=r
        )
        self.rejected = Counter(
            "tollgate_requests_rejected",
            "Requests refused: 429 reasons requests|tokens|concurrency, 503 capacity|retry_budget, "
            "400 invalid.",
            ["reason", "tier"],
            registry=r,
        )
        self.finished = Counter(
            "tollgate_requests_finished", "Terminal events by kind.", ["terminal"], registry=r
        )
        self.in_flight = Gauge("tollgate_in_flight", "Requests in flight on this edge.", registry=r)
        self.kv_occupancy = Gauge(
            "tollgate_replica_kv_occupancy", "Last scraped KV-cache occupancy (0..1).",
            ["replica", "model"], registry=r,
        )
        self.replica_healthy = Gauge(
            "tollgate_replica_healthy", "1 when the replica answers its scrapes.",
            ["replica", "model"], registry=r,
        )
        self.events = Counter(
            "tollgate_events_appended", "Events committed to the event store.", ["type"], registry=r
        )
        # The request path's labelled metrics, through the cache above.
        self.ttft_of = Children(self.ttft)
        self.tpot_of = Children(self.tpot)
        self.admitted_of = Children(self.admitted)
        self.finished_of = Children(self.finished)
        self.events_of = Children(self.events)
        self.append_failures = Counter(
            "tollgate_event_append_failures", "Event appends that failed.", registry=r
        )
        self.billing_dead_letters = Gauge(
            "tollgate_billing_dead_letters", "Ended requests the billing fold could not bill.",
            registry=r,
        )
        self.billing_lag = Gauge(
            "tollgate_billing_lag_events", "Committed events the billing fold has not applied yet.",
            registry=r,
        )

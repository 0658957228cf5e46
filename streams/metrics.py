"""Prometheus metrics of the pipeline's own processes (`tollgate relay`, `tollgate worker`), which
have no HTTP server otherwise: `--metrics-port N` serves their registry on /metrics.

Label values are bounded: topic, partition (the topic's partition count) and consumer group."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.gaps import GapReport, age_s
from tollgate_llm.domain.requests.events import UsageBilled
from tollgate_llm.ledger.dead_letters import FOLDS, counts_by_fold
from tollgate_llm.streams.status import Watermarks, partition_lags

# Terminal event -> ledger row: sub-second when the pipeline keeps up, minutes when it does not.
BILLING_LAG_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0)


GAP_GAUGES: tuple[tuple[str, str, Callable[[GapReport, datetime], float]], ...] = (
    ("tollgate_unbilled_terminals",
     "Terminal events whose ledger row the reconciliation has not found.",
     lambda g, _at: g.unbilled_terminals),
    ("tollgate_unbilled_terminal_oldest_age_seconds",
     "Age of the oldest terminal event without its ledger row (0: none).",
     lambda g, _at: age_s(datetime.now(UTC), g.oldest_unbilled_at)),
    ("tollgate_overdue_leases",
     "Admitted requests without a terminal event, unrenewed past the lease TTL + sweep.",
     lambda g, _at: g.overdue_leases),
    ("tollgate_overdue_lease_oldest_age_seconds",
     "Time since the oldest overdue request was last renewed (0: none).",
     lambda g, _at: age_s(datetime.now(UTC), g.oldest_overdue_at)),
    ("tollgate_reconciliation_last_run_timestamp_seconds",
     "When the reconciliation last checked the ledger against the log (Unix time).",
     lambda _g, at: at.timestamp()),
)  # fmt: skip


class PipelineMetrics:
    """One process's registry: the billing lag it observes, and what its collectors add."""

    def __init__(self, *, billing: bool = True) -> None:
        self.registry = r = CollectorRegistry()
        self.billing_lag = None if not billing else Histogram(
            "tollgate_billing_lag_seconds",
            "From a request's terminal event (its instant) to the commit of its ledger row, "
            "observed by the worker that wrote the row.",
            buckets=BILLING_LAG_BUCKETS_S,
            registry=r,
        )

        # The continuous reconciliation's figures, registered by the first report (only a
        # process that runs the reconciliation has them: not the relay).
        self._gaps: tuple[GapReport, datetime] | None = None

    def _gap_reader(self, read: Callable[[GapReport, datetime], float]) -> Callable[[], float]:
        def value() -> float:
            return 0.0 if self._gaps is None else float(read(*self._gaps))

        return value

    def observe_gaps(self, report: GapReport, checked_at: datetime) -> None:
        """The reconciliation's last result (streams/reconciler.py, on the worker that leads
        it); the ages are read at scrape time, so a gap that nothing clears keeps growing."""
        if self._gaps is None:
            for metric, doc, read in GAP_GAUGES:
                Gauge(metric, doc, registry=self.registry).set_function(self._gap_reader(read))
        self._gaps = (report, checked_at)

    def observe_ledger_rows(self, records: Iterable[Recorded], committed_at: datetime) -> None:
        """Once the transaction that wrote the ledger rows of `records`' bills has committed."""
        if self.billing_lag is None:
            return
        for record in records:
            if isinstance(record.event, UsageBilled):
                lag = (committed_at - record.event.finished_at).total_seconds()
                self.billing_lag.observe(max(0.0, lag))

    def add_relay(self, topic: str, lag: Callable[[], int], published: Callable[[], int]) -> None:
        relay_lag = Gauge(
            "tollgate_relay_lag_events",
            "Stored events after the relay's place (not yet published), read at scrape time.",
            ["topic"], registry=self.registry,
        )
        relay_lag.labels(topic).set_function(lag)
        position = Gauge(
            "tollgate_relay_published_position",
            "The store position of the last event the broker acknowledged.",
            ["topic"], registry=self.registry,
        )
        position.labels(topic).set_function(published)


class ConsumerLagCollector(Collector):
    """`tollgate_consumer_lag_messages{topic,partition,group}` of the partitions this worker is
    assigned: the partition's high watermark minus the group's offset saved in PostgreSQL,
    both read at scrape time (so a worker stuck in a batch still shows its lag growing)."""

    def __init__(
        self,
        engine: sa.Engine,
        group: str,
        topic: str,
        assigned: Callable[[], Iterable[int]],
        watermarks: Watermarks,
    ) -> None:
        self.engine, self.group, self.topic = engine, group, topic
        self.assigned = assigned
        self.watermarks = watermarks

    def collect(self) -> Iterable[Any]:
        family = GaugeMetricFamily(
            "tollgate_consumer_lag_messages",
            "Messages of a partition this worker holds that its group has not consumed: high "
            "watermark - committed offset.",
            labels=["topic", "partition", "group"],
        )
        partitions = sorted(self.assigned())
        if partitions:
            highs = self.watermarks(self.topic, partitions)
            with self.engine.connect() as conn:
                lags = partition_lags(
                    conn, datetime.now(UTC), {self.group: self.topic},
                    lambda _topic, _wanted: {p: highs[p] for p in partitions if p in highs},
                )
            for p in lags:
                if p.partition in highs and p.lag_messages is not None:
                    family.add_metric([p.topic, str(p.partition), p.group], p.lag_messages)
        yield family


class DeadLettersCollector(Collector):
    """`tollgate_dead_letters{fold}`: the events each fold moved past without applying them
    and that no replay has applied yet (ledger/dead_letters.py), read at scrape time. Every
    fold is shown, at 0 when it has none, so an alert compares a series that exists."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterable[Any]:
        family = GaugeMetricFamily(
            "tollgate_dead_letters",
            "Events a fold could not apply and moved past, not replayed yet "
            "(tollgate dead-letters list).",
            labels=["fold"],
        )
        with self.engine.connect() as conn:
            counts = counts_by_fold(conn)
        for fold in sorted({*FOLDS, *counts}):
            family.add_metric([fold], counts.get(fold, 0))
        yield family


def serve_metrics(port: int, registry: CollectorRegistry, host: str = "127.0.0.1") -> None:
    """Serve `registry` on /metrics at `host`:`port` in a daemon thread (0: not at all); the
    host is the metrics_host setting (default 127.0.0.1, like the edge; 0.0.0.0 for a remote
    Prometheus)."""
    if port:
        start_http_server(port, addr=host, registry=registry)

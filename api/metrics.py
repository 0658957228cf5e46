"""Prometheus metrics of one Tollgate process (a registry per app, so tests can run several):
`Metrics`, what the request path counts, with the fleet's gauges (`Metrics.fleet`), the batch
queue's (`Metrics.batches`) and the reconciliation's (`Metrics.reconciliation`) each a class of
its own on the same registry."""

from __future__ import annotations

import time
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tollgate_llm.domain.goodput import Attainment
from tollgate_llm.streams.status import Reconciliation

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)


M = TypeVar("M", Counter, Gauge, Histogram)


OTHER = "other"  # the label value of everything beyond a label's bounded set


class ModelLabels:
    """The model names a label may carry: the fleet's models (`known`, set by the runtime), every
    other name `other`. A client chooses the model it asks for, and an unknown name is answered
    404 but still counted: named as asked, 3,000 names from one key were 6,000 series on the
    unauthenticated /metrics (issue 27, item 6)."""

    def __init__(self) -> None:
        self.known: frozenset[str] = frozenset()

    def __call__(self, model: str) -> str:
        return model if model in self.known else OTHER


class Children(Generic[M]):
    """A labelled metric's children by label values, cached: prometheus_client validates the
    values and takes a lock on every `labels()` call, and the request path makes about ten
    per request. (Children are never removed, so a cached one stays the registered one.) The
    values at `model_at` go through `models` first, so neither the series nor this cache grow
    with the names clients send."""

    def __init__(
        self, metric: M, models: ModelLabels | None = None, model_at: int | None = None
    ) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}
        self._models = models if model_at is not None else None
        self._model_at = model_at or 0

    def __call__(self, *values: str) -> M:
        if self._models is not None:
            i = self._model_at
            model = values[i]
            if model not in self._models.known:
                values = (*values[:i], OTHER, *values[i + 1 :])
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child  # type: ignore[no-any-return]


class Metrics:
    def __init__(self, *, max_tenant_labels: int = 50) -> None:
        self.registry = CollectorRegistry()
        # Tenant is a label only for the first `max_tenant_labels` tenants seen: the others are
        # counted as "other", so a platform with many tenants cannot explode the series count.
        self.max_tenant_labels = max_tenant_labels
        self._tenant_labels: set[str] = set()
        self.models = ModelLabels()
        self._register_requests()
        self.fleet = FleetMetrics(self.registry)
        self._register_slo()
        self.batches = BatchMetrics(self.registry)
        self._register_store()
        self._register_prediction()
        self.reconciliation = ReconciliationMetrics(self.registry)

    def _register_requests(self) -> None:
        """What became of each chat request at the edge (admitted, refused, finished, served by
        another model), its latencies and the slow readers cut."""
        r = self.registry
        models = self.models
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
        self.downgraded = Counter(
            "tollgate_requests_downgraded",
            "Requests served by another model than the one asked for, with the tenant's consent.",
            ["requested", "served"],
            registry=r,
        )
        self.routed = Counter(
            "tollgate_requests_routed",
            "Requests the router served (with the tenant's consent, `tollgate routing allow`), by "
            "the model asked (auto, or the policy's reference model), the model that served them "
            "and why: meets_bar, explore, below_bar, latched (drift), shed_capacity.",
            ["asked", "served", "reason"],
            registry=r,
        )
        # `asked` is auto or a model on sale, `served` a model on sale, `reason` one of five:
        # bounded; the served model goes through the fleet's names all the same.
        self.routed_of = Children(self.routed, models, model_at=1)
        self.in_flight = Gauge("tollgate_in_flight", "Requests in flight on this edge.", registry=r)
        self.slow_readers = Counter(
            "tollgate_slow_readers_cancelled",
            "Streams cancelled at the engine because the client read nothing for the slow-reader "
            "timeout with its buffer full.",
            registry=r,
        )
        self.slow_readers_dropped = Counter(
            "tollgate_slow_readers_dropped",
            "Connections dropped because a cancelled slow reader still read nothing a slow-reader "
            "timeout later.",
            registry=r,
        )
        self.ttft_of = Children(self.ttft, models, model_at=0)
        self.tpot_of = Children(self.tpot, models, model_at=0)
        self.admitted_of = Children(self.admitted, models, model_at=1)
        self.finished_of = Children(self.finished)

    def _register_slo(self) -> None:
        """Objectives attained per tier, and the flex class and its preemptions."""
        r = self.registry
        models = self.models
        self.attained = Counter(
            "tollgate_requests_attained",
            "Requests that completed within their tier's TTFT and TPOT objectives.",
            ["tenant", "tier", "model"],
            registry=r,
        )
        self.not_attained = Counter(
            "tollgate_requests_not_attained",
            "Requests that did not attain their objective, by outcome (missed_ttft, missed_tpot, "
            "cancelled, failed, lease_expired, refused_capacity, shed, refused_quota, invalid).",
            ["tenant", "tier", "model", "outcome"],
            registry=r,
        )
        self.attainment_ratio = Gauge(
            "tollgate_slo_attainment_ratio",
            "Attained / served (admitted requests) on this edge since it started, per tier.",
            ["tier"],
            registry=r,
        )
        self.goodput_ratio = Gauge(
            "tollgate_goodput_ratio",
            "Attained / offered (every request but invalid ones) on this edge since it started.",
            ["tier"],
            registry=r,
        )
        # The flex class (service_tier "flex" and batch items), per model and tenant tier.
        self.flex = Counter(
            "tollgate_flex_requests",
            "Flex-class requests by what became of them at the router: admitted, refused (no "
            "idle capacity: 429 resource_unavailable) or preempted (aborted for interactive "
            "work).",
            ["model", "tier", "outcome"],
            registry=r,
        )
        self.flex_of = Children(self.flex, models, model_at=0)
        self.preemptions = Counter(
            "tollgate_preemptions",
            "Interactive requests admitted by preempting flex work on their replica.",
            ["model", "tier"],
            registry=r,
        )
        self.preemptions_of = Children(self.preemptions, models, model_at=0)
        self.attained_of = Children(self.attained, models, model_at=2)
        self.not_attained_of = Children(self.not_attained, models, model_at=2)
        self.outcomes: dict[str, dict[str, int]] = {}  # tier -> outcome -> count, for the ratios

    def _register_store(self) -> None:
        """The event store and the folds behind it."""
        r = self.registry
        self.events = Counter(
            "tollgate_events_appended", "Events committed to the event store.", ["type"], registry=r
        )
        self.events_of = Children(self.events)
        self.append_failures = Counter(
            "tollgate_event_append_failures", "Event appends that failed.", registry=r
        )
        self.append_retries = Counter(
            "tollgate_event_append_retries",
            "A request's events sent again after the store was unavailable for them.",
            registry=r,
        )
        self.append_conflicts = Counter(
            "tollgate_event_append_conflicts",
            "Appends that lost to another writer of the stream (the lease sweeper) and were "
            "decided again on the stored stream.",
            registry=r,
        )
        self.billing_dead_letters = Gauge(
            "tollgate_billing_dead_letters", "Ended requests the billing fold could not bill.",
            registry=r,
        )
        # Fold names are a bounded set this code owns (ledger.dead_letters.FOLDS).
        self.dead_letters = Gauge(
            "tollgate_dead_letters",
            "Events a fold could not apply and moved past, not replayed yet "
            "(tollgate dead-letters list).",
            ["fold"],
            registry=r,
        )
        self.billing_lag = Gauge(
            "tollgate_billing_lag_events", "Committed events the billing fold has not applied yet.",
            registry=r,
        )
        self.admission_view_lag = Gauge(
            "tollgate_admission_view_lag_seconds",
            "Age of the newest logged event this edge's admission views have folded when they "
            "folded it (edges that share a store: how late another edge's admission counts here).",
            registry=r,
        )

    def _register_prediction(self) -> None:
        """Output-length prediction at admission."""
        r = self.registry
        self.output_predicted = Counter(
            "tollgate_output_predicted",
            "Admissions whose output reservation was an output-length prediction.",
            ["tenant"],
            registry=r,
        )
        self.output_prediction_fallbacks = Counter(
            "tollgate_output_prediction_fallbacks",
            "Admissions that reserved their whole output cap although a predictor is configured, "
            "by reason (no_model, unknown_tenant, little_history, low_coverage).",
            ["tenant", "reason"],
            registry=r,
        )
        self.output_prediction_coverage = Gauge(
            "tollgate_output_prediction_coverage_ratio",
            "Realised coverage per tenant: the share of its recent predicted requests whose "
            "output stayed within the reservation (the target is the model's quantile).",
            ["tenant"],
            registry=r,
        )
        self.output_predicted_of = Children(self.output_predicted)
        self.output_prediction_fallbacks_of = Children(self.output_prediction_fallbacks)

    def tenant_label(self, tenant_id: str) -> str:
        labels = self._tenant_labels
        if tenant_id in labels:
            return tenant_id
        if len(labels) < self.max_tenant_labels:
            labels.add(tenant_id)
            return tenant_id
        return OTHER

    def count_outcome(self, tenant_id: str, tier: str, model: str, outcome: str) -> None:
        tenant = self.tenant_label(tenant_id)
        if outcome == "attained":
            self.attained_of(tenant, tier, model).inc()
        else:
            self.not_attained_of(tenant, tier, model, outcome).inc()
        per_tier = self.outcomes.setdefault(tier, {})
        per_tier[outcome] = per_tier.get(outcome, 0) + 1

    def count_prediction(self, tenant_id: str, skipped: str | None) -> None:
        tenant = self.tenant_label(tenant_id)
        if skipped is None:
            self.output_predicted_of(tenant).inc()
        else:
            self.output_prediction_fallbacks_of(tenant, skipped).inc()

    def refresh_ratios(self) -> None:
        """Set the ratio gauges from the outcome counts (at scrape time, not per request)."""
        for tier, counts in self.outcomes.items():
            a = Attainment(counts)
            if a.attainment_ppm is not None:
                self.attainment_ratio.labels(tier).set(a.attainment_ppm / 1e6)
            if a.goodput_ppm is not None:
                self.goodput_ratio.labels(tier).set(a.goodput_ppm / 1e6)


class FleetMetrics:
    """The replicas as this edge sees them, and the autoscaling signal."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.desired_replicas = Gauge(
            "tollgate_desired_replicas",
            "Replicas each model version should have one cold start from now (the autoscaling "
            "signal: KV demand forecast, waiting and reserved terms, with hysteresis).",
            ["model"],
            registry=r,
        )
        self.fleet_replicas = Gauge(
            "tollgate_fleet_replicas",
            "Replicas serving each model version now, or starting.",
            ["model"],
            registry=r,
        )
        self.kv_occupancy = Gauge(
            "tollgate_replica_kv_occupancy", "Last scraped KV-cache occupancy (0..1).",
            ["replica", "model"], registry=r,
        )
        self.replica_healthy = Gauge(
            "tollgate_replica_healthy", "1 when the replica answers its scrapes.",
            ["replica", "model"], registry=r,
        )


class BatchMetrics:
    """Open batches and their queue."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.batches_open = Gauge(
            "tollgate_batches_open", "Batches not yet ended (validating to finalizing).",
            registry=r,
        )
        self.batch_items_pending = Gauge(
            "tollgate_batch_queue_depth", "Batch items without an outcome, over open batches.",
            registry=r,
        )
        self.batch_age = Gauge(
            "tollgate_batch_queue_age_seconds",
            "Age of the oldest open batch that still has items to run (0: none).",
            registry=r,
        )


class ReconciliationMetrics:
    """The continuous reconciliation's last result (streams/reconciler.py), read from the
    store with /readyz's status: the figures an operator pages on (DESIGN §4, 14)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.unbilled_terminals = Gauge(
            "tollgate_unbilled_terminals",
            "Terminal events whose ledger row the reconciliation has not found.", registry=r,
        )
        self.unbilled_oldest_age = Gauge(
            "tollgate_unbilled_terminal_oldest_age_seconds",
            "Age of the oldest terminal event without its ledger row (0: none).", registry=r,
        )
        self.overdue_leases = Gauge(
            "tollgate_overdue_leases",
            "Admitted requests without a terminal event, unrenewed past the lease TTL + sweep.",
            registry=r,
        )
        self.overdue_oldest_age = Gauge(
            "tollgate_overdue_lease_oldest_age_seconds",
            "Time since the oldest overdue request was last renewed (0: none).", registry=r,
        )
        self.reconciled_at = Gauge(
            "tollgate_reconciliation_last_run_timestamp_seconds",
            "When the reconciliation last checked the ledger against the log (Unix time; 0: "
            "never).",
            registry=r,
        )  # fmt: skip

    def observe(self, found: Reconciliation | None) -> None:
        if found is None:
            return
        self.unbilled_terminals.set(found.unbilled_terminals)
        self.unbilled_oldest_age.set(found.oldest_unbilled_age_s or 0.0)
        self.overdue_leases.set(found.overdue_leases)
        self.overdue_oldest_age.set(found.oldest_overdue_age_s or 0.0)
        self.reconciled_at.set(time.time() - found.checked_age_s)

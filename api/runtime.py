"""The composition root of one Tollgate process: it builds the store, writer, views, fleet and
edge, runs the folds (projections, billing, lease sweeper, control-plane follower) and the
periodic tasks. Nothing is built at import time."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import sqlalchemy as sa

from api.backoffice import Backoffice
from api.config import ServeSettings
from api.control_service import CONTROL_PREFIXES
from api.edge import Edge
from api.idempotency_service import AsyncIdempotency
from api.metrics import Metrics
from domain import admission
from domain.control import ControlView
from domain.events import Recorded, RequestAdmitted
from domain.projections import LEDGER_ENTRIES, REQUEST_LOG, USAGE_HOURLY
from engine_adapter.fleet import Fleet
from ledger.checkpoints import Checkpoints
from ledger.engine import WRITE, create_engine_from_url
from ledger.idempotency import IdempotencyStore
from ledger.projections import ProjectionRunner
from ledger.schema import request_log, upgrade
from ledger.store import SqlEventStore
from ledger.writer import GroupCommitWriter
from streams.billing import BillingFold
from streams.sweeper import LeaseSweeper

log = logging.getLogger("tollgate")

LIVE_STATUSES = ("admitted", "routed", "streaming")


def new_edge_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Runtime:
    settings: ServeSettings
    log: logging.Logger = log
    metrics: Metrics = field(default_factory=Metrics)
    edge_id: str = field(default_factory=new_edge_id)

    def __post_init__(self) -> None:
        upgrade(self.settings.database_url)
        self.engine = create_engine_from_url(self.settings.database_url)
        self.store = SqlEventStore(self.engine)
        # No artificial delay: whatever queued while the last commit ran is the next group.
        self.writer = GroupCommitWriter(self.store, max_delay_ms=0)
        self.control = ControlView()
        # Position first, then the streams: a control event committed in between is read twice
        # (the view ignores a repeat), never missed.
        self.control_position = self.store.last_position()
        for record in self.store.read_streams_with_prefix(CONTROL_PREFIXES):
            self.control.apply(record)
        self.quota = admission.QuotaView(limits_for=self.control.limits)
        self.checkpoints = Checkpoints(self.engine)
        self.projection_specs = (REQUEST_LOG, USAGE_HOURLY, LEDGER_ENTRIES)
        self.runners = [
            ProjectionRunner(self.engine, self.store, spec) for spec in self.projection_specs
        ]
        self.billing = BillingFold(self.store, self.checkpoints, self.control)
        self.projection_positions: dict[str, int] = {}
        self.sweeper = LeaseSweeper(self.store, ttl_s=self.settings.lease_ttl_s)
        self.idempotency = AsyncIdempotency(IdempotencyStore(self.engine))
        self.backoffice = Backoffice(self.engine, self.store, self.control)
        self.session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.edge: Edge = None  # type: ignore[assignment]  # set in start(): needs the fleet
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._folds: threading.Thread | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.fold_error: str | None = None
        self.writer.on_committed(lambda records: self._wake.set())

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self, replicas: list[tuple[str, str, str]]) -> None:
        """`replicas`: (replica_id, model, url) of the engines to route to."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        self.fleet = Fleet(self.session, scrape_interval_s=self.settings.scrape_interval_s)
        for replica_id, model, url in replicas:
            self.fleet.add(replica_id, url, model)
        await self.fleet.start()
        self.edge = Edge(
            control=self.control, quota=self.quota, fleet=self.fleet, writer=self.writer,
            idempotency=self.idempotency, metrics=self.metrics, edge_id=self.edge_id,
            tpot_target_us=self.settings.tpot_target_us, rng=random.Random(),
        )
        self._catch_up()
        self._folds = threading.Thread(target=self._fold_loop, name="tollgate-folds", daemon=True)
        self._folds.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.settings.lease_renew_s, self.edge.renew_leases)),
            loop.create_task(self._every(600, self._purge_idempotency)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.session is not None:
            await self.session.close()
        self.writer.close()
        self._stop.set()
        self._wake.set()
        if self._folds is not None:
            self._folds.join(timeout=10)
        self.run_folds()  # what the writer flushed last is folded before we go
        self.engine.dispose()

    async def _every(self, seconds: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("periodic task %s failed", getattr(fn, "__name__", fn))

    async def _purge_idempotency(self) -> None:
        await self.idempotency.purge_expired()

    # --- folds ---------------------------------------------------------------------------------

    def _catch_up(self) -> None:
        """Bring the projections up to date, then resume the sweeper from the requests that have
        not ended (a previous process may have died with requests in flight)."""
        for runner in self.runners:
            runner.run_to_end()
            self.projection_positions[runner.name] = runner.checkpoint()
        self.billing.run_to_end()
        with self.engine.connect() as conn:
            live = [
                r[0] for r in conn.execute(
                    sa.select(request_log.c.request_id).where(request_log.c.status.in_(LIVE_STATUSES))
                )
            ]
        admissions = []
        for request_id in live:
            for record in self.store.read_stream(request_id):
                if isinstance(record.event, RequestAdmitted):
                    admissions.append(record)
        start = min((r.position for r in admissions), default=self.store.last_position())
        self.sweeper.start_from(start - 1 if admissions else start, admissions)

    def run_folds(self, batch: int = 5000) -> None:
        """One pass of every in-process fold. The new events are read once and handed to each
        fold, which skips what it has already applied; each fold fails, reports (on /readyz)
        and retries on its own, without holding the others back."""
        errors: dict[str, str] = {}
        while True:
            start = min(self.control_position, self.sweeper.position, self.billing.position,
                        *self.projection_positions.values())
            records = self.store.read_all(start, batch)
            for name, step in (
                ("control", self._follow_control),
                ("billing", self.billing.process),
                ("projections", self._project),
                ("sweeper", self._follow_leases),
            ):
                try:
                    step(records)
                except Exception as exc:
                    log.exception("fold %s failed", name)
                    errors[name] = f"{type(exc).__name__}: {exc}"
            if len(records) < batch or errors:
                break
        try:
            self.sweeper.sweep(datetime.now(UTC))
        except Exception as exc:
            log.exception("lease sweep failed")
            errors["sweeper"] = f"{type(exc).__name__}: {exc}"
        self.fold_error = "; ".join(f"{k}: {v}" for k, v in errors.items()) or None
        self.metrics.billing_lag.set(self.billing.lag())
        self.metrics.billing_dead_letters.set(len(self.billing.dead_letters))

    def _follow_control(self, records: list[Recorded]) -> None:
        for record in records:
            if record.position > self.control_position:
                self.control.apply(record)
                self.control_position = record.position

    def _project(self, records: list[Recorded]) -> None:
        """All read models in one transaction: rows and checkpoints commit together."""
        if not records:
            return
        with self.engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                for runner in self.runners:
                    runner.apply_recorded(conn, records)
        for runner in self.runners:
            self.projection_positions[runner.name] = records[-1].position

    def _follow_leases(self, records: list[Recorded]) -> None:
        for record in records:
            if record.position > self.sweeper.position:
                self.sweeper.apply(record)
                self.sweeper.position = record.position

    def _fold_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            self.run_folds()
            # A pass at most every 100 ms: the folds then work in batches (one read, one commit
            # per pass) instead of competing with the request path after every commit. Billing
            # and the read models lag by about that much; admission does not read them.
            self._stop.wait(1.0 if self.fold_error else 0.1)

    # --- views for the routes ------------------------------------------------------------------

    def fleet_models(self) -> list[dict[str, Any]]:
        assert self.fleet is not None
        return [
            {"id": model, "object": "model", "created": 0, "owned_by": "tollgate"}
            for model in self.edge.models()
        ]

    def readiness(self) -> tuple[list[str], list[str]]:
        """(problems that make this edge unready, warnings that do not)."""
        problems: list[str] = []
        warnings: list[str] = []
        if self.fold_error:
            problems.append(f"folds: {self.fold_error}")
        if self.billing.dead_letters:
            warnings.append(
                f"billing: {len(self.billing.dead_letters)} request(s) could not be billed, e.g. "
                + "; ".join(f"{k} ({v})" for k, v in list(self.billing.dead_letters.items())[:3])
            )
        if self.fleet is None or not any(r.healthy for r in self.fleet.replicas()):
            problems.append("no healthy replica")
        return problems, warnings

    def refresh_gauges(self) -> None:
        if self.fleet is None:
            return
        for replica in self.fleet.replicas():
            labels = (replica.replica_id, replica.replica.model)
            self.metrics.kv_occupancy.labels(*labels).set(replica.scraped_occupancy_ppm / 1e6)
            self.metrics.replica_healthy.labels(*labels).set(1 if replica.healthy else 0)

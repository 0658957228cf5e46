"""The composition root of one Tollgate edge process: it builds the store, writer, views, fleet
and edge, follows the control plane, and starts (and supervises) the fold worker process that
runs billing, the read models and the lease sweeper (streams/worker.py). Nothing is built at
import time."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp

from api.backoffice import Backoffice
from api.config import ServeSettings
from api.edge import Edge
from api.idempotency_service import AsyncIdempotency
from api.metrics import Metrics
from domain import admission
from domain.control import CONTROL_PREFIXES, ControlView
from engine_adapter.fleet import Fleet
from ledger.engine import DEFAULT_WAL_AUTOCHECKPOINT, create_engine_from_url
from ledger.idempotency import IdempotencyStore
from ledger.schema import upgrade
from ledger.store import SqlEventStore
from ledger.writer import GroupCommitWriter
from streams.worker import FoldStatus, read_fold_status

log = logging.getLogger("tollgate")

# The control-plane follower's period: a new key, limit or price is in force within this.
CONTROL_POLL_S = 0.2
# A fold worker that died is started again after this pause.
WORKER_RESTART_S = 1.0


def follow_control(store: SqlEventStore, control: ControlView, position: int) -> int:
    """Apply the control-plane records after `position` to `control`; returns the position
    scanned to.

    That is the log's end as read before the scan, not the last control record: requests'
    events far outnumber control ones, and each poll would otherwise scan again every event
    since the last key or price change (7 % of the edge's CPU ten seconds after start, and
    growing). Positions commit in order (the store's append lock), so every event up to the end
    read first is visible to the scan that follows."""
    end = store.last_position()
    while records := store.read_all(position, 1000, stream_prefixes=CONTROL_PREFIXES):
        for record in records:
            control.apply(record)
        position = records[-1].position
    return max(position, end)


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
        # The fold worker checkpoints SQLite's WAL (it commits every pass); the edge does so
        # itself only if the WAL passes ~40 MB (no worker running), never at the default ~4 MB.
        self.engine = create_engine_from_url(
            self.settings.database_url, wal_autocheckpoint=10 * DEFAULT_WAL_AUTOCHECKPOINT
        )
        self.store = SqlEventStore(self.engine)
        # The edge's event loop forms the groups (api/commits.py) and commits them itself when
        # that costs no waiting; this thread commits the rest, with no artificial delay.
        self.writer = GroupCommitWriter(self.store, max_delay_ms=0)
        self.control = ControlView()
        # Position first, then the streams: a control event committed in between is read twice
        # (the view ignores a repeat), never missed.
        self.control_position = self.store.last_position()
        for record in self.store.read_streams_with_prefix(CONTROL_PREFIXES):
            self.control.apply(record)
        self.quota = admission.QuotaView(limits_for=self.control.limits)
        self.idempotency = AsyncIdempotency(IdempotencyStore(self.engine))
        self.backoffice = Backoffice(self.engine, self.store, self.control)
        self.session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.edge: Edge = None  # type: ignore[assignment]  # set in start(): needs the fleet
        self.worker: subprocess.Popen[bytes] | None = None
        self._worker_started = 0.0
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.control_error: str | None = None
        self._fold_status: tuple[float, FoldStatus] | None = None

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
        self._follower = threading.Thread(
            target=self._follow_control, name="tollgate-control", daemon=True
        )
        self._follower.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.settings.lease_renew_s, self.edge.renew_leases)),
            loop.create_task(self._every(600, self._purge_idempotency)),
        ]
        if self.settings.fold_worker:
            self._start_worker()
            self._tasks.append(loop.create_task(self._every(0.5, self._supervise_worker)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.fleet is not None:
            await self.fleet.stop()
        if self.session is not None:
            await self.session.close()
        if self.edge is not None:
            self.edge.commits.hand_over()  # what still waits on the loop goes to the writer
        self.writer.close()
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=5)
        # The worker folds what the writer flushed last, then exits.
        await asyncio.to_thread(self._stop_worker)
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

    # --- the control plane ---------------------------------------------------------------------

    def _follow_control(self) -> None:
        """Tail the control-plane streams (keys, limits, plans, prices): what the CLI or another
        edge writes is in force here within CONTROL_POLL_S."""
        while not self._stop.wait(CONTROL_POLL_S):
            try:
                self.control_position = follow_control(
                    self.store, self.control, self.control_position
                )
                self.control_error = None
            except Exception as exc:
                log.exception("control-plane follower failed")
                self.control_error = f"{type(exc).__name__}: {exc}"

    # --- the fold worker -----------------------------------------------------------------------

    def _start_worker(self) -> None:
        cmd = [
            sys.executable, "-m", "api.cli", "worker",
            "--database-url", self.settings.database_url,
            "--lease-ttl", str(self.settings.lease_ttl_s),
            "--parent-pid", str(os.getpid()),
        ]
        self.worker = subprocess.Popen(cmd)
        self._worker_started = time.monotonic()
        log.info("fold worker started (pid %d)", self.worker.pid)

    def _supervise_worker(self) -> None:
        if self.worker is None or self._stop.is_set():
            return
        code = self.worker.poll()
        if code is None:
            return
        if time.monotonic() - self._worker_started < WORKER_RESTART_S:
            return  # a worker that dies at once is not restarted in a tight loop
        log.error("fold worker exited with %s; starting it again", code)
        self._start_worker()

    def _stop_worker(self) -> None:
        if self.worker is None:
            return
        self.worker.send_signal(signal.SIGTERM)
        try:
            self.worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("fold worker did not stop in 30 s; killing it")
            self.worker.kill()
            self.worker.wait()
        self.worker = None

    def fold_status(self) -> FoldStatus:
        """The folds' last report (worker_status), read at most once a second."""
        now = time.monotonic()
        if self._fold_status is None or now - self._fold_status[0] > 1.0:
            self._fold_status = (now, read_fold_status(self.engine, datetime.now(UTC)))
        return self._fold_status[1]

    # --- views for the routes ------------------------------------------------------------------

    def fleet_models(self) -> list[dict[str, Any]]:
        assert self.fleet is not None
        return [
            {"id": model, "object": "model", "created": 0, "owned_by": "tollgate"}
            for model in self.edge.models()
        ]

    def readiness(self) -> tuple[list[str], list[str]]:
        """(problems that make this edge unready, warnings that do not)."""
        folds = self.fold_status()
        problems = list(folds.problems)
        warnings = list(folds.warnings)
        if self.control_error:
            problems.append(f"control plane: {self.control_error}")
        if self.fleet is None or not any(r.healthy for r in self.fleet.replicas()):
            problems.append("no healthy replica")
        return problems, warnings

    def refresh_gauges(self) -> None:
        folds = self.fold_status()
        self.metrics.billing_lag.set(folds.billing_lag)
        self.metrics.billing_dead_letters.set(folds.dead_letters)
        if self.fleet is None:
            return
        for replica in self.fleet.replicas():
            labels = (replica.replica_id, replica.replica.model)
            self.metrics.kv_occupancy.labels(*labels).set(replica.scraped_occupancy_ppm / 1e6)
            self.metrics.replica_healthy.labels(*labels).set(1 if replica.healthy else 0)

"""The composition root of one Tollgate edge process: it builds the store, writer, views, fleet
and edge, follows the control plane, and has the fold worker process that runs billing, the read
models and the lease sweeper (streams/worker.py) started and supervised
(streams/supervisor.py). Nothing is built at import time."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from tollgate_llm.api.config import Settings
from tollgate_llm.api.http.sessions import Sessions, load_secret
from tollgate_llm.api.metrics import Metrics
from tollgate_llm.api.services.admin_service import AdminService
from tollgate_llm.api.services.audit_service import AuditTrail
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.backoffice import Backoffice
from tollgate_llm.api.services.batch_service import BatchService
from tollgate_llm.api.services.edge import Edge
from tollgate_llm.api.services.feedback_service import FeedbackService
from tollgate_llm.api.services.idempotency_service import AsyncIdempotency
from tollgate_llm.api.services.routing_step import REFRESH_S
from tollgate_llm.api.services.runs_service import RunService
from tollgate_llm.api.services.scaling import Actuator, ScalingLoop
from tollgate_llm.api.services.tracing import from_env as tracing_from_env
from tollgate_llm.domain import remote_flex
from tollgate_llm.domain.autoscale import ScalePolicy
from tollgate_llm.domain.capacity import FlexPolicy
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.quota import QuotaView
from tollgate_llm.engine_adapter.discovery import ServedModel, discover
from tollgate_llm.engine_adapter.estimators import WordTokenEstimator
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica
from tollgate_llm.ledger.batches import BatchStore
from tollgate_llm.ledger.budgets import catch_up
from tollgate_llm.ledger.commands import CommandHandler
from tollgate_llm.ledger.commits import LoopCommits
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.dead_letters import FOLDS as DEAD_LETTER_FOLDS
from tollgate_llm.ledger.engine import (
    DEFAULT_WAL_AUTOCHECKPOINT,
    checkpoint_wal,
    create_engine_from_url,
)
from tollgate_llm.ledger.idempotency import IdempotencyStore
from tollgate_llm.ledger.ids import new_writer_tag, tagged_event_ids
from tollgate_llm.ledger.quality import QualityLog
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.ledger.writer import GroupCommitWriter
from tollgate_llm.predictor import router_file
from tollgate_llm.predictor.runtime import LoadedPredictor
from tollgate_llm.streams.status import BATCH_RUNNER_NAME, Reconciliation, read_status
from tollgate_llm.streams.supervisor import FoldWorkerSupervisor
from tollgate_llm.streams.worker_rows import FoldStatus, last_heartbeat, read_fold_status

log = logging.getLogger("tollgate")

# The control-plane follower's period: a new key, limit or price is in force within this.
CONTROL_POLL_S = 0.2
# The log follower of an edge that shares the store with others (its folds run elsewhere): the
# other edges' admissions, refunds and ends reach this edge's quota and budget views within this
# period plus a read. It starts this many events back, so that a (re)started edge sees the last
# minute or so of the others' charges rather than none.
ADMISSION_POLL_S = 0.05
# A poll that finds nothing doubles the period, up to this: an edge alone on the store (or
# between bursts) asks 5 times a second, not 20; the first event found brings it back to
# ADMISSION_POLL_S. What another edge admits after a quiet spell counts here within this.
ADMISSION_IDLE_POLL_S = 0.2
ADMISSION_CATCH_UP_EVENTS = 50_000
ADMISSION_READ = 2_000
LOG_RETRY_S = 1.0
# How often streams are checked for a client that stopped reading: the slow-reader bound is the
# timeout plus this.
SLOW_READER_CHECK_S = 0.5


def new_edge_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class Runtime:
    settings: Settings
    log: logging.Logger = log
    metrics: Metrics = field(default_factory=Metrics)
    edge_id: str = field(default_factory=new_edge_id)

    def __post_init__(self) -> None:
        self.metrics.max_tenant_labels = self.settings.metrics_max_tenants
        # OpenTelemetry spans of each chat request, when OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT is
        # set (None otherwise); first, so that a missing package stops the start at once.
        self.tracing = tracing_from_env()
        upgrade(self.settings.database_url)
        # The fold worker checkpoints SQLite's WAL (it commits every pass); the edge does so
        # itself only if the WAL passes ~40 MB (no worker running), never at the default ~4 MB.
        self.engine = create_engine_from_url(
            self.settings.database_url, wal_autocheckpoint=10 * DEFAULT_WAL_AUTOCHECKPOINT
        )
        self.store = SqlEventStore(self.engine)
        # The edge's event loop forms the groups (ledger/commits.py) and commits them itself when
        # that costs no waiting; this thread commits the rest, with no artificial delay.
        self.writer = GroupCommitWriter(self.store, max_delay_ms=0)
        self.control_log = ControlLog(self.store)
        self.control = self.control_log.view
        self.quota = QuotaView(limits_for=self.control.limits)
        self.idempotency = AsyncIdempotency(IdempotencyStore(self.engine))
        self.backoffice = Backoffice(self.engine, self.store, self.control)
        # The router's statistics: the tenants' feedback, folded here at start and followed with
        # the control plane; this edge's own feedback is folded as it is recorded.
        self.quality_log = QualityLog(self.store)
        self._router_model()
        self.feedback = FeedbackService(
            self.store, CommandHandler(self.store), self.quality_log.view
        )
        # The admin API's commands (their own control log, folded on first use) and the trail.
        self.admin = AdminService(self.store)
        self.audit = AuditTrail(self.engine)
        # The web pages' sessions (api/http/sessions.py): signed with a secret every edge shares.
        self.sessions = Sessions(
            load_secret(self.settings.data_path(), self.settings.session_secret)
        )
        # `tollgate serve`'s fold worker runs a batch runner; an edge without one (`tollgate
        # api`) creates a batch only while a runner elsewhere reports.
        self.batches = BatchService(
            BatchStore(self.engine), self.store, CommandHandler(self.store),
            windows=self.settings.batch_windows,
            runner_alive=None if self.settings.fold_worker else self.batch_runner_alive,
            retention=self.control.retention,
        )
        self._runner_seen: tuple[float, bool] | None = None
        if not self.settings.batch_token:
            self.settings.batch_token = secrets.token_urlsafe(32)
        # Batch items still to run, per model version: deferred demand for the autoscaler.
        self.deferred_items: dict[str, int] = {}
        self.session: aiohttp.ClientSession | None = None
        self.fleet: Fleet | None = None
        self.edge: Edge = None  # type: ignore[assignment]  # set in start(): needs the fleet
        self.runs: RunService = None  # type: ignore[assignment]  # set in start(), with the edge
        self.fold_worker: FoldWorkerSupervisor | None = None
        self.commits: LoopCommits | None = None
        self.scaling: ScalingLoop | None = None
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        self._log_follower: threading.Thread | None = None
        self.log_error: str | None = None
        self.log_position = 0  # the last position of the log this edge's views have folded
        # The suffix of every event id this process's edge writes: its log follower leaves them
        # out of its reads (its views counted them as they were decided).
        self.writer_tag = new_writer_tag()
        self._tasks: list[asyncio.Task[Any]] = []
        self.control_error: str | None = None
        self._fold_status: tuple[float, FoldStatus] | None = None
        self._pipeline_stale: tuple[str, ...] = ()
        self.reconciliation: Reconciliation | None = None
        self.dead_letters: dict[str, int] = {}  # unreplayed, per fold (the status read's)
        # Per model version: the engine's name for it, its context and its prompt estimator.
        self.served: dict[str, ServedModel] = {}
        self.predictor: LoadedPredictor | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(
        self,
        replicas: list[tuple[str, str, str]],
        *,
        simulated: bool = False,
        tokenizers: dict[str, str] | None = None,
        actuator: Actuator | None = None,
        regions: dict[str, str] | None = None,
    ) -> None:
        """`replicas`: (replica_id, model, url) of the engines to route to; `tokenizers`: model
        -> directory of its tokenizer, where the replica's own `root` is not readable here;
        `actuator`: what adds and removes replicas by the autoscaling signal (else the signal
        is only shown); `regions`: replica id -> where it runs (none: no region). A served model
        without a profile refuses the start (DomainError, one line)."""
        profiles = {model: self.control.model_profile(model) for _, model, _ in replicas}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
        )
        self.fleet = Fleet(
            self.session,
            scrape_interval_s=self.settings.scrape_interval_s,
            flex=FlexPolicy(ceiling_ppm=self.settings.flex_ceiling_ppm),
        )
        engines = [VLLMReplica(replica_id, url, model) for replica_id, model, url in replicas]
        for engine in engines:
            self.fleet.add(engine, region=(regions or {}).get(engine.replica_id, ""))
        self.served = await discover(
            self.session, engines,
            simulated=simulated, tokenizers=tokenizers,
            default_max_model_len={m: p.max_model_len for m, p in profiles.items()},
        )  # fmt: skip
        await self.fleet.start()
        self.metrics.models.known = frozenset(self.fleet.models())
        self.commits = LoopCommits(self.writer)
        # Each model's own tokenizer and template where discovery found them; the simulator's
        # word count otherwise (exact for simulated replicas, rough in front of a real one).
        words = WordTokenEstimator()
        estimators = {m: s.estimator for m, s in self.served.items() if s.estimator is not None}
        if self.settings.predictor_enabled:
            self.predictor = self._load_predictor()
        self.edge = Edge(
            control=self.control, quota=self.quota, fleet=self.fleet, events=self.commits,
            idempotency=self.idempotency, metrics=self.metrics,
            tokens=lambda model: estimators.get(model, words),
            edge_id=self.edge_id, tpot_target_us=self.settings.tpot_target_us,
            rng=random.Random(), commands=CommandHandler(self.store),
            new_id=tagged_event_ids(self.writer_tag),
            slow_reader_s=self.settings.slow_reader_s,
            stream_buffer_chunks=self.settings.stream_buffer_chunks,
            predictor=self.predictor, quality=self.quality_log.view,
        )
        # Budgets and runs count what was spent before this process started.
        end = self.store.last_position()
        catch_up(self.store, self.edge.paths, datetime.now(UTC))
        self.runs = RunService(
            self.control_log, CommandHandler(self.store), self.edge.paths,
            currency=self.settings.currency,
        )  # fmt: skip
        self._follower = threading.Thread(
            target=self._follow_control, name="tollgate-control", daemon=True
        )
        self._follower.start()
        loop = asyncio.get_running_loop()
        if not self.settings.fold_worker:
            # Its folds run elsewhere, so other edges may share the store: fold what they record.
            self.log_position = max(0, end - ADMISSION_CATCH_UP_EVENTS)
            # Other edges' flex work on the shared replicas is preemptible from here too.
            self.fleet.others_flex = self.edge.others_flex
            self._log_follower = threading.Thread(
                target=self._follow_log, args=(loop,), name="tollgate-log", daemon=True
            )
            self._log_follower.start()
        self._tasks = [
            loop.create_task(self._every(self.settings.lease_renew_s, self.edge.renew_leases)),
            loop.create_task(self._every(600, self._purge_idempotency)),
            loop.create_task(self._every(self.settings.sqlite_checkpoint_s, self._checkpoint)),
            loop.create_task(self._every(SLOW_READER_CHECK_S, self._check_slow_readers)),
            loop.create_task(self._every(2.0, self._batch_gauges)),
            loop.create_task(self._every(REFRESH_S, self.edge.admission.router.refresh)),
            loop.create_task(self._every(self.settings.predictor_reload_s, self._router_model)),
        ]
        policy = ScalePolicy(
            cold_start_s=self.settings.cold_start_s,
            scale_down_after_s=self.settings.scale_down_after_s,
        )
        if self.predictor is not None:
            self._tasks.append(
                loop.create_task(self._every(self.settings.predictor_reload_s, self._reload))
            )
        self.scaling = ScalingLoop(
            self.fleet, self.metrics, policy=policy, actuator=actuator,
            deferred_items=lambda model: self.deferred_items.get(model, 0),
        )
        self._tasks.append(loop.create_task(self._every(policy.step_s, self.scaling.step)))
        if self.settings.fold_worker:
            self.fold_worker = FoldWorkerSupervisor(self._worker_command(), env=self._worker_env())
            self.fold_worker.start()
            self._tasks.append(loop.create_task(self._every(0.5, self.fold_worker.check)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.edge is not None:
            # The refusals counted in the open windows, recorded before the writer closes.
            self.edge.record_counted_refusals(everything=True)
        if self.fleet is not None:
            await self.fleet.stop()
        if self.session is not None:
            await self.session.close()
        if self.commits is not None:
            self.commits.hand_over()  # what still waits on the loop goes to the writer
        self.writer.close()
        self._stop.set()
        for thread in (self._follower, self._log_follower):
            if thread is not None:
                thread.join(timeout=5)
        # The worker folds what the writer flushed last, then exits.
        if self.fold_worker is not None:
            await asyncio.to_thread(self.fold_worker.stop)
        self.engine.dispose()
        if self.tracing is not None:  # the spans still batched are exported
            await asyncio.to_thread(self.tracing.shutdown)

    async def _every(self, seconds: float, fn: Any) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("periodic task %s failed", getattr(fn, "__name__", fn))

    def _check_slow_readers(self) -> None:
        self.edge.check_slow_readers(time.monotonic())

    def _router_model(self) -> None:
        """The newest router model `tollgate router train` wrote to the predictor directory,
        read where its coverage guard holds (domain.router_model); none, or a file that is not
        one: Wilson's bound alone, as before."""
        path = router_file.latest(self.settings.predictor_dir())
        view = self.quality_log.view
        if path is None or path.stem.endswith(view.model_version or "-"):
            return
        try:
            model = router_file.load(path)
        except (OSError, router_file.RouterFileError) as exc:
            log.warning("router model %s not read: %s", path, exc)
            return
        view.use_model(model)
        log.info("router model %s: %d (tenant, model, class) covered", model.version,
                 len(view.learned))  # fmt: skip

    def _predictor_path(self) -> Path:
        configured = self.settings.predictor_path
        return Path(configured) if configured else self.settings.predictor_dir()

    def _load_predictor(self) -> LoadedPredictor:
        """The output predictor, its history warmed from the log (a model file that cannot be
        read refuses the start: serving without the model asked for would go unnoticed)."""
        predictor = LoadedPredictor.from_path(self._predictor_path())
        fed = predictor.warm(self.store)
        log.info("output predictor: model %s, history of %d requests", predictor.version, fed)
        return predictor

    def _reload(self) -> None:
        assert self.predictor is not None
        if self.predictor.reload(self._predictor_path()):
            log.info("output predictor: now model %s", self.predictor.version)
    async def _batch_gauges(self) -> None:
        queue = await asyncio.to_thread(self.batches.queue)
        self.metrics.batches.batches_open.set(queue.open_batches)
        self.metrics.batches.batch_items_pending.set(queue.pending_items)
        self.metrics.batches.batch_age.set(queue.oldest_age_s)
        deferred: dict[str, int] = {}
        for requested, items in queue.pending_by_model.items():
            model = self.edge.resolve_model(requested)
            if model is not None:
                deferred[model] = deferred.get(model, 0) + items
        self.deferred_items = deferred

    async def _purge_idempotency(self) -> None:
        await self.idempotency.purge_expired()

    async def _checkpoint(self) -> None:
        """SQLite: fold the WAL into the database and truncate it, so that a deleted row's old
        page images leave the WAL file within `sqlite_checkpoint_s` (with `secure_delete` the
        database file holds none). A reader in the way makes it wait for the next turn."""
        await asyncio.to_thread(checkpoint_wal, self.engine)

    # --- the control plane ---------------------------------------------------------------------

    def _follow_control(self) -> None:
        """Tail the control-plane streams (keys, limits, plans, prices): what the CLI or another
        edge writes is in force here within CONTROL_POLL_S."""
        while not self._stop.wait(CONTROL_POLL_S):
            try:
                self.control_log.follow()
                self.quality_log.follow()
                self.control_error = None
            except Exception as exc:
                log.exception("control-plane follower failed")
                self.control_error = f"{type(exc).__name__}: {exc}"

    def _follow_log(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tail the event log for the edge's admission views (Edge.observe, on the event loop):
        what another edge admits counts here within ADMISSION_POLL_S (ADMISSION_IDLE_POLL_S
        after a quiet spell) plus one read, with no call on the admission path. This edge's own
        events are left out by the query (their ids end with its writer tag): reading them back
        cost a fifth of a distributed edge's CPU, only to be skipped."""
        types = sorted(self.edge.observed_types())
        period_s = ADMISSION_POLL_S
        while not self._stop.wait(period_s):
            try:
                period_s = min(period_s * 2, ADMISSION_IDLE_POLL_S)
                while not self._stop.is_set():
                    records, self.log_position = self.store.read_tail(
                        self.log_position, ADMISSION_READ, types, self.writer_tag
                    )
                    if not records:
                        break
                    period_s = ADMISSION_POLL_S
                    # The routes of other edges' flex requests (RequestRouted is not tailed:
                    # one per request of every edge, for a few flex ones).
                    flex = remote_flex.routes_to_read(records, self.edge_id)
                    routed = remote_flex.routes(
                        list(self.store.read_streams(flex).values()) if flex else []
                    )
                    loop.call_soon_threadsafe(self._observe, records, routed)
                    if len(records) < ADMISSION_READ:
                        break
                self.log_error = None
            except Exception as exc:
                if loop.is_closed():  # call_soon_threadsafe refused: the process is stopping
                    return
                log.exception("log follower failed; trying again in %s s", LOG_RETRY_S)
                self.log_error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(LOG_RETRY_S)  # a store that is down is not asked 20 times a second

    def _observe(self, records: list[Recorded], routed: list[Recorded]) -> None:
        self.edge.observe(records)
        if routed:
            self.edge.observe(routed)
        lag = time.time() - records[-1].occurred_at.timestamp()
        self.metrics.admission_view_lag.set(max(0.0, lag))

    # --- the fold worker -----------------------------------------------------------------------

    def _worker_command(self) -> list[str]:
        # `tollgate worker`, told this process's pid so that it stops when the edge is gone. A
        # process, not an import: the command line (cli/) is the layer above this one.
        return [
            sys.executable, "-m", "tollgate_llm.cli", "worker",
            "--database-url", self.settings.database_url,
            "--lease-ttl", str(self.settings.lease_ttl_s),
            "--parent-pid", str(os.getpid()),
            "--log-format", self.settings.log_format,
            *(["--config", str(self.settings.config)] if self.settings.config else []),
        ]

    def _worker_env(self) -> dict[str, str]:
        # The batch runner inside the worker sends items to this edge as flex requests. The rest
        # of this process's environment (and so its settings: the data directory, the Kafka
        # settings, ...) is the child's too; the token goes this way, never on a command line.
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return {
            **os.environ,
            "TOLLGATE_EDGE_URL": f"http://{host}:{self.settings.port}",
            "TOLLGATE_BATCH_TOKEN": self.settings.batch_token,
            "TOLLGATE_BATCH_CONCURRENCY": str(self.settings.batch_concurrency),
        }

    def fold_status(self) -> FoldStatus:
        """The folds' last report (worker_status), read at most once a second."""
        now = time.monotonic()
        if self._fold_status is None or now - self._fold_status[0] > 1.0:
            at = datetime.now(UTC)
            stale_s = self.settings.pipeline_stale_s
            self._fold_status = (now, read_fold_status(self.engine, at, stale_s=stale_s))
            # The heartbeats are FoldStatus's; the rest of the pipeline's staleness from here.
            status = read_status(
                self.engine, at, stale_s=stale_s, heartbeats=False,
                unbilled_alarm_s=self.settings.unbilled_alarm_s,
            )  # fmt: skip
            self._pipeline_stale = status.problems
            self.reconciliation = status.reconciliation
            self.dead_letters = status.dead_letters
        return self._fold_status[1]

    def batch_runner_alive(self) -> bool:
        """Some batch runner's heartbeat is fresher than the pipeline's stale threshold; read at
        most once a second (from a worker thread: the batch routes call it off the loop)."""
        now = time.monotonic()
        if self._runner_seen is None or now - self._runner_seen[0] > 1.0:
            found = last_heartbeat(self.engine, BATCH_RUNNER_NAME)
            age = None if found is None else (datetime.now(UTC) - found).total_seconds()
            alive = age is not None and age <= self.settings.pipeline_stale_s
            self._runner_seen = (now, alive)
        return self._runner_seen[1]

    # --- views for the routes ------------------------------------------------------------------

    def fleet_models(self, caller: Caller | None = None) -> list[dict[str, Any]]:
        """The models on sale, then the caller's own LoRA adapters as vLLM lists them (`parent`:
        the base version serving it; `owned_by`: the tenant): no other tenant's, ever."""
        assert self.fleet is not None
        on_sale = [
            {"id": model, "object": "model", "created": 0, "owned_by": "tollgate"}
            for model in self.edge.models()
        ]
        own = [] if caller is None else self.edge.adapters(caller)
        return on_sale + [
            {"id": lora.adapter.name, "object": "model",
             "created": int(lora.adapter.registered_at.timestamp()),
             "owned_by": lora.adapter.tenant_id, "parent": lora.model}
            for lora in own
        ]  # fmt: skip

    def readiness(self) -> tuple[list[str], list[str]]:
        """(problems that make this edge unready, warnings that do not)."""
        folds = self.fold_status()
        problems = [*folds.problems, *(f"pipeline: {p}" for p in self._pipeline_stale)]
        warnings = list(folds.warnings)
        if self.control_error:
            problems.append(f"control plane: {self.control_error}")
        if self.log_error:
            problems.append(f"other edges' admissions: {self.log_error}")
        if self.fleet is None or not any(r.healthy for r in self.fleet.replicas()):
            problems.append("no healthy replica")
        return problems, warnings

    def refresh_gauges(self) -> None:
        if self.fleet is not None:
            self.metrics.models.known = frozenset(self.fleet.models())
        self.metrics.refresh_ratios()
        if self.predictor is not None:
            for tenant, (covered, _, _) in self.predictor.coverage().items():
                label = self.metrics.tenant_label(tenant)
                self.metrics.output_prediction_coverage.labels(label).set(covered)
        folds = self.fold_status()
        self.metrics.billing_lag.set(folds.billing_lag)
        self.metrics.billing_dead_letters.set(folds.dead_letters)
        for fold in {*DEAD_LETTER_FOLDS, *self.dead_letters}:
            self.metrics.dead_letters.labels(fold).set(self.dead_letters.get(fold, 0))
        self.metrics.reconciliation.observe(self.reconciliation)
        if self.fleet is None:
            return
        for replica in self.fleet.replicas():
            labels = (replica.replica_id, replica.replica.model)
            self.metrics.fleet.kv_occupancy.labels(*labels).set(replica.scraped_occupancy_ppm / 1e6)
            self.metrics.fleet.replica_healthy.labels(*labels).set(1 if replica.healthy else 0)

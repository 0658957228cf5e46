"""The pipeline's lags and what is stale, read from PostgreSQL (`relay_state`, `consumer_offsets`,
`worker_status`, `events`) and, for a consumer group's lag, the broker's high watermarks: what
`tollgate status` prints, what an edge's /readyz calls stale, what the relay's and the Kafka
worker's /metrics export.

Stale means *behind and not moving*: a relay with unpublished events whose last publish is older
than the threshold, a partition with unconsumed messages whose group committed nothing for that
long, a worker whose heartbeat is that old, or events after a worker's position older than that.
A lag alone is not stale (a burst is lag too); a quiet pipeline with nothing to do is never stale.

Every worker process has its own `worker_status` row (each member of a consumer group, the batch
runner), so a dead one shows: its heartbeat ages and it is stale, until it is forgotten
(FORGET_AFTER_S; a clean stop deletes its row at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from tollgate_llm.domain.gaps import OVERDUE_GRACE_S
from tollgate_llm.ledger.dead_letters import counts_by_fold
from tollgate_llm.ledger.outbox import backlog_after
from tollgate_llm.ledger.schema import (
    consumer_offsets,
    events,
    reconciliation_status,
    relay_state,
    worker_status,
)
from tollgate_llm.streams.topics import client_settings, confluent, group_for

# The default threshold, also the edges' limit on a worker's heartbeat.
DEFAULT_STALE_S = 10.0
# A worker row whose heartbeat is older than this is a process long gone (killed, its machine
# lost): no longer listed nor stale, and deleted when another process of its name starts. An
# hour of alarm is enough to be seen; forever would page for a worker replaced long ago.
FORGET_AFTER_S = 3600.0
# The name of the batch runner's row (streams/batch_runner.py): not a fold worker.
BATCH_RUNNER_NAME = "batch-runner"
# A relay's last publish must be this much later than a group's last commit before the group is
# suspected of missing it: the relay saves its place a few milliseconds after the broker
# acknowledged, and a worker may commit those very messages within that window.
PUBLISH_COMMIT_MARGIN_S = 1.0

# A terminal event without its ledger row for longer than this is an alarm (the billing lag's
# target is 2 s at p99; a worker restart or a rebalance takes several seconds more).
DEFAULT_UNBILLED_ALARM_S = 30.0

# Watermarks: (topic, partitions or None for all of the topic's) -> {partition: high watermark}.
Watermarks = Callable[[str, Iterable[int] | None], Mapping[int, int]]


@dataclass(frozen=True, slots=True)
class RelayLag:
    topic: str
    epoch: int
    published_position: int  # the last position the broker acknowledged
    published: int  # events published this epoch
    lag_events: int  # stored events after the relay's place
    last_publish_age_s: float


@dataclass(frozen=True, slots=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    committed_offset: int  # the next offset the group reads (0: never committed this epoch)
    high_watermark: int | None  # None: not asked (no broker)
    last_commit_age_s: float | None  # None: never committed

    @property
    def lag_messages(self) -> int | None:
        if self.high_watermark is None:
            return None
        return max(0, self.high_watermark - self.committed_offset)


@dataclass(frozen=True, slots=True)
class WorkerLag:
    """One worker process's row: a fold worker, a member of the folds' consumer group, or the
    batch runner."""

    name: str
    member: str  # "host:pid"
    pid: int
    host: str
    heartbeat_age_s: float
    # The worker's position in the store (the SQL tail's; the sweeper's, in the one Kafka
    # member that leads it); None: it follows none.
    position: int | None
    lag_events: int  # stored events after that position (0 without one)
    oldest_unapplied_age_s: float | None
    billing_lag_events: int
    error: str | None
    partitions: str | None = None  # a Kafka member's assignment
    last_batch_age_s: float | None = None  # None: no batch with records yet
    lag_messages: int | None = None  # on its partitions, as the member last knew
    stale: bool = False  # its heartbeat is older than the threshold: dead, or hung


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The continuous reconciliation's last result (streams/reconciler.py), its ages read now."""

    checked_age_s: float
    position: int
    unbilled_terminals: int
    oldest_unbilled_age_s: float | None
    overdue_leases: int
    oldest_overdue_age_s: float | None
    sample: str | None


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    # "kafka" (a broker was asked), "kafka-unprobed" (a relay reported, no broker was asked)
    # or "embedded"
    mode: str
    head_position: int
    relays: tuple[RelayLag, ...] = ()
    partitions: tuple[PartitionLag, ...] = ()
    workers: tuple[WorkerLag, ...] = ()
    reconciliation: Reconciliation | None = None
    # Unreplayed dead letters per fold (ledger/dead_letters.py): each fold with any alarms.
    dead_letters: dict[str, int] = field(default_factory=dict)
    stale: tuple[str, ...] = field(default=())
    # Gaps in the money path (DESIGN §4 invariant 14): pages, not lag.
    alarms: tuple[str, ...] = field(default=())

    @property
    def problems(self) -> tuple[str, ...]:
        return self.stale + self.alarms

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["stale"] = list(self.stale)
        body["alarms"] = list(self.alarms)
        for row, p in zip(body["partitions"], self.partitions, strict=True):
            row["lag_messages"] = p.lag_messages
        return body


# --- reading --------------------------------------------------------------------------------------


def head_position(conn: sa.Connection) -> int:
    head = conn.execute(sa.select(sa.func.coalesce(sa.func.max(events.c.position), 0))).scalar()
    return int(head or 0)


def relay_lags(conn: sa.Connection, now: datetime) -> list[RelayLag]:
    """Every relay's place (one `relay_state` row per topic) and the events after it."""
    lags = []
    for row in conn.execute(sa.select(relay_state).order_by(relay_state.c.topic)).mappings():
        backlog = backlog_after(conn, (row["last_txid"], row["last_position"]))
        lags.append(
            RelayLag(
                row["topic"], row["epoch"], row["last_position"], row["published"],
                backlog, _age(now, row["updated_at"]),
            )
        )
    return lags


def partition_lags(
    conn: sa.Connection,
    now: datetime,
    groups: Mapping[str, str],
    watermarks: Watermarks | None = None,
) -> list[PartitionLag]:
    """Each group's saved offset per partition (`groups`: group -> topic). With `watermarks`,
    every partition of the topic (one the group never committed is at offset 0) and its high
    watermark; without, the partitions the group has rows for. An offset saved in an older relay
    epoch counts as 0: the consumer reads that partition again from its start."""
    epochs = {r.topic: r.epoch for r in conn.execute(sa.select(relay_state))}
    lags = []
    for group, topic in sorted(groups.items()):
        rows = {
            r.partition: r
            for r in conn.execute(
                sa.select(consumer_offsets).where(
                    consumer_offsets.c.consumer_group == group, consumer_offsets.c.topic == topic
                )
            )
        }
        highs = dict(watermarks(topic, None)) if watermarks is not None else {}
        for partition in sorted(set(rows) | set(highs)):
            row = rows.get(partition)
            current = row is not None and row.epoch == epochs.get(topic, row.epoch)
            lags.append(
                PartitionLag(
                    group, topic, partition, row.next_offset if row is not None and current else 0,
                    highs.get(partition), _age(now, row.updated_at) if row is not None else None,
                )
            )
    return lags


def worker_lags(
    conn: sa.Connection, now: datetime, stale_s: float = DEFAULT_STALE_S
) -> list[WorkerLag]:
    """Every worker process's row but the forgotten ones (FORGET_AFTER_S), with the events
    after its position; `stale` where its heartbeat is older than `stale_s`."""
    forgotten = now - timedelta(seconds=FORGET_AFTER_S)
    lags = []
    for row in conn.execute(
        sa.select(worker_status)
        .where(worker_status.c.heartbeat_at >= forgotten)
        .order_by(worker_status.c.name, worker_status.c.member)
    ).mappings():
        count, oldest = 0, None
        if row["position"] is not None:
            count, oldest = conn.execute(
                sa.select(sa.func.count(), sa.func.min(events.c.occurred_at)).where(
                    events.c.position > row["position"]
                )
            ).one()
        age = _age(now, row["heartbeat_at"])
        lags.append(
            WorkerLag(
                row["name"], row["member"], row["pid"], row["host"], age, row["position"],
                int(count), _age(now, oldest) if oldest else None, row["billing_lag"],
                row["error"], row["partitions"],
                _age(now, row["last_batch_at"]) if row["last_batch_at"] else None, row["lag"],
                age > stale_s,
            )
        )
    return lags


def reconciliation(conn: sa.Connection, now: datetime) -> Reconciliation | None:
    """The freshest reconciler's row (one leads; a row left by an old leader is older)."""
    row = (
        conn.execute(
            sa.select(reconciliation_status).order_by(reconciliation_status.c.checked_at.desc())
        )
        .mappings()
        .first()
    )
    if row is None:
        return None
    return Reconciliation(
        _age(now, row["checked_at"]), row["position"], row["unbilled_terminals"],
        _age(now, row["oldest_unbilled_at"]) if row["oldest_unbilled_at"] else None,
        row["overdue_leases"],
        _age(now, row["oldest_overdue_at"]) if row["oldest_overdue_at"] else None,
        row["sample"],
    )  # fmt: skip


def folds_groups(conn: sa.Connection) -> dict[str, str]:
    """The consumer groups to report: every group with saved offsets, and the folds' group of
    every topic the relay publishes (a group that never committed lags too)."""
    groups = {
        r.consumer_group: r.topic
        for r in conn.execute(
            sa.select(consumer_offsets.c.consumer_group, consumer_offsets.c.topic).distinct()
        )
    }
    for (topic,) in conn.execute(sa.select(relay_state.c.topic)):
        groups.setdefault(group_for(topic), topic)
    return groups


def read_status(
    engine: sa.Engine,
    now: datetime,
    *,
    watermarks: Watermarks | None = None,
    stale_s: float = DEFAULT_STALE_S,
    heartbeats: bool = True,
    unbilled_alarm_s: float = DEFAULT_UNBILLED_ALARM_S,
) -> ClusterStatus:
    """The whole pipeline's lags, what is stale at `stale_s`, and the alarms. `heartbeats=False`
    leaves the workers' heartbeat age out of `stale` (an edge reports it already, from
    FoldStatus)."""
    with engine.connect() as conn:
        head = head_position(conn)
        relays = relay_lags(conn, now) if engine.dialect.name == "postgresql" else []
        groups = folds_groups(conn)
        partitions = partition_lags(conn, now, groups, watermarks)
        workers = worker_lags(conn, now, stale_s)
        checked = reconciliation(conn, now)
        dead = counts_by_fold(conn)
    mode = "kafka" if watermarks is not None else "kafka-unprobed" if relays else "embedded"
    status = ClusterStatus(
        mode, head, tuple(relays), tuple(partitions), tuple(workers), checked, dead
    )
    return replace(
        status,
        stale=stale_parts(status, stale_s, heartbeats=heartbeats),
        alarms=alarms(status, stale_s, unbilled_alarm_s),
    )


def alarms(status: ClusterStatus, stale_s: float, unbilled_alarm_s: float) -> tuple[str, ...]:
    """One line per gap an operator is paged for: a terminal event without its ledger row past
    `unbilled_alarm_s`, an admitted request past its lease that nothing ended, and a
    reconciliation that stopped checking; and a fold with events it moved past unapplied."""
    dead = [dead_letter_problem(fold, n) for fold, n in sorted(status.dead_letters.items())]
    r = status.reconciliation
    if r is None:
        return tuple(dead)
    found: list[str] = []
    sample = f" (e.g. {r.sample})" if r.sample else ""
    if r.unbilled_terminals and (r.oldest_unbilled_age_s or 0.0) > unbilled_alarm_s:
        found.append(
            f"billing: {r.unbilled_terminals} terminal event(s) without a ledger row, the oldest "
            f"{r.oldest_unbilled_age_s:.0f} s old{sample}"
        )
    if r.overdue_leases:
        found.append(
            f"leases: {r.overdue_leases} admitted request(s) without a terminal event past the "
            f"lease TTL + {OVERDUE_GRACE_S:.0f} s, the oldest "
            f"unrenewed for {r.oldest_overdue_age_s or 0.0:.0f} s{sample}"
        )
    if r.checked_age_s > stale_s and status.head_position > r.position:
        found.append(
            f"reconciliation: last ran {r.checked_age_s:.0f} s ago, "
            f"{status.head_position - r.position} event(s) after its position"
        )
    return (*found, *dead)


def dead_letter_problem(fold: str, count: int) -> str:
    """The alarm of a fold's unreplayed dead letters (`tollgate status`, /readyz)."""
    return (
        f"dead letters: {fold} moved past {count} event(s) it could not apply "
        "(tollgate dead-letters list; once fixed, tollgate dead-letters replay)"
    )


# --- what is stale --------------------------------------------------------------------------------


def stale_parts(
    status: ClusterStatus, stale_s: float, *, heartbeats: bool = True
) -> tuple[str, ...]:
    """One line per part of the pipeline that is behind and has not moved for `stale_s`."""
    found: list[str] = []
    for r in status.relays:
        if r.lag_events and r.last_publish_age_s > stale_s:
            found.append(
                f"relay {r.topic}: {r.lag_events} event(s) unpublished, last publish "
                f"{r.last_publish_age_s:.0f} s ago"
            )
    last_publish = {r.topic: r.last_publish_age_s for r in status.relays}
    by_group: dict[str, list[PartitionLag]] = {}
    for p in status.partitions:
        by_group.setdefault(p.group, []).append(p)
    for group, parts in by_group.items():
        if any(p.high_watermark is not None for p in parts):
            for p in parts:
                age = p.last_commit_age_s
                if p.lag_messages and (age is None or age > stale_s):
                    since = "never committed" if age is None else f"last commit {age:.0f} s ago"
                    found.append(
                        f"consumer group {group}: partition {p.partition} {p.lag_messages} "
                        f"message(s) behind, {since}"
                    )
            continue
        # No broker asked (an edge's /readyz): the relay published after the group's last
        # commit, and the group has committed nothing for `stale_s`.
        ages = [p.last_commit_age_s for p in parts if p.last_commit_age_s is not None]
        published = last_publish.get(parts[0].topic)
        if not ages or published is None:
            continue
        latest = min(ages)
        if latest - published > PUBLISH_COMMIT_MARGIN_S and latest > stale_s:
            found.append(
                f"consumer group {group}: nothing committed for {latest:.0f} s, the relay "
                f"published {published:.0f} s ago"
            )
    folds = [w for w in status.workers if w.name != BATCH_RUNNER_NAME]
    if heartbeats and not folds and status.head_position:
        found.append(f"no worker has reported, {status.head_position} event(s) in the store")
    following = _following(status.workers)
    for w in status.workers:
        if heartbeats and w.heartbeat_age_s > stale_s:
            found.append(
                f"worker {w.name} (pid {w.pid} on {w.host}): last heartbeat "
                f"{w.heartbeat_age_s:.0f} s ago, dead or hung"
            )
        age = w.oldest_unapplied_age_s
        if w in following and w.lag_events and age is not None and age > stale_s:
            found.append(
                f"worker {w.name}: {w.lag_events} event(s) after its position {w.position}, "
                f"the oldest {age:.0f} s old"
            )
    return tuple(found)


def _following(workers: Iterable[WorkerLag]) -> list[WorkerLag]:
    """Per name, the freshest row with a store position: where that name's folds are. A dead
    process's frozen position is not (its heartbeat says it is dead; the process that took over
    reports its own), so a replaced worker does not hold the edges unready."""
    freshest: dict[str, WorkerLag] = {}
    for w in workers:
        if w.position is not None and (
            w.name not in freshest or w.heartbeat_age_s < freshest[w.name].heartbeat_age_s
        ):
            freshest[w.name] = w
    return list(freshest.values())


def _age(now: datetime, then: datetime) -> float:
    return max(0.0, (now - then).total_seconds())


# --- the broker -----------------------------------------------------------------------------------


class BrokerWatermarks:
    """High watermarks from the cluster (confluent-kafka, imported when this is built: a plain
    install reports what is missing then, not before)."""

    def __init__(
        self, bootstrap: str, *, timeout_s: float = 10.0,
        kafka_settings: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self._ck = confluent()
        self.timeout_s = timeout_s
        self._consumer = self._ck.Consumer(
            client_settings(bootstrap, {"group.id": "tollgate.status-probe",
                                        "enable.auto.commit": False},
                            kafka_settings=kafka_settings)
        )

    def __call__(self, topic: str, partitions: Iterable[int] | None) -> dict[int, int]:
        if partitions is None:
            metadata = self._consumer.list_topics(topic, timeout=self.timeout_s)
            found = metadata.topics.get(topic)
            if found is None or found.error is not None:
                return {}
            partitions = sorted(found.partitions)
        highs = {}
        for p in partitions:
            tp = self._ck.TopicPartition(topic, p)
            _low, high = self._consumer.get_watermark_offsets(
                tp, timeout=self.timeout_s, cached=False
            )
            highs[p] = int(high)
        return highs

    def close(self) -> None:
        self._consumer.close()


def cluster_status(
    database_url: str, bootstrap: str | None, stale_s: float = DEFAULT_STALE_S,
    unbilled_alarm_s: float = DEFAULT_UNBILLED_ALARM_S,
    *, kafka_settings: Mapping[str, str] | None = None,
) -> ClusterStatus:
    """`tollgate status`: the pipeline behind `database_url`, with the broker's watermarks when
    `bootstrap` is given (the distributed mode), else the embedded SQL-tail worker's lag."""
    from tollgate_llm.ledger.engine import create_engine_from_url

    engine = create_engine_from_url(database_url)
    watermarks = (
        BrokerWatermarks(bootstrap, kafka_settings=kafka_settings) if bootstrap else None
    )
    try:
        return read_status(
            engine, datetime.now(UTC), watermarks=watermarks, stale_s=stale_s,
            unbilled_alarm_s=unbilled_alarm_s,
        )  # fmt: skip
    finally:
        if watermarks is not None:
            watermarks.close()
        engine.dispose()


# --- the table ------------------------------------------------------------------------------------


def render_table(status: ClusterStatus) -> str:
    """`tollgate status`'s text: one section per part, then what is stale."""
    mode = status.mode
    if mode == "kafka-unprobed":
        mode += " (give --kafka-bootstrap for the high watermarks)"
    out = [f"mode: {mode}    store head position: {status.head_position}", ""]
    if status.relays:
        out += _table(
            ("RELAY TOPIC", "EPOCH", "PUBLISHED POS", "HEAD", "LAG (EVENTS)", "LAST PUBLISH"),
            [(r.topic, r.epoch, r.published_position, status.head_position, r.lag_events,
              f"{r.last_publish_age_s:.1f} s ago") for r in status.relays],
        )
    if status.partitions:
        out += _table(
            ("GROUP", "TOPIC", "PARTITION", "COMMITTED", "HIGH WATERMARK", "LAG", "LAST COMMIT"),
            [(p.group, p.topic, p.partition, p.committed_offset,
              "-" if p.high_watermark is None else p.high_watermark,
              "-" if p.lag_messages is None else p.lag_messages,
              "never" if p.last_commit_age_s is None else f"{p.last_commit_age_s:.1f} s ago")
             for p in status.partitions],
        )
    if status.workers:
        out += _table(
            ("WORKER", "PID", "HOST", "STATE", "HEARTBEAT", "PARTITIONS", "LAST BATCH", "LAG",
             "POSITION", "HEAD", "LAG (EVENTS)", "BILLING LAG", "ERROR"),
            [(w.name, w.pid, w.host, "STALE" if w.stale else "alive",
              f"{w.heartbeat_age_s:.1f} s ago", w.partitions or "-",
              "-" if w.last_batch_age_s is None else f"{w.last_batch_age_s:.1f} s ago",
              "-" if w.lag_messages is None else w.lag_messages,
              "-" if w.position is None else w.position, status.head_position,
              w.lag_events, w.billing_lag_events, w.error or "-")
             for w in status.workers],
        )  # fmt: skip
    else:
        out += ["no worker has reported (worker_status is empty)", ""]
    r = status.reconciliation
    if r is not None:
        out += _table(
            ("RECONCILED", "POSITION", "UNBILLED TERMINALS", "OLDEST UNBILLED", "OVERDUE LEASES",
             "OLDEST OVERDUE"),
            [(f"{r.checked_age_s:.1f} s ago", r.position, r.unbilled_terminals,
              "-" if r.oldest_unbilled_age_s is None else f"{r.oldest_unbilled_age_s:.1f} s",
              r.overdue_leases,
              "-" if r.oldest_overdue_age_s is None else f"{r.oldest_overdue_age_s:.1f} s")],
        )  # fmt: skip
    if status.dead_letters:
        out += _table(
            ("FOLD", "DEAD LETTERS (UNREPLAYED)"),
            [(fold, n) for fold, n in sorted(status.dead_letters.items())],
        )
    if status.alarms:
        out += ["ALARMS:", *(f"  {line}" for line in status.alarms)]
    if status.stale:
        out += ["STALE:", *(f"  {line}" for line in status.stale)]
    elif not status.alarms:
        out.append("nothing stale")
    return "\n".join(out)


def _table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    cells = [header, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    return [*lines, ""]

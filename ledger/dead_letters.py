"""Dead letters: the events a fold could not apply, kept so the fold can move past them.

One event that a fold cannot apply must never stop the others (DESIGN.md invariant 12). A fold
that fails on one event alone, twice, while the database answers, records it here (its fold, its
place in the store and, on Kafka, on the topic, and why) and moves past it; every other event is
applied as usual. Nothing here is silent: `counts_by_fold` feeds `tollgate status`, /metrics
(`tollgate_dead_letters{fold}`) and /readyz, and `tollgate dead-letters replay` applies them again
through the same fold code once the fold (or its database) is fixed.

A failure of the database itself (down, connection dropped, lock timeout, serialization failure)
is never a dead letter: `is_transient` tells them apart, and the fold retries the whole batch.

The table is not an event projection: rows are written, failed again and marked replayed in
place. A row is keyed by (fold, event id), so recording the same failure twice (a worker that
died before moving past the event meets it again) keeps one row and counts the failures.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.projections import PROJECTIONS
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.errors import StoreBusy, StoreUnavailable
from tollgate_llm.ledger.schema import dead_letters as t

__all__ = [
    "FOLDS",
    "REASON_CHARS",
    "DeadLetter",
    "counts_by_fold",
    "database_answers",
    "is_transient",
    "listing",
    "mark_replayed",
    "reason_of",
    "record",
    "storable",
]

# The folds that dead-letter (the billing fold and every read model), a bounded label set:
# /metrics shows each, at 0 when it has none.
FOLDS = ("billing", *(spec.name for spec in PROJECTIONS))

# The reason kept per dead letter: enough for the exception and the value that broke it.
REASON_CHARS = 500


def storable(text: str, limit: int | None = None) -> str:
    """`text` as both backends can hold it: NUL (which PostgreSQL's text refuses) and the other
    C0 controls but tab and newline written as \\xNN, lone surrogates as \\udNNN; cut to `limit`
    characters. The poison event's own values end up in its reason and ids, which must not make
    the dead letter itself unstorable."""
    out = []
    for ch in text:
        code = ord(ch)
        if (code < 0x20 and ch not in "\t\n") or code == 0x7F:
            out.append(f"\\x{code:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    escaped = "".join(out)
    if limit is not None and len(escaped) > limit:
        escaped = escaped[: limit - 1] + "…"
    return escaped


def reason_of(exc: BaseException) -> str:
    """The reason recorded for `exc`: its type and message (a domain rule: the rule's name and
    message, as the billing fold records it), storable, at most REASON_CHARS."""
    if isinstance(exc, DomainError):
        return storable(f"{exc.rule}: {exc.message}", REASON_CHARS)
    return storable(f"{type(exc).__name__}: {exc}", REASON_CHARS)


def is_transient(exc: BaseException) -> bool:
    """A failure of the database rather than of the event: retried, never dead-lettered.

    OperationalError covers a server that is down or restarting, a dropped connection, a lock
    or statement timeout, a deadlock and a serialization failure (psycopg's and sqlite3's
    classes map there); InterfaceError a connection closed under the driver; a DBAPIError whose
    connection SQLAlchemy invalidated is a disconnect whatever its class; TimeoutError the pool's
    (SQLAlchemy's) and the OS's; and the store's own `StoreUnavailable` and `StoreBusy`, whatever
    their cause (the store raises the first without one when it cannot connect at all: taken for
    the event's fault, a bill was dead-lettered — found by the fault matrix, distributed
    `before`, seed 8)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:  # through causes: a wrapped fault
        seen.add(id(current))
        if isinstance(current, _TRANSIENT):
            return True
        if isinstance(current, sa.exc.DBAPIError) and current.connection_invalidated:
            return True
        current = current.__cause__
    return False


def _transient_classes() -> tuple[type[BaseException], ...]:
    classes: list[type[BaseException]] = [
        sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError, TimeoutError,
        ConnectionError, sqlite3.OperationalError, sqlite3.InterfaceError, StoreUnavailable,
        StoreBusy,
    ]  # fmt: skip
    try:  # the drivers' own classes, for a failure raised on the driver (COPY) unwrapped
        import psycopg

        classes += [psycopg.OperationalError, psycopg.InterfaceError]
    except ImportError:  # the plain install has no PostgreSQL driver
        pass
    return tuple(classes)


_TRANSIENT = _transient_classes()


def database_answers(engine: sa.Engine) -> bool:
    """Whether the database answers a trivial query now: a failure that repeats while it does
    is the event's, not the database's."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception:
        return False
    return True


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One event a fold could not apply. `position` is the event's place in the store; `topic`,
    `partition` and `offset` its place on the event topic when a Kafka worker met it."""

    fold: str
    event_id: str
    stream_id: str
    event_type: str
    tenant_id: str
    position: int | None
    reason: str
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None

    @classmethod
    def of(
        cls, fold: str, record: Recorded, exc_or_reason: BaseException | str, *,
        topic: str | None = None, partition: int | None = None, offset: int | None = None,
    ) -> DeadLetter:  # fmt: skip
        reason = (
            storable(exc_or_reason, REASON_CHARS)
            if isinstance(exc_or_reason, str)
            else reason_of(exc_or_reason)
        )
        return cls(
            fold, storable(record.event_id, 64), storable(record.stream_id, 255),
            storable(record.type, 100), storable(record.tenant_id, 255),
            record.position or None, reason, topic, partition, offset,
        )  # fmt: skip


def _insert(conn: sa.Connection) -> Any:
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert
    from sqlalchemy.dialects import sqlite

    return sqlite.insert


@faults.seam("db.readmodel")
def record(conn: sa.Connection, letters: Iterable[DeadLetter], now: datetime) -> int:
    """Record `letters` inside the caller's transaction (the one that moves the fold past them);
    returns how many. One row per (fold, event id): a repeat keeps its first instant, takes the
    new reason, counts the failure and is unreplayed again."""
    rows = [
        {
            "fold": d.fold,
            "event_id": d.event_id,
            "position": d.position,
            "topic": d.topic,
            "kafka_partition": d.partition,
            "kafka_offset": d.offset,
            "stream_id": d.stream_id,
            "event_type": d.event_type,
            "tenant_id": d.tenant_id,
            "reason": d.reason,
            "failures": 1,
            "first_failed_at": now,
            "last_failed_at": now,
            "replayed_at": None,
        }  # fmt: skip
        for d in letters
    ]
    if not rows:
        return 0
    insert = _insert(conn)(t)
    conn.execute(
        insert.on_conflict_do_update(
            index_elements=["fold", "event_id"],
            set_={
                "reason": insert.excluded.reason,
                "last_failed_at": insert.excluded.last_failed_at,
                "failures": t.c.failures + 1,
                "replayed_at": None,
            },
        ),
        rows,
    )
    return len(rows)


def counts_by_fold(conn: sa.Connection) -> dict[str, int]:
    """Unreplayed dead letters per fold (folds without any are absent)."""
    query = (
        sa.select(t.c.fold, sa.func.count())
        .where(t.c.replayed_at.is_(None))
        .group_by(t.c.fold)
        .order_by(t.c.fold)
    )
    return {fold: int(n) for fold, n in conn.execute(query)}


def listing(
    conn: sa.Connection, *, fold: str | None = None, include_replayed: bool = False
) -> list[dict[str, Any]]:
    """The dead letters as rows (dicts over the table's columns), oldest first."""
    query = sa.select(t).order_by(t.c.first_failed_at, t.c.fold, t.c.event_id)
    if fold is not None:
        query = query.where(t.c.fold == fold)
    if not include_replayed:
        query = query.where(t.c.replayed_at.is_(None))
    # str(): the keys are quoted_name, which not every serializer takes for a str
    return [{str(k): v for k, v in row.items()} for row in conn.execute(query).mappings()]


def mark_replayed(conn: sa.Connection, fold: str, event_id: str, now: datetime) -> None:
    """The fold applied the event on a replay: kept for the record, no longer counted."""
    conn.execute(
        t.update().where(t.c.fold == fold, t.c.event_id == event_id).values(replayed_at=now)
    )


def unreplayed_streams(conn: sa.Connection, fold: str) -> set[str]:
    """The streams with an unreplayed dead letter of `fold`."""
    query = sa.select(t.c.stream_id).where(t.c.fold == fold, t.c.replayed_at.is_(None))
    return set(conn.execute(query).scalars())


def resolve_streams(
    conn: sa.Connection, fold: str, stream_ids: Iterable[str], now: datetime
) -> None:
    """`fold` has since applied these streams' events (a billing fold run again over them):
    their dead letters count as replayed."""
    conn.execute(
        t.update()
        .where(t.c.fold == fold, t.c.stream_id.in_(list(stream_ids)), t.c.replayed_at.is_(None))
        .values(replayed_at=now)
    )


def failed_again(conn: sa.Connection, fold: str, event_id: str, reason: str, now: datetime) -> None:
    """A replay failed too: the dead letter stays, with its new reason."""
    conn.execute(
        t.update()
        .where(t.c.fold == fold, t.c.event_id == event_id)
        .values(
            reason=storable(reason, REASON_CHARS),
            last_failed_at=now,
            failures=t.c.failures + 1,
        )  # fmt: skip
    )

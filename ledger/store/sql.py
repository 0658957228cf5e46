"""`SqlEventStore`: the event store on SQLite or PostgreSQL through SQLAlchemy Core (with
PostgreSQL's write path, COPY for large group commits, in ledger.store.postgres, SQLite's hot
paths on the driver in ledger.store.sqlite, and a log follower's reads in ledger.store.tails)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from tollgate_llm.domain.envelope import Recorded, new_recorded
from tollgate_llm.domain.registry import from_payload
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.engine import SQLITE_BUSY_TIMEOUT_MS, WRITE, open_sqlite_appender
from tollgate_llm.ledger.errors import BadDatabaseUrl, StoreBusy, StoreUnavailable
from tollgate_llm.ledger.schema import events as events_table
from tollgate_llm.ledger.store import postgres, sqlite, tails
from tollgate_llm.ledger.store.planning import (
    COLUMNS,
    IdsNeedChecking,
    Stored,
    StoredRow,
    finish_appends,
    plan_appends,
    prepare_batches,
)
from tollgate_llm.ledger.store.port import AppendBatch, AppendResult, EventStore, NewEvent

_SELECT = sa.select(*(events_table.c[name] for name in COLUMNS))
_VERSIONS = (
    sa.select(events_table.c.stream_id, sa.func.max(events_table.c.stream_version))
    .where(events_table.c.stream_id.in_(sa.bindparam("ids", expanding=True)))
    .group_by(events_table.c.stream_id)
)
# One index probe per stream (the max of (stream_id, stream_version) is the last index entry):
# grouping over `stream_id = ANY(:ids)` read every entry of each stream instead, so appends to a
# long stream (an edge's LeasesRenewed) got slower with its length, and large groups turned into
# a full scan (measured in bench/finance_scale.py at 8M events).
_PG_VERSIONS = sa.text(
    "SELECT s.id, (SELECT max(e.stream_version) FROM events e WHERE e.stream_id = s.id) "
    "FROM unnest(:ids) AS s(id)"
).bindparams(sa.bindparam("ids", type_=ARRAY(sa.String())))


class _ConflictHandled(logging.Filter):
    """Drops psycopg's warning that a pipeline aborted by an error was closed with that error
    ignored, and keeps every other record. An append's first attempt lets UNIQUE find a conflict
    (a multi-row insert runs in a pipeline) and the store answers it (WrongExpectedVersion, or
    the stored records), so the note is no news: a CLI refused for a race printed it as a second
    line beside its one-line error."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "error ignored terminating %r: %s" and args
                    and type(args[0]).__name__ == "Pipeline")  # fmt: skip


_CONFLICT_HANDLED = _ConflictHandled()


def _prefixed(prefixes: Sequence[str]) -> sa.ColumnElement[bool]:
    c = events_table.c
    return sa.or_(sa.false(), *(c.stream_id.startswith(p, autoescape=True) for p in prefixes))


def _recorded_from_row(
    position: int, event_id: str, stream_id: str, stream_version: int, tenant_id: str,
    occurred_at: datetime, type_: str, version: int, payload: str,
) -> Recorded:  # fmt: skip
    """A row of COLUMNS (through SQLAlchemy's result processing) straight to the envelope the
    folds read: by position, without the stored form in between (a tail decodes every row;
    this was a third of a read's CPU)."""
    event = from_payload(type_, version, orjson.loads(payload))
    return new_recorded(
        event_id, stream_id, stream_version, tenant_id, occurred_at, event, position
    )


# Records a reader already holds, by position (`EventStore.read_all`'s `known`).
Known = Mapping[int, Recorded] | None


def _decode_row(row: Any) -> Recorded:
    return _recorded_from_row(*row)


def _stored_from_row(r: Any) -> Stored:
    row = StoredRow(
        r.event_id, r.stream_id, r.tenant_id, r.occurred_at, r.type, r.version, r.payload
    )
    return Stored(row, r.stream_version, r.position)


def _drop_handled_conflict_warnings() -> None:
    """psycopg's warning for a conflict the store handles (once per process)."""
    log = logging.getLogger("psycopg")
    if _CONFLICT_HANDLED not in log.filters:
        log.addFilter(_CONFLICT_HANDLED)


class SqlEventStore(EventStore):
    """The event store on SQLite or PostgreSQL (see EventStore for the contract).

    Appends are serialised per database: BEGIN IMMEDIATE on SQLite, `LOCK TABLE events IN
    EXCLUSIVE MODE` on PostgreSQL (readers are not blocked). That makes positions follow commit
    order, which a reader tailing by position needs (a sequence alone hands out numbers in
    start order, not commit order), and lets one pre-read of stream versions decide every batch
    of a group commit without savepoints. UNIQUE (stream_id, stream_version) and UNIQUE
    (event_id) still guard the table against any writer that skips the lock.

    `before_commit` hooks run inside the append transaction with the new records (for inline
    projections); an exception there aborts the whole append.
    """

    def __init__(self, engine: sa.Engine, *, copy_min_rows: int = 64) -> None:
        self._engine = engine
        self._pg = engine.dialect.name == "postgresql"
        if not self._pg and engine.dialect.name != "sqlite":
            raise BadDatabaseUrl(f"unsupported database {engine.dialect.name!r}")
        # Below this many rows a plain executemany beats COPY's set-up (bench/store_append.py).
        self._copy_min_rows = copy_min_rows
        self.before_commit: list[Callable[[sa.Connection, list[Recorded]], None]] = []
        self._appenders = threading.local()  # SQLite: each thread's append connection
        if self._pg:
            _drop_handled_conflict_warnings()
            self._pg_appender = postgres.Appender(engine)

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    # writes

    def append(
        self, stream_id: str, expected_version: int | None, events: Sequence[NewEvent]
    ) -> list[Recorded]:
        return self.append_many([AppendBatch(stream_id, expected_version, events)])[0].unwrap()

    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        return self._append_many(batches, wait=True)

    @property
    def can_try_append(self) -> bool:
        """Whether try_append_many can be cheap enough to call on an event loop: SQLite (a
        local file, no round trip) without inline hooks."""
        return not self._pg and not self.before_commit

    def try_append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        """append_many, but if another connection holds the write lock, raise StoreBusy at once
        (nothing written) instead of waiting for it. SQLite only (see can_try_append)."""
        if not self.can_try_append:
            raise StoreBusy("try_append_many needs SQLite without before_commit hooks")
        return self._append_many(batches, wait=False)

    @faults.seam("store.append")
    def _append_many(self, batches: Sequence[AppendBatch], *, wait: bool) -> list[AppendResult]:
        prepared = prepare_batches(batches)
        if not any(prepared):
            return [AppendResult(b.stream_id) for b in batches]
        try:
            # Retries are rare, so the first attempt lets the UNIQUE index find repeated ids
            # instead of looking every id up.
            return self._append(batches, prepared, check_ids=False, wait=wait)
        except IdsNeedChecking:
            return self._append(batches, prepared, check_ids=True, wait=wait)

    def _append(
        self, batches: Sequence[AppendBatch], prepared: list[list[StoredRow]], *,
        check_ids: bool, wait: bool = True,
    ) -> list[AppendResult]:  # fmt: skip
        if self.can_try_append:
            return self._sqlite_append(batches, prepared, check_ids=check_ids, wait=wait)
        if self._pg and not (check_ids or self.before_commit):
            return self._pg_appender.append(batches, prepared, copy_min_rows=self._copy_min_rows)
        try:
            with self._write_transaction() as conn:
                # expected_version 0 needs no read: version 1 of an existing stream is already
                # taken, so UNIQUE (stream_id, stream_version) refuses the insert and the
                # checking pass below reports the conflict.
                versions = self._versions(
                    conn,
                    {b.stream_id for b in batches if check_ids or b.expected_version != 0},
                )
                if check_ids:
                    every = self._by_ids(conn, [r.event_id for rows in prepared for r in rows])

                    def lookup(ids: list[str]) -> dict[str, Stored]:
                        return {i: every[i] for i in ids if i in every}
                else:

                    def lookup(ids: list[str]) -> dict[str, Stored]:
                        return self._by_ids(conn, ids)

                plan = plan_appends(batches, prepared, versions, lookup, check_ids=check_ids)
                first = _insert(conn, plan.to_write, self._pg, self._copy_min_rows)
                results = finish_appends(plan, batches, first)
                if self.before_commit and plan.to_write:
                    written = [s.recorded() for s in plan.to_write]
                    for hook in self.before_commit:
                        hook(conn, written)
                return results
        except sa.exc.IntegrityError:
            if check_ids:
                raise
            raise IdsNeedChecking() from None
        except sa.exc.OperationalError as exc:
            raise StoreUnavailable(f"event store unavailable: {_first_line(exc)}") from exc

    def _write_transaction(self) -> Any:
        return _WriteTransaction(self._engine, self._pg)

    def _versions(self, conn: sa.Connection, stream_ids: Iterable[str]) -> dict[str, int]:
        ids = list(stream_ids)
        if not ids:
            return {}
        if self._pg:  # one array parameter: the same statement whatever the count
            rows = conn.execute(_PG_VERSIONS, {"ids": ids})
        else:
            rows = conn.execute(_VERSIONS, {"ids": ids})
        return {stream_id: int(version) for stream_id, version in rows if version is not None}

    def _by_ids(self, conn: sa.Connection, event_ids: list[str]) -> dict[str, Stored]:
        found: dict[str, Stored] = {}
        for start in range(0, len(event_ids), 5000):  # stay under SQLite's bind-parameter cap
            chunk = event_ids[start : start + 5000]
            for r in conn.execute(_SELECT.where(events_table.c.event_id.in_(chunk))):
                found[r.event_id] = _stored_from_row(r)
        return found

    def _sqlite_append(
        self,
        batches: Sequence[AppendBatch],
        prepared: list[list[StoredRow]],
        *,
        check_ids: bool,
        wait: bool,
    ) -> list[AppendResult]:
        try:
            timeout_s = SQLITE_BUSY_TIMEOUT_MS / 1000 if wait else 0.0
            return sqlite.append(
                self._appender(), batches, prepared, check_ids=check_ids, timeout_s=timeout_s
            )
        except sqlite3.IntegrityError as exc:
            if check_ids:
                raise sa.exc.IntegrityError(sqlite.INSERT, None, exc) from exc
            raise IdsNeedChecking() from None
        except sqlite3.OperationalError as exc:
            self._drop_appender()  # the next append opens a fresh connection
            raise StoreUnavailable(f"event store unavailable: {exc}") from exc

    def _appender(self) -> Any:
        """This thread's append connection (see ledger.engine.open_sqlite_appender)."""
        conn = getattr(self._appenders, "conn", None)
        if conn is None:
            conn = self._appenders.conn = open_sqlite_appender(self._engine)
        return conn

    def _drop_appender(self) -> None:
        conn = getattr(self._appenders, "conn", None)
        self._appenders.conn = None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # reads

    def read_stream(self, stream_id: str, tenant_id: str | None = None) -> list[Recorded]:
        c = events_table.c
        query = _SELECT.where(c.stream_id == stream_id)
        if tenant_id is not None:
            query = query.where(c.tenant_id == tenant_id)
        return self._read(query.order_by(c.stream_version))

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = (),
        event_types: Sequence[str] = (), known: Known = None,
    ) -> list[Recorded]:  # fmt: skip
        """The events after `after_position`, in position order; with `stream_prefixes`, only
        those of streams starting with one of them (what a control-plane follower tails); with
        `event_types`, only events of those types (what a view folds: the rest is not read).
        `known`: the caller's own records by position, given back rather than decoded again."""
        c = events_table.c
        # Appends hold the events table's write lock until they commit, so positions become
        # visible in order and a reader tailing by position never steps past a late commit.
        # (A `txid < pg_snapshot_xmin(...)` filter would also be safe, but that xmin is
        # cluster-wide: one long transaction in any database of the server would stall every
        # tailing fold. Measured here: a bulk load in another database stopped billing.)
        if not self._pg:
            return self._sqlite_tail(after_position, limit, stream_prefixes, event_types, known)
        if not (stream_prefixes or event_types):
            query = _SELECT.where(c.position > after_position)
            return self._read(query.order_by(c.position).limit(limit), known)
        if len(event_types) == 1 and not stream_prefixes:
            # One type: its (type, position) index (migration 0022) reads exactly its events,
            # in order, a closed range of it, however rare they are in the log (the router's
            # feedback at start: ledger/quality.py) - no walk over the windows of the rest.
            head = self.last_position()
            one = _SELECT.where(
                c.type == event_types[0], c.position > after_position, c.position <= head
            )
            return self._read(one.order_by(c.position).limit(limit))
        query = _SELECT
        if stream_prefixes:
            query = query.where(_prefixed(stream_prefixes))
        if event_types:
            query = query.where(c.type.in_(list(event_types)))
        # A filtered tail reads bounded windows of positions up to the head. Asked for
        # `position > after` alone, the planner chose a sequential scan and a sort over the
        # whole table whenever its statistics lagged a fast-growing log (seen under
        # bench/pipeline.py: 40-100 ms a read, 4-40 µs an event returned); a closed range of the
        # primary key is always read through its index.
        head = self.last_position()
        out: list[Recorded] = []
        low = after_position
        while low < head and len(out) < limit:
            high = min(low + tails.TAIL_WINDOW, head)
            window = query.where(c.position > low, c.position <= high)
            out += self._read(window.order_by(c.position).limit(limit - len(out)))
            low = high
        return out

    @faults.seam("store.read")
    def read_tail(
        self, after_position: int, limit: int, event_types: Sequence[str],
        excluding_id_suffix: str = "",
    ) -> tuple[list[Recorded], int]:  # fmt: skip
        read = tails.postgres_read_tail if self._pg else tails.sqlite_read_tail
        with self._connect() as conn:
            db = conn.connection.driver_connection
            return read(db, after_position, limit, event_types, excluding_id_suffix)

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]:
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        return self._read(_SELECT.where(_prefixed(prefixes)).order_by(events_table.c.position))

    def read_streams(self, stream_ids: Sequence[str]) -> dict[str, list[Recorded]]:
        c = events_table.c
        out: dict[str, list[Recorded]] = {}
        ids = list(dict.fromkeys(stream_ids))
        for start in range(0, len(ids), 1000):  # stay under SQLite's bind-parameter cap
            query = _SELECT.where(c.stream_id.in_(ids[start : start + 1000]))
            for record in self._read(query.order_by(c.stream_id, c.stream_version)):
                out.setdefault(record.stream_id, []).append(record)
        return out

    def read_stream_window(
        self, stream_id: str, after_position: int, before_position: int
    ) -> list[Recorded]:
        c = events_table.c
        query = _SELECT.where(
            c.stream_id == stream_id, c.position > after_position, c.position < before_position
        )
        return self._read(query.order_by(c.position))

    def streams_with(
        self, event_type: str, occurred_from: datetime, occurred_to: datetime,
        tenant_id: str | None = None,
    ) -> list[str]:  # fmt: skip
        c = events_table.c
        query = (
            sa.select(c.stream_id)
            .where(
                c.type == event_type, c.occurred_at >= occurred_from, c.occurred_at < occurred_to
            )
            .order_by(c.position)
        )
        if tenant_id is not None:
            query = query.where(c.tenant_id == tenant_id)
        with self._connect() as conn:
            return list(dict.fromkeys(conn.execute(query).scalars()))

    def last_position(self) -> int:
        c = events_table.c
        query = sa.select(c.position).order_by(c.position.desc()).limit(1)
        with self._connect() as conn:
            return int(conn.execute(query).scalar() or 0)

    def stream_version(self, stream_id: str) -> int:
        c = events_table.c
        query = sa.select(sa.func.max(c.stream_version)).where(c.stream_id == stream_id)
        with self._connect() as conn:
            return int(conn.execute(query).scalar() or 0)

    @faults.seam("store.read")
    def _sqlite_tail(
        self, after: int, limit: int, prefixes: Sequence[str], types: Sequence[str], known: Known
    ) -> list[Recorded]:
        with self._connect() as conn:
            db = conn.connection.driver_connection
            return tails.sqlite_read_all(db, after, limit, prefixes, types, known)

    @faults.seam("store.read")
    def _read(self, query: sa.Select[Any], known: Known = None) -> list[Recorded]:
        with self._connect() as conn:
            rows = conn.execute(query).all()  # one fetch, not a driver call per row
        return tails.decode_rows(rows, known, _decode_row)

    def _connect(self) -> Any:
        return _Reading(self._engine)


def _insert(conn: sa.Connection, to_write: list[Stored], pg: bool, copy_min_rows: int) -> int:
    """Write the rows at consecutive positions; returns the first position (0 for none)."""
    if not to_write:
        return 0
    if pg:
        return postgres.insert_rows(conn, to_write, copy_min_rows=copy_min_rows)
    return _sqlite_insert(conn, to_write)


def _sqlite_insert(conn: sa.Connection, to_write: list[Stored]) -> int:
    """The rows written on the driver (`sqlite.insert_rows`), its errors as SQLAlchemy's."""
    cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        return sqlite.insert_rows(cursor, to_write)
    except sqlite3.IntegrityError as exc:
        # The driver's own error, presented like SQLAlchemy's (the retry path catches it).
        raise sa.exc.IntegrityError(sqlite.INSERT, None, exc) from exc
    except sqlite3.OperationalError as exc:
        raise sa.exc.OperationalError(sqlite.INSERT, None, exc) from exc
    finally:
        cursor.close()


class _Reading:
    """A read connection whose connection errors surface as StoreUnavailable."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None

    def __enter__(self) -> sa.Connection:
        try:
            self._conn = self._engine.connect()
        except sa.exc.OperationalError as exc:
            raise StoreUnavailable(f"event store unavailable: {_first_line(exc)}") from exc
        return self._conn

    def __exit__(self, *exc_info: object) -> None:
        assert self._conn is not None
        self._conn.close()


class _WriteTransaction:
    """A transaction holding the database's append lock until it commits."""

    def __init__(self, engine: sa.Engine, pg: bool) -> None:
        self._engine = engine
        self._pg = pg
        self._conn: sa.Connection | None = None
        self._tx: sa.RootTransaction | None = None

    def __enter__(self) -> sa.Connection:
        conn = self._engine.connect().execution_options(**{WRITE: True})
        self._conn = conn
        try:
            self._tx = conn.begin()
            if self._pg:
                conn.exec_driver_sql("LOCK TABLE events IN EXCLUSIVE MODE")
        except BaseException:
            conn.close()
            raise
        return conn

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        assert self._conn is not None and self._tx is not None
        try:
            if exc_type is None:
                self._tx.commit()
            else:
                self._tx.rollback()
        finally:
            self._conn.close()


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip()
    return text.splitlines()[0] if text else type(orig).__name__

"""The event store's PostgreSQL write path. An append's first attempt (`Appender`) runs on the
driver alone, on a connection of the store's own (outside the pool), in psycopg's pipeline
mode: the lock, the rows (one statement for a group, or COPY for a large one) and COMMIT in one
or two round trips. The retry that looks ids up, and appends with inline hooks, go through
SQLAlchemy (`insert_rows`): contiguous positions reserved in one round trip, the rows written by
one executemany or by COPY."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from datetime import UTC
from typing import Any

import sqlalchemy as sa

from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.schema import events as events_table
from tollgate_llm.ledger.store.planning import (
    COLUMNS,
    IdsNeedChecking,
    Stored,
    StoredRow,
    finish_appends,
    plan_appends,
)
from tollgate_llm.ledger.store.port import AppendBatch, AppendResult

_INSERT = events_table.insert()
_PG_COPY = f"COPY events ({', '.join(COLUMNS)}) FROM STDIN"
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(value: str) -> str:
    """A value in COPY's text format (backslash, tab, newline and CR escaped)."""
    return value.translate(_COPY_ESCAPES) if "\\" in value or not value.isprintable() else value


# setval(nextval + n - 1) reserves n contiguous positions in one round trip; contiguity holds
# because appends run under the table lock.
_RESERVE_SQL = (
    "SELECT setval(s::regclass, nextval(s::regclass) + {} - 1) "
    "FROM pg_get_serial_sequence('events', 'position') AS s"
)
_PG_RESERVE = sa.text(_RESERVE_SQL.format(":n"))


def insert_rows(conn: sa.Connection, to_write: list[Stored], *, copy_min_rows: int) -> int:
    """Write the rows at consecutive positions (the caller holds the table lock); returns the
    first position. COPY from `copy_min_rows` rows on."""
    n = len(to_write)
    last = conn.execute(_PG_RESERVE, {"n": n}).scalar_one()
    first = int(last) - n + 1
    if n >= copy_min_rows:
        _copy(conn, to_write, first)
    else:
        conn.execute(
            _INSERT,
            [
                {
                    "position": first + i,
                    "event_id": s.row.event_id,
                    "stream_id": s.row.stream_id,
                    "stream_version": s.stream_version,
                    "tenant_id": s.row.tenant_id,
                    "occurred_at": s.row.occurred_at,
                    "type": s.row.type,
                    "version": s.row.version,
                    "payload": s.row.payload,
                }
                for i, s in enumerate(to_write)
            ],
        )
    return first


def _copy(conn: sa.Connection, to_write: list[Stored], first: int) -> None:
    _copy_rows(conn.connection.driver_connection, to_write, first)


def _copy_rows(dbapi: Any, to_write: list[Stored], first: int) -> None:
    import psycopg

    # One text-format buffer written at once: several times faster than write_row per row,
    # which adapts every value in Python.
    lines = []
    for i, s in enumerate(to_write):
        row = s.row
        lines.append(
            f"{first + i}\t{_copy_text(row.event_id)}\t{_copy_text(row.stream_id)}\t"
            f"{s.stream_version}\t{_copy_text(row.tenant_id)}\t{row.occurred_at.isoformat()}\t"
            f"{_copy_text(row.type)}\t{row.version}\t{_copy_text(row.payload)}\n"
        )
    try:
        with dbapi.cursor() as cursor, cursor.copy(_PG_COPY) as copy:
            copy.write("".join(lines).encode())
    except psycopg.errors.IntegrityError as exc:
        # COPY runs on the driver directly; present its failure like SQLAlchemy's.
        raise sa.exc.IntegrityError(_PG_COPY, None, exc) from exc


# A group's rows in one statement: the positions reserved (setval, as _PG_RESERVE) and the rows
# written from one array per column, numbered from the reservation by their ordinality; the
# first position comes back. The CTE with setval is materialized: evaluated once.
# The arrays are sent in binary (%b): in text, psycopg escapes every element with a regular
# expression, which for JSON payloads (a backslash before every quote) was most of the
# statement's CPU.
_ARRAYS = ("text", "text", "integer", "text", "timestamptz", "text", "integer", "text")
_INSERT_GROUP = (
    "WITH r AS MATERIALIZED (SELECT setval(s::regclass, nextval(s::regclass) + %(n)s - 1) "
    "- %(n)s AS before FROM pg_get_serial_sequence('events', 'position') AS s), "
    f"w AS (INSERT INTO events ({', '.join(COLUMNS)}) "
    f"SELECT r.before + v.i, {', '.join('v.' + c for c in COLUMNS[1:])} FROM r, unnest("
    + ", ".join(f"%({c})b::{t}[]" for c, t in zip(COLUMNS[1:], _ARRAYS, strict=True))
    + f") WITH ORDINALITY AS v({', '.join(COLUMNS[1:])}, i)) "
    "SELECT before + 1 FROM r"
)
_LOCK = "LOCK TABLE events IN EXCLUSIVE MODE"
_VERSIONS = (
    "SELECT s.id, (SELECT max(e.stream_version) FROM events e WHERE e.stream_id = s.id) "
    "FROM unnest(%b::text[]) AS s(id)"
)
_BY_IDS = f"SELECT {', '.join(COLUMNS)} FROM events WHERE event_id = ANY(%b::text[])"


class Appender:
    """The store's own psycopg connection for an append's first attempt: opened on the first
    append with the engine's settings, kept outside the pool (no checkout, reset and check-in
    per commit) and in autocommit (each append is its pipeline's own BEGIN ... COMMIT), closed
    and replaced after any error that may have left it unusable, and closed when the engine is
    disposed. One append uses it at a time; another thread appending meanwhile takes a pooled
    connection (`append`), so appends wait only for the table lock, as before."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._db: Any = None
        sa.event.listen(engine, "engine_disposed", self._on_disposed)

    def append(
        self, batches: Sequence[AppendBatch], prepared: list[list[StoredRow]], *,
        copy_min_rows: int,
    ) -> list[AppendResult]:  # fmt: skip
        """As the module's `append`, on this connection when it is free."""
        if not self._lock.acquire(blocking=False):
            return append(self._engine, batches, prepared, copy_min_rows=copy_min_rows)
        try:
            return self._append(batches, prepared, copy_min_rows)
        finally:
            self._lock.release()

    def _append(
        self, batches: Sequence[AppendBatch], prepared: list[list[StoredRow]],
        copy_min_rows: int,
    ) -> list[AppendResult]:  # fmt: skip
        import psycopg

        db = self._db
        if db is None or db.closed or db.broken:
            self.close()
            db = self._db = self._open()
        try:
            return _append(db, batches, prepared, copy_min_rows)
        except BaseException as exc:
            # Whatever state a failure left the connection in is not reused: the next append
            # opens a fresh one. (Kept after a UNIQUE violation, psycopg counted the statement
            # the aborted pipeline skipped as prepared: "prepared statement does not exist".)
            self.close()
            if isinstance(exc, psycopg.errors.IntegrityError | sa.exc.IntegrityError):
                raise IdsNeedChecking() from None
            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                raise StoreUnavailable(f"event store unavailable: {exc}") from exc
            raise

    def _open(self) -> Any:
        import psycopg

        try:
            pooled = self._engine.raw_connection()  # the driver's errors come unwrapped
        except (psycopg.OperationalError, sa.exc.OperationalError) as exc:
            raise StoreUnavailable(f"event store unavailable: {exc}") from exc
        db = pooled.driver_connection
        pooled.detach()  # the connection is this appender's: the pool opens another in its place
        assert isinstance(db, psycopg.Connection)
        try:
            if db.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                db.rollback()
            db.autocommit = True
        except BaseException as exc:
            pooled.close()
            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                raise StoreUnavailable(f"event store unavailable: {exc}") from exc
            raise
        return db

    def close(self) -> None:
        db, self._db = self._db, None
        if db is not None:
            with contextlib.suppress(Exception):
                db.close()

    def _on_disposed(self, _engine: sa.Engine) -> None:
        with self._lock:
            self.close()


def append(
    engine: sa.Engine, batches: Sequence[AppendBatch], prepared: list[list[StoredRow]], *,
    copy_min_rows: int,
) -> list[AppendResult]:  # fmt: skip
    """An append_many's first attempt (ids not looked up) on the driver, in psycopg's pipeline
    mode: BEGIN, the table lock, the rows and COMMIT go in one round trip when no batch needs
    its stream's version (a new stream's, expected version 0: an admission), two when one does
    (the versions are read with the lock, and the plan made, before the rows). Through
    SQLAlchemy, with psycopg's own BEGIN, the lock, the version read, the reservation, the rows
    and COMMIT were a round trip each, and a thread waited on each. COMMIT's answer is read
    before this returns: nothing is reported written before it is durable.
    Raises IdsNeedChecking on a UNIQUE violation (plan again with ids looked up) and
    StoreUnavailable when the database cannot be reached."""
    import psycopg

    try:
        conn = engine.connect()
    except sa.exc.OperationalError as exc:
        raise StoreUnavailable(f"event store unavailable: {exc.orig or exc}") from exc
    try:
        db = conn.connection.driver_connection
        assert isinstance(db, psycopg.Connection)
        db.autocommit = True  # the transaction is this pipeline's own BEGIN ... COMMIT
        try:
            return _append(db, batches, prepared, copy_min_rows)
        except (psycopg.errors.IntegrityError, sa.exc.IntegrityError):
            raise IdsNeedChecking() from None
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            conn.invalidate()  # a broken connection does not go back to the pool
            raise StoreUnavailable(f"event store unavailable: {exc}") from exc
        finally:
            if not conn.invalidated:
                try:
                    if db.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                        db.execute("ROLLBACK")
                    db.autocommit = False
                except Exception:
                    # Never back to the pool in autocommit: SQLAlchemy's transactions on it
                    # would commit statement by statement.
                    conn.invalidate()
    finally:
        conn.close()


def _append(
    db: Any, batches: Sequence[AppendBatch], prepared: list[list[StoredRow]], copy_min_rows: int
) -> list[AppendResult]:
    streams = list(dict.fromkeys(b.stream_id for b in batches if b.expected_version != 0))
    with db.cursor() as cursor, db.cursor() as inserted:
        with db.pipeline():
            cursor.execute("BEGIN")
            cursor.execute(_LOCK)
            versions: dict[str, int] = {}
            if streams:  # fetching the versions sends what is queued: a round trip
                cursor.execute(_VERSIONS, [streams])
                versions = {s: int(v) for s, v in cursor.fetchall() if v is not None}

            def lookup(ids: list[str]) -> dict[str, Stored]:
                cursor.execute(_BY_IDS, [ids])
                return {r[1]: _stored(r) for r in cursor.fetchall()}

            plan = plan_appends(batches, prepared, versions, lookup, check_ids=False)
            rows = plan.to_write
            if 0 < len(rows) < copy_min_rows:
                inserted.execute(_INSERT_GROUP, _arrays(rows))
            if len(rows) < copy_min_rows:
                cursor.execute("COMMIT")  # its answer is read as the pipeline closes
        if len(rows) >= copy_min_rows:  # COPY does not run in a pipeline
            n = len(rows)
            first = int(cursor.execute(_RESERVE_SQL.format("%s"), [n]).fetchone()[0]) - n + 1
            _copy_rows(db, rows, first)
            cursor.execute("COMMIT")
        else:
            first = int(inserted.fetchone()[0]) if rows else 0
    return finish_appends(plan, batches, first)


def _arrays(rows: list[Stored]) -> dict[str, Any]:
    return {
        "n": len(rows),
        "event_id": [s.row.event_id for s in rows],
        "stream_id": [s.row.stream_id for s in rows],
        "stream_version": [s.stream_version for s in rows],
        "tenant_id": [s.row.tenant_id for s in rows],
        "occurred_at": [s.row.occurred_at for s in rows],
        "type": [s.row.type for s in rows],
        "version": [s.row.version for s in rows],
        "payload": [s.row.payload for s in rows],
    }


def _stored(r: tuple[Any, ...]) -> Stored:
    position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    row = StoredRow(event_id, stream_id, tenant_id, at.astimezone(UTC), type_, version, payload)
    return Stored(row, stream_version, position)

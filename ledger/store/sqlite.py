"""The event store's SQLite paths on the `sqlite3` driver alone: appends (one BEGIN IMMEDIATE
... COMMIT on a connection of their own, see ledger.engine.open_sqlite_appender), the position
tail, and SQLAlchemy's DATETIME text for instants.

SQLAlchemy's per-row parameter processing was most of an append's CPU (bench/store_append.py);
instants are stored in SQLAlchemy's own SQLite DATETIME text form, "YYYY-MM-DD HH:MM:SS.ffffff"
in UTC, so rows written here and through SQLAlchemy read each other.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson

from tollgate_llm.domain.envelope import Recorded, new_recorded
from tollgate_llm.domain.registry import from_payload
from tollgate_llm.ledger.errors import StoreBusy
from tollgate_llm.ledger.store.planning import (
    COLUMNS,
    Stored,
    StoredRow,
    finish_appends,
    plan_appends,
)
from tollgate_llm.ledger.store.port import AppendBatch, AppendResult

INSERT = (
    f"INSERT INTO events ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"
)
_TAIL = (
    f"SELECT {', '.join(COLUMNS)} FROM events WHERE position > ?{{}} ORDER BY position LIMIT ?"
)


def tail_sql(prefixes: int, types: int = 0) -> str:
    # substr, not LIKE: SQLite's LIKE ignores case, stream ids do not.
    where = " OR ".join("substr(stream_id, 1, ?) = ?" for _ in range(prefixes))
    kinds = ", ".join("?" for _ in range(types))
    return _TAIL.format(
        (f" AND ({where})" if prefixes else "") + (f" AND type IN ({kinds})" if types else "")
    )


def follow_sql(
    after: int, head: int, limit: int, types: Sequence[str], excluding_id_suffix: str
) -> tuple[str, list[Any]]:
    """`read_tail`'s query on SQLite and its parameters: up to `head` (read before it)."""
    where = " AND position <= ?"
    params: list[Any] = [after, head]
    if types:
        where += f" AND type IN ({', '.join('?' for _ in types)})"
        params += list(types)
    if excluding_id_suffix:
        # substr, not LIKE: SQLite's LIKE ignores case.
        where += " AND substr(event_id, ?) != ?"
        params += [-len(excluding_id_suffix), excluding_id_suffix]
    return _TAIL.format(where), [*params, limit]


def sqlite_instant(at: datetime) -> str:
    """SQLAlchemy's DATETIME text for SQLite: UTC, "YYYY-MM-DD HH:MM:SS.ffffff"."""
    if at.tzinfo is UTC:  # what encode leaves: the offset is all that has to go
        return at.isoformat(" ", "microseconds")[:26]
    if at.tzinfo is None:
        raise ValueError(f"naive datetime {at!r}: Tollgate stores timezone-aware UTC only")
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def sqlite_utc(text: str) -> datetime:
    """A stored instant (SQLAlchemy's DATETIME text, UTC, no offset) back to an aware UTC
    datetime, as UTCDateTime reads it: the offset parsed with the text (tzinfo is then `UTC`
    itself) costs a seventh of a `.replace(tzinfo=UTC)` after parsing."""
    return datetime.fromisoformat(text + "+00:00")


def stored_from_row(r: tuple[Any, ...]) -> Stored:
    """A row of COLUMNS as the driver returns it (instants as SQLAlchemy's DATETIME text)."""
    position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    occurred_at = sqlite_utc(at)
    row = StoredRow(event_id, stream_id, tenant_id, occurred_at, type_, version, payload)
    return Stored(row, stream_version, position)


def recorded_from_row(r: tuple[Any, ...]) -> Recorded:
    """A row of COLUMNS straight to the envelope the folds read (a tail decodes every row)."""
    position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    event = from_payload(type_, version, orjson.loads(payload))
    return new_recorded(
        event_id, stream_id, stream_version, tenant_id, sqlite_utc(at), event, position
    )


def begin_immediate(cursor: Any, timeout_s: float) -> bool:
    """Take SQLite's write lock on a connection without a busy handler (open_sqlite_appender),
    polling every 0.1-0.5 ms while another connection (the fold worker) holds it. SQLite's own
    busy handler sleeps 1, 2, 5, 10 ... ms between tries, so a lock held for 3 ms cost an
    append up to 8 ms; appends are what admissions wait for.
    With timeout_s 0 it tries once; False if the lock was taken (an error past a timeout)."""
    deadline = 0.0
    pause = 0.0001
    while True:
        try:
            cursor.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            if timeout_s <= 0:
                return False
            now = time.monotonic()
            deadline = deadline or now + timeout_s
            if now > deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.0005)


def insert_rows(cursor: Any, to_write: list[Stored]) -> int:
    """Write the rows at consecutive positions after the last; returns the first position."""
    first = (cursor.execute("SELECT max(position) FROM events").fetchone()[0] or 0) + 1
    cursor.executemany(
        INSERT,
        [
            (
                first + i, s.row.event_id, s.row.stream_id, s.stream_version, s.row.tenant_id,
                sqlite_instant(s.row.occurred_at), s.row.type, s.row.version, s.row.payload,
            )
            for i, s in enumerate(to_write)
        ],
    )
    return first


def _in_chunks(cursor: Any, query: str, values: list[str]) -> Iterator[tuple[Any, ...]]:
    """Rows of `query` (one `IN ({})`) over `values`, 500 at a time: under SQLite's cap on
    bound parameters."""
    for start in range(0, len(values), 500):
        chunk = values[start : start + 500]
        yield from cursor.execute(query.format(", ".join("?" for _ in chunk)), chunk)


def versions(cursor: Any, stream_ids: list[str]) -> dict[str, int]:
    query = (
        "SELECT stream_id, max(stream_version) FROM events "
        "WHERE stream_id IN ({}) GROUP BY stream_id"
    )
    return {stream_id: int(v) for stream_id, v in _in_chunks(cursor, query, stream_ids)}


def by_ids(cursor: Any, event_ids: list[str]) -> dict[str, Stored]:
    query = f"SELECT {', '.join(COLUMNS)} FROM events WHERE event_id IN ({{}})"
    return {r[1]: stored_from_row(r) for r in _in_chunks(cursor, query, event_ids)}


def append(
    db: sqlite3.Connection,
    batches: Sequence[AppendBatch],
    prepared: list[list[StoredRow]],
    *,
    check_ids: bool,
    timeout_s: float,
) -> list[AppendResult]:
    """One append_many on the driver: the shared plan, one BEGIN IMMEDIATE ... COMMIT, no
    SQLAlchemy statement processing (about half of an append's CPU). Raises StoreBusy when the
    write lock stays taken (at once with `timeout_s` 0), and the driver's own errors."""
    cursor = db.cursor()
    try:
        if not begin_immediate(cursor, timeout_s):
            raise StoreBusy("the event store's write lock is taken")
        try:
            streams = {b.stream_id for b in batches if check_ids or b.expected_version != 0}
            current = versions(cursor, list(streams))
            if check_ids:
                every = by_ids(cursor, [r.event_id for rs in prepared for r in rs])

                def lookup(ids: list[str]) -> dict[str, Stored]:
                    return {i: every[i] for i in ids if i in every}
            else:

                def lookup(ids: list[str]) -> dict[str, Stored]:
                    return by_ids(cursor, ids)

            plan = plan_appends(batches, prepared, current, lookup, check_ids=check_ids)
            first = insert_rows(cursor, plan.to_write) if plan.to_write else 0
            results = finish_appends(plan, batches, first)
            cursor.execute("COMMIT")
            return results
        except BaseException:
            if db.in_transaction:
                cursor.execute("ROLLBACK")
            raise
    finally:
        cursor.close()

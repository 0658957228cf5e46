"""A log follower's read (`EventStore.read_tail`) on each backend, on the driver: the events of
some types after a position, less the follower's own (their ids end with its writer tag), and
the position it has read up to.

Each statement is built once, at import, per shape (with or without a type filter, with or
without an excluded suffix), not per poll: an edge's follower polls up to 20 times a second,
and building and compiling the statement through SQLAlchemy was half of an empty poll's CPU.
On the driver the statement text is the same every poll, so psycopg prepares it on the server
after a few (its `prepare_threshold`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC
from typing import Any

import orjson

from tollgate_llm.domain.envelope import Recorded, new_recorded
from tollgate_llm.domain.registry import from_payload
from tollgate_llm.ledger.store import sqlite
from tollgate_llm.ledger.store.planning import COLUMNS

# Positions per query of a filtered tail on PostgreSQL: a closed range of the primary key is
# always read through its index (asked for `position > after` alone, the planner chose a
# sequential scan whenever its statistics lagged a fast-growing log).
TAIL_WINDOW = 20_000

# The head in the same statement as the window's events (a left join keeps its row when no
# event matches): a follower near the head asks once per read, not twice.
_PG_TAIL = (
    "WITH head AS (SELECT coalesce(max(position), 0) AS p FROM events) "
    f"SELECT head.p, {', '.join('e.' + c for c in COLUMNS)} FROM head LEFT OUTER JOIN events e "
    "ON e.position > %(low)s AND e.position <= least(%(high)s, head.p){} "
    "ORDER BY e.position LIMIT %(limit)s"
)
_PG_TYPES = " AND e.type = ANY(%(types)s)"
_PG_NOT_OURS = " AND e.event_id NOT LIKE %(ours)s"
_PG_STATEMENTS = {
    (types, ours): _PG_TAIL.format((_PG_TYPES if types else "") + (_PG_NOT_OURS if ours else ""))
    for types in (False, True)
    for ours in (False, True)
}


def _pg_recorded(r: tuple[Any, ...]) -> Recorded:
    """A row (after the head's column) to the envelope; instants in UTC, as UTCDateTime reads
    them (PostgreSQL returns the session's zone)."""
    _, position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    event = from_payload(type_, version, orjson.loads(payload))
    return new_recorded(
        event_id, stream_id, stream_version, tenant_id, at.astimezone(UTC), event, position
    )


def postgres_read_tail(
    db: Any, after: int, limit: int, types: Sequence[str], excluding_id_suffix: str
) -> tuple[list[Recorded], int]:
    """`read_tail` on a psycopg connection: windows of TAIL_WINDOW positions up to the head
    (read in the same statement), until `limit` events or the head."""
    statement = _PG_STATEMENTS[(bool(types), bool(excluding_id_suffix))]
    params: dict[str, Any] = {"types": list(types), "ours": f"%{excluding_id_suffix}"}
    out: list[Recorded] = []
    low = after
    with db.cursor() as cursor:
        while True:
            params.update(low=low, high=low + TAIL_WINDOW, limit=limit - len(out))
            rows = cursor.execute(statement, params).fetchall()
            top = int(rows[0][0])
            out += [_pg_recorded(r) for r in rows if r[1] is not None]
            if len(out) >= limit:
                return out, out[-1].position
            low = min(low + TAIL_WINDOW, top)
            if low >= top:
                return out, max(top, after)


def sqlite_read_tail(
    db: Any, after: int, limit: int, types: Sequence[str], excluding_id_suffix: str
) -> tuple[list[Recorded], int]:
    """`read_tail` on a sqlite3 connection: the head first, then the tail bounded by it, so the
    position returned never passes an event the tail did not see (one writer: positions commit
    in order)."""
    cursor = db.cursor()
    try:
        head = int(cursor.execute("SELECT coalesce(max(position), 0) FROM events").fetchone()[0])
        sql, params = sqlite.follow_sql(after, head, limit, types, excluding_id_suffix)
        rows = cursor.execute(sql, params).fetchall()
    finally:
        cursor.close()
    out = [sqlite.recorded_from_row(r) for r in rows]
    return out, (out[-1].position if len(out) >= limit else max(head, after))


def sqlite_read_all(
    db: Any, after: int, limit: int, prefixes: Sequence[str], types: Sequence[str],
    known: Mapping[int, Recorded] | None = None,
) -> list[Recorded]:  # fmt: skip
    """`read_all` on a sqlite3 connection (a fold's or a control-plane follower's tail); a row
    whose record the caller already holds (`known`, by position) is not decoded again."""
    params: list[Any] = [after]
    for prefix in prefixes:
        params += [len(prefix), prefix]
    params += [*types, limit]
    cursor = db.cursor()
    try:
        rows = cursor.execute(sqlite.tail_sql(len(prefixes), len(types)), params).fetchall()
    finally:
        cursor.close()
    return decode_rows(rows, known, sqlite.recorded_from_row)


def decode_rows(
    rows: Sequence[Any], known: Mapping[int, Recorded] | None, decode: Callable[[Any], Recorded]
) -> list[Recorded]:
    """The records of rows of COLUMNS, each decoded, or the caller's own where it holds that
    very event (`known`: what its appends returned, by position). A position is taken once and
    an event never changes, so the two are equal; the event id is compared all the same."""
    if not known:
        return [decode(r) for r in rows]
    out = []
    for row in rows:
        mine = known.get(row[0])
        out.append(mine if mine is not None and mine.event_id == row[1] else decode(row))
    return out

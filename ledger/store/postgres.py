"""The event store's PostgreSQL write path: contiguous positions reserved in one round trip, and
the rows written by one executemany or, for a large group commit, by COPY on the driver."""

from __future__ import annotations

import sqlalchemy as sa

from ledger.schema import events as events_table
from ledger.store.planning import COLUMNS, Stored

_INSERT = events_table.insert()
_PG_COPY = f"COPY events ({', '.join(COLUMNS)}) FROM STDIN"
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(value: str) -> str:
    """A value in COPY's text format (backslash, tab, newline and CR escaped)."""
    return value.translate(_COPY_ESCAPES) if "\\" in value or not value.isprintable() else value


# setval(nextval + n - 1) reserves n contiguous positions in one round trip; contiguity holds
# because appends run under the table lock.
_PG_RESERVE = sa.text(
    "SELECT setval(s::regclass, nextval(s::regclass) + :n - 1) "
    "FROM pg_get_serial_sequence('events', 'position') AS s"
)


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
    import psycopg

    dbapi = conn.connection.driver_connection
    assert isinstance(dbapi, psycopg.Connection)
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

"""Engines for the two supported backends: SQLite (embedded) and PostgreSQL via psycopg 3."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import URL, Engine, make_url

from tollgate_llm.ledger.errors import BadDatabaseUrl, StoreUnavailable

# Execution option a store sets on a connection that is about to write; on SQLite it turns the
# next BEGIN into BEGIN IMMEDIATE (see _sqlite_begin).
WRITE = "tollgate_write"


# How long a SQLite statement waits for another connection's write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 10_000
# SQLite's default: a commit that finds the WAL over 1,000 pages (~4 MB) checkpoints it, fsyncs
# included, before returning.
DEFAULT_WAL_AUTOCHECKPOINT = 1000


def create_engine_from_url(
    url: str | URL,
    *,
    check: bool = True,
    wal_autocheckpoint: int = DEFAULT_WAL_AUTOCHECKPOINT,
    **kwargs: Any,
) -> Engine:
    """An Engine for `url`, tuned for the event store. Raises BadDatabaseUrl for a URL we cannot
    use and, when `check`, StoreUnavailable if the database does not answer.

    `wal_autocheckpoint` (SQLite only): the WAL size in pages at which this engine's commits
    checkpoint. The edge raises it so that its admissions never pay for a checkpoint (a 5-10 ms
    stall at p99); the fold worker, which commits every pass, keeps the default and does them."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed, wal_autocheckpoint, **kwargs)
    else:
        engine = _postgres_engine(parsed, **kwargs)
    if check:
        try:
            with engine.connect():
                pass
        except sa.exc.DBAPIError as exc:
            engine.dispose()
            reason = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            raise StoreUnavailable(f"cannot reach {_shown(parsed)}: {reason}") from None
    return engine


def parse_url(url: str | URL) -> URL:
    """Validate `url` and normalise `postgresql://` and `postgres://` to the psycopg 3 driver."""
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except sa.exc.ArgumentError:
        raise BadDatabaseUrl(
            f"malformed database URL {url!r}: expected sqlite:///path/to/file.db or "
            "postgresql+psycopg://user@host:5432/dbname"
        ) from None
    drivername = parsed.drivername
    if drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif drivername in ("sqlite", "sqlite+pysqlite"):
        if parsed.database in (None, "", ":memory:"):
            raise BadDatabaseUrl(
                f"{_shown(parsed)}: an in-memory SQLite database cannot be shared between "
                "connections; give a file path (sqlite:///data/tollgate.db)"
            )
    elif drivername != "postgresql+psycopg":
        raise BadDatabaseUrl(
            f"unsupported database URL scheme {drivername!r}: use sqlite:/// or postgresql+psycopg://"
        )
    if parsed.get_backend_name() == "postgresql" and not parsed.database:
        raise BadDatabaseUrl(f"{_shown(parsed)} names no database")
    return parsed


def _shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def _sqlite_engine(url: URL, wal_autocheckpoint: int, **kwargs: Any) -> Engine:
    assert url.database is not None
    parent = Path(url.database).expanduser().resolve().parent
    if not parent.is_dir():
        raise StoreUnavailable(f"cannot open {_shown(url)}: directory {parent} does not exist")
    connect_args = {"check_same_thread": False, **kwargs.pop("connect_args", {})}
    options = {**kwargs.pop("execution_options", {}), _WAL_OPTION: int(wal_autocheckpoint)}
    engine = sa.create_engine(
        url, connect_args=connect_args, execution_options=options, **kwargs
    )

    @event.listens_for(engine, "connect")
    def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
        _configure_sqlite(dbapi_conn, wal_autocheckpoint, SQLITE_BUSY_TIMEOUT_MS)

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: sa.Connection) -> None:
        # A deferred transaction that reads and then writes fails with SQLITE_BUSY (no retry) if
        # another connection wrote in between; writers therefore take the write lock up front.
        # Readers stay deferred so WAL lets them run alongside the single writer.
        if conn.get_execution_options().get(WRITE):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")

    return engine


_WAL_OPTION = "tollgate_wal_autocheckpoint"


def _configure_sqlite(dbapi_conn: Any, wal_autocheckpoint: int, busy_timeout_ms: int) -> None:
    # Let SQLAlchemy, not the driver, decide when a transaction begins (see _sqlite_begin).
    dbapi_conn.isolation_level = None
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # NORMAL in WAL mode loses no committed transaction on a crash of the process, only on
    # power loss the last few; it is what makes SQLite commits cheap.
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
    cursor.execute(f"PRAGMA wal_autocheckpoint={int(wal_autocheckpoint)}")
    cursor.execute("PRAGMA foreign_keys=ON")
    # A deleted row's bytes are overwritten, not left in a freed page until it is reused: a
    # deleted batch file or a purged replay must leave the database file (issue 27, item 5).
    # Their old page images in the WAL go at the next TRUNCATE checkpoint (checkpoint_wal).
    cursor.execute("PRAGMA secure_delete=ON")
    cursor.close()


def checkpoint_wal(engine: Engine) -> bool:
    """Copy the WAL into the database and truncate it to nothing, so that page images of
    deleted rows leave the WAL file too; True when it did (False: a reader held an older
    snapshot, try again later). A no-op for PostgreSQL, whose deleted tuples go with VACUUM."""
    if engine.dialect.name != "sqlite":
        return True
    with engine.connect() as conn:
        busy = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").first()
    return busy is not None and busy[0] == 0


def open_sqlite_appender(engine: Engine) -> sqlite3.Connection:
    """A connection of the driver's own to `engine`'s SQLite file, outside the pool, for the
    event store's appends: the engine's settings, but no busy handler (the store polls the
    write lock itself, see ledger.store.sqlite.begin_immediate). One per thread: a pooled
    connection cost an append a checkout, a reset and two PRAGMAs to switch the busy
    handler off and on again (~30 us of the ~100 us of a one-request commit)."""
    assert engine.dialect.name == "sqlite" and engine.url.database
    wal = engine.get_execution_options().get(_WAL_OPTION, DEFAULT_WAL_AUTOCHECKPOINT)
    conn = sqlite3.connect(engine.url.database, check_same_thread=True)
    try:
        _configure_sqlite(conn, wal, 0)
    except BaseException:
        conn.close()
        raise
    return conn


def _postgres_engine(url: URL, **kwargs: Any) -> Engine:
    if "connect_timeout" not in url.query:
        url = url.update_query_dict({"connect_timeout": "5"})
    kwargs.setdefault("pool_size", 10)
    kwargs.setdefault("max_overflow", 10)
    return sa.create_engine(url, **kwargs)

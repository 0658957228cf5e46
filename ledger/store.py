"""The event store: the port every writer and reader uses, its SQL adapter (SQLite and
PostgreSQL through SQLAlchemy Core) and an in-memory fake with the same contract."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

import orjson
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import ARRAY

from domain.events import Event, Recorded, from_payload, to_payload
from ledger.engine import (
    SQLITE_BUSY_TIMEOUT_MS,
    WRITE,
    create_engine_from_url,
    open_sqlite_appender,
)
from ledger.errors import (
    BadDatabaseUrl,
    EventIdConflict,
    StoreBusy,
    StoreError,
    StoreUnavailable,
    WrongExpectedVersion,
)
from ledger.schema import events as events_table

__all__ = [
    "AppendBatch",
    "AppendResult",
    "BadDatabaseUrl",
    "EventIdConflict",
    "EventStore",
    "InMemoryEventStore",
    "NewEvent",
    "SqlEventStore",
    "StoreError",
    "StoreUnavailable",
    "WrongExpectedVersion",
    "create_engine_from_url",
]


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event about to be appended. The caller owns `event_id` (a UUID string): it is what
    makes a retried append harmless."""

    event_id: str
    stream_id: str
    tenant_id: str
    occurred_at: datetime  # timezone-aware; stored as UTC
    event: Event


@dataclass(frozen=True, slots=True)
class AppendBatch:
    """One stream append: all of `events` land together or none do."""

    stream_id: str
    expected_version: int | None
    events: Sequence[NewEvent]


@dataclass(frozen=True, slots=True)
class AppendResult:
    """The outcome of one batch of an `append_many`. `duplicate` is True when every event was
    already recorded and nothing was written (the records are the stored ones)."""

    stream_id: str
    records: list[Recorded] = field(default_factory=list)
    error: StoreError | None = None
    duplicate: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> list[Recorded]:
        if self.error is not None:
            raise self.error
        return self.records


class EventStore(Protocol):
    """The append-only log of every fact Tollgate records.

    Contract (every implementation passes tests/contracts/test_event_store.py):

    - `append(stream_id, expected_version, events)` is all-or-nothing. `expected_version` is the
      number of events already in the stream: 0 means the stream must not exist yet, None skips
      the check. The events get stream versions expected+1, expected+2, ... and increasing global
      positions. If the stream is not at `expected_version` it raises WrongExpectedVersion(
      stream_id, expected, actual); two concurrent appends at the same version: exactly one wins.
    - Idempotent on `event_id`: re-appending events that are all recorded with identical content
      (stream, tenant, instant, type, version, payload) writes nothing and returns the stored
      records, whatever `expected_version` says. The same id with different content raises
      EventIdConflict naming the differing fields; a batch mixing recorded and new ids raises
      EventIdConflict too (the original append was all-or-nothing, so this is not a retry).
    - `append_many(batches)` commits many independent appends together (group commit). Each
      batch succeeds or fails on its own; a conflict in one never sinks the others. Batches are
      applied in order, so two batches for one stream see each other.
    - `read_stream` returns a stream in version order; `read_all(after_position, limit)` returns
      events in global position order. A reader that tails `read_all` by the last position it
      saw never skips an event, even one whose transaction commits late (PostgreSQL hides
      events of transactions newer than the oldest one still running, and appends take positions
      in commit order).
    - `read_streams_with_prefix(prefix)` returns every event of every stream whose id starts
      with `prefix` (or with any of a sequence of prefixes), in position order.
    - `last_position()` is the position a tailing reader can reach now (0 for an empty store);
      `stream_version(stream_id)` is 0 for a missing stream.
    - Events are never updated or deleted.
    """

    def append(
        self, stream_id: str, expected_version: int | None, events: Sequence[NewEvent]
    ) -> list[Recorded]: ...

    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]: ...

    def read_stream(self, stream_id: str) -> list[Recorded]: ...

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = ()
    ) -> list[Recorded]: ...

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]: ...

    def last_position(self) -> int: ...

    def stream_version(self, stream_id: str) -> int: ...


# --- shared by both implementations -------------------------------------------------------------


class _Row(NamedTuple):
    """An event in its stored form: what idempotent re-appends are compared on."""

    event_id: str
    stream_id: str
    tenant_id: str
    occurred_at: datetime
    type: str
    version: int
    payload: str


_COMPARED = ("stream_id", "tenant_id", "occurred_at", "type", "version")


@dataclass(slots=True)
class _Stored:
    row: _Row
    stream_version: int
    position: int
    event: Event | None = None  # decoded lazily: a conflict check needs only the row

    def recorded(self) -> Recorded:
        event = self.event
        if event is None:
            event = from_payload(self.row.type, self.row.version, orjson.loads(self.row.payload))
        return Recorded(
            event_id=self.row.event_id,
            stream_id=self.row.stream_id,
            stream_version=self.stream_version,
            tenant_id=self.row.tenant_id,
            occurred_at=self.row.occurred_at,
            event=event,
            position=self.position,
        )


def _encode(new: NewEvent) -> _Row:
    if new.occurred_at.tzinfo is None:
        raise ValueError(f"event {new.event_id}: occurred_at must be timezone-aware")
    event = new.event
    payload = orjson.dumps(to_payload(event), option=orjson.OPT_SORT_KEYS).decode()
    return _Row(
        new.event_id,
        new.stream_id,
        new.tenant_id,
        new.occurred_at.astimezone(UTC),
        event.EVENT_TYPE,
        event.EVENT_VERSION,
        payload,
    )


def _prefixed(prefixes: Sequence[str]) -> sa.ColumnElement[bool]:
    c = events_table.c
    return sa.or_(sa.false(), *(c.stream_id.startswith(p, autoescape=True) for p in prefixes))


def check_batch(batch: AppendBatch) -> None:
    """The structural rules of one append (cheap: nothing is encoded); a malformed batch is a
    bug in the caller and fails loudly."""
    if batch.expected_version is not None and batch.expected_version < 0:
        raise ValueError(f"stream {batch.stream_id!r}: expected_version must be >= 0 or None")
    seen: set[str] = set()
    for new in batch.events:
        if new.stream_id != batch.stream_id:
            raise ValueError(
                f"event {new.event_id} is for stream {new.stream_id!r}, "
                f"appended to {batch.stream_id!r}"
            )
        if new.event_id in seen:
            raise ValueError(f"event {new.event_id} appears twice in one append")
        seen.add(new.event_id)


def _prepare(batches: Sequence[AppendBatch]) -> list[list[_Row]]:
    """Check and encode every batch before touching storage: a malformed batch fails the whole
    call loudly rather than becoming a per-batch result."""
    for batch in batches:
        check_batch(batch)
    return [[_encode(new) for new in batch.events] for batch in batches]


def _differences(stored: _Row, new: _Row) -> list[str]:
    diffs = [name for name in _COMPARED if getattr(stored, name) != getattr(new, name)]
    if stored.payload != new.payload:
        old, now = orjson.loads(stored.payload), orjson.loads(new.payload)
        keys = sorted(set(old) | set(now))
        diffs += [f"payload.{k}" for k in keys if old.get(k, ...) != now.get(k, ...)]
    return diffs


def _resolve_recorded(
    rows: list[_Row], known: Callable[[str], _Stored | None]
) -> list[_Stored] | StoreError | None:
    """If any event of the batch is already recorded: the stored events when this is an exact
    retry, else the conflict. None when the batch is entirely new."""
    found = [known(row.event_id) for row in rows]
    if all(stored is None for stored in found):
        return None
    if any(stored is None for stored in found):
        first = next(s for s in found if s is not None)
        return EventIdConflict(
            first.row.event_id,
            ["batch"],
            "the append mixes recorded and new events; an append is all-or-nothing, so "
            "a retry must resend exactly the recorded batch",
        )
    stored_rows: list[_Stored] = [s for s in found if s is not None]
    for stored, row in zip(stored_rows, rows, strict=True):
        diffs = _differences(stored.row, row)
        if diffs:
            return EventIdConflict(row.event_id, diffs)
    return stored_rows


class _Plan:
    """The decision for each batch of an append_many, made under the writer lock: a finished
    result (an error), the stored events it repeats, or new events to write."""

    def __init__(self) -> None:
        self.outcomes: list[AppendResult | tuple[bool, list[_Stored]]] = []  # (duplicate, events)
        self.to_write: list[_Stored] = []


def _plan(
    batches: Sequence[AppendBatch],
    prepared: list[list[_Row]],
    versions: dict[str, int],
    lookup: Callable[[list[str]], dict[str, _Stored]],
    *,
    check_ids: bool,
) -> _Plan:
    """Check every batch in order against `versions` (streams' current versions, updated as
    batches are accepted) and already stored events found by `lookup(event_ids)`.

    With `check_ids` False, ids are looked up only when the version check fails (a retry
    usually arrives with the expected version it first had); a repeated id that passes the
    version check then surfaces as a UNIQUE violation and the caller plans again with True.
    """
    plan = _Plan()
    pending: dict[str, _Stored] = {}  # accepted earlier in this call, not yet written

    def decide(rows: list[_Row], stored: dict[str, _Stored]) -> list[_Stored] | StoreError | None:
        return _resolve_recorded(rows, lambda i: pending.get(i) or stored.get(i))

    for batch, rows in zip(batches, prepared, strict=True):
        if not rows:
            plan.outcomes.append(AppendResult(batch.stream_id))
            continue
        ids = [row.event_id for row in rows]
        resolved = decide(rows, lookup(ids) if check_ids else {})
        current = versions.get(batch.stream_id, 0)
        mismatch = batch.expected_version is not None and batch.expected_version != current
        if resolved is None and mismatch and not check_ids:
            resolved = decide(rows, lookup(ids))
        if isinstance(resolved, StoreError):
            plan.outcomes.append(AppendResult(batch.stream_id, error=resolved))
            continue
        if resolved is not None:
            plan.outcomes.append((True, resolved))
            continue
        if mismatch:
            assert batch.expected_version is not None
            error = WrongExpectedVersion(batch.stream_id, batch.expected_version, current)
            plan.outcomes.append(AppendResult(batch.stream_id, error=error))
            continue
        stored = [
            _Stored(row, current + offset, 0, new.event)
            for offset, (row, new) in enumerate(zip(rows, batch.events, strict=True), start=1)
        ]
        versions[batch.stream_id] = current + len(rows)
        for s in stored:
            pending[s.row.event_id] = s
        plan.to_write.extend(stored)
        plan.outcomes.append((False, stored))
    return plan


def _finish(plan: _Plan, batches: Sequence[AppendBatch], first_position: int) -> list[AppendResult]:
    for offset, stored in enumerate(plan.to_write):
        stored.position = first_position + offset
    results: list[AppendResult] = []
    for batch, outcome in zip(batches, plan.outcomes, strict=True):
        if not isinstance(outcome, AppendResult):
            duplicate, stored = outcome
            outcome = AppendResult(batch.stream_id, [s.recorded() for s in stored], None, duplicate)
        results.append(outcome)
    return results


# --- SQL ----------------------------------------------------------------------------------------

_COLUMNS = (
    "position",
    "event_id",
    "stream_id",
    "stream_version",
    "tenant_id",
    "occurred_at",
    "type",
    "version",
    "payload",
)
_SELECT = sa.select(*(events_table.c[name] for name in _COLUMNS))
_INSERT = events_table.insert()
_PG_COPY = f"COPY events ({', '.join(_COLUMNS)}) FROM STDIN"
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _copy_text(value: str) -> str:
    """A value in COPY's text format (backslash, tab, newline and CR escaped)."""
    return value.translate(_COPY_ESCAPES) if "\\" in value or not value.isprintable() else value


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
# setval(nextval + n - 1) reserves n contiguous positions in one round trip; contiguity holds
# because appends run under the table lock.
_PG_RESERVE = sa.text(
    "SELECT setval(s::regclass, nextval(s::regclass) + :n - 1) "
    "FROM pg_get_serial_sequence('events', 'position') AS s"
)


# SQLite's hot paths go through the driver's cursor: SQLAlchemy's per-row parameter processing
# was most of an append's CPU (bench/store_append.py). Instants are stored in SQLAlchemy's own
# SQLite DATETIME text form, "YYYY-MM-DD HH:MM:SS.ffffff" in UTC, so both paths read each other.
_SQLITE_INSERT = (
    f"INSERT INTO events ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' for _ in _COLUMNS)})"
)
_SQLITE_TAIL = (
    f"SELECT {', '.join(_COLUMNS)} FROM events WHERE position > ?{{}} ORDER BY position LIMIT ?"
)


def _sqlite_tail_sql(prefixes: int) -> str:
    # substr, not LIKE: SQLite's LIKE ignores case, stream ids do not.
    where = " OR ".join("substr(stream_id, 1, ?) = ?" for _ in range(prefixes))
    return _SQLITE_TAIL.format(f" AND ({where})" if prefixes else "")


def sqlite_instant(at: datetime) -> str:
    """SQLAlchemy's DATETIME text for SQLite: UTC, "YYYY-MM-DD HH:MM:SS.ffffff"."""
    if at.tzinfo is UTC:  # what _encode leaves: the offset is all that has to go
        return at.isoformat(" ", "microseconds")[:26]
    if at.tzinfo is None:
        raise ValueError(f"naive datetime {at!r}: Tollgate stores timezone-aware UTC only")
    return at.astimezone(UTC).replace(tzinfo=None).isoformat(" ", "microseconds")


def sqlite_utc(text: str) -> datetime:
    """A stored instant (SQLAlchemy's DATETIME text, UTC, no offset) back to an aware UTC
    datetime, as UTCDateTime reads it: the offset parsed with the text (tzinfo is then `UTC`
    itself) costs a seventh of a `.replace(tzinfo=UTC)` after parsing."""
    return datetime.fromisoformat(text + "+00:00")


def _from_sqlite_row(r: tuple[Any, ...]) -> _Stored:
    """A row of _COLUMNS as the driver returns it (instants as SQLAlchemy's DATETIME text)."""
    position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    occurred_at = sqlite_utc(at)
    row = _Row(event_id, stream_id, tenant_id, occurred_at, type_, version, payload)
    return _Stored(row, stream_version, position)


def _recorded_from_sqlite_row(r: tuple[Any, ...]) -> Recorded:
    """A row of _COLUMNS straight to the envelope the folds read (a tail decodes every row)."""
    position, event_id, stream_id, stream_version, tenant_id, at, type_, version, payload = r
    return Recorded(
        event_id=event_id,
        stream_id=stream_id,
        stream_version=stream_version,
        tenant_id=tenant_id,
        occurred_at=sqlite_utc(at),
        event=from_payload(type_, version, orjson.loads(payload)),
        position=position,
    )


def _sqlite_begin_immediate(cursor: Any, timeout_s: float) -> bool:
    """Take SQLite's write lock on a connection without a busy handler (open_sqlite_appender),
    polling every 0.1-0.5 ms while another connection (the fold worker) holds it. SQLite's own
    busy handler sleeps 1, 2, 5, 10 ... ms between tries, so a lock held for 3 ms cost an
    append up to 8 ms; appends are what admissions wait for.
    With timeout_s 0 it tries once; False if the lock was taken (an error past a timeout)."""
    import sqlite3

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


def _sqlite_insert_rows(cursor: Any, to_write: list[_Stored]) -> int:
    """Write the rows at consecutive positions after the last; returns the first position."""
    first = (cursor.execute("SELECT max(position) FROM events").fetchone()[0] or 0) + 1
    cursor.executemany(
        _SQLITE_INSERT,
        [
            (
                first + i, s.row.event_id, s.row.stream_id, s.stream_version, s.row.tenant_id,
                sqlite_instant(s.row.occurred_at), s.row.type, s.row.version, s.row.payload,
            )
            for i, s in enumerate(to_write)
        ],
    )
    return first


def _sqlite_in(cursor: Any, query: str, values: list[str]) -> Iterator[tuple[Any, ...]]:
    """Rows of `query` (one `IN ({})`) over `values`, 500 at a time: under SQLite's cap on
    bound parameters."""
    for start in range(0, len(values), 500):
        chunk = values[start : start + 500]
        yield from cursor.execute(query.format(", ".join("?" for _ in chunk)), chunk)


def _sqlite_versions(cursor: Any, stream_ids: list[str]) -> dict[str, int]:
    query = (
        "SELECT stream_id, max(stream_version) FROM events "
        "WHERE stream_id IN ({}) GROUP BY stream_id"
    )
    return {stream_id: int(v) for stream_id, v in _sqlite_in(cursor, query, stream_ids)}


def _sqlite_by_ids(cursor: Any, event_ids: list[str]) -> dict[str, _Stored]:
    query = f"SELECT {', '.join(_COLUMNS)} FROM events WHERE event_id IN ({{}})"
    return {r[1]: _from_sqlite_row(r) for r in _sqlite_in(cursor, query, event_ids)}


class _IdsNeedChecking(Exception):
    """An insert hit a UNIQUE index: a retried event id the fast path did not look up."""


def _stored_from_row(r: Any) -> _Stored:
    return _Stored(
        _Row(r.event_id, r.stream_id, r.tenant_id, r.occurred_at, r.type, r.version, r.payload),
        r.stream_version,
        r.position,
    )


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

    def _append_many(self, batches: Sequence[AppendBatch], *, wait: bool) -> list[AppendResult]:
        prepared = _prepare(batches)
        if not any(prepared):
            return [AppendResult(b.stream_id) for b in batches]
        try:
            # Retries are rare, so the first attempt lets the UNIQUE index find repeated ids
            # instead of looking every id up.
            return self._append(batches, prepared, check_ids=False, wait=wait)
        except _IdsNeedChecking:
            return self._append(batches, prepared, check_ids=True, wait=wait)

    def _append(
        self,
        batches: Sequence[AppendBatch],
        prepared: list[list[_Row]],
        *,
        check_ids: bool,
        wait: bool = True,
    ) -> list[AppendResult]:
        if self.can_try_append:
            return self._sqlite_append(batches, prepared, check_ids=check_ids, wait=wait)
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

                    def lookup(ids: list[str]) -> dict[str, _Stored]:
                        return {i: every[i] for i in ids if i in every}
                else:

                    def lookup(ids: list[str]) -> dict[str, _Stored]:
                        return self._by_ids(conn, ids)

                plan = _plan(batches, prepared, versions, lookup, check_ids=check_ids)
                first = self._insert(conn, plan.to_write) if plan.to_write else 0
                results = _finish(plan, batches, first)
                if self.before_commit and plan.to_write:
                    written = [s.recorded() for s in plan.to_write]
                    for hook in self.before_commit:
                        hook(conn, written)
                return results
        except sa.exc.IntegrityError:
            if check_ids:
                raise
            raise _IdsNeedChecking() from None
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

    def _by_ids(self, conn: sa.Connection, event_ids: list[str]) -> dict[str, _Stored]:
        found: dict[str, _Stored] = {}
        for start in range(0, len(event_ids), 5000):  # stay under SQLite's bind-parameter cap
            chunk = event_ids[start : start + 5000]
            for r in conn.execute(_SELECT.where(events_table.c.event_id.in_(chunk))):
                found[r.event_id] = _stored_from_row(r)
        return found

    def _insert(self, conn: sa.Connection, to_write: list[_Stored]) -> int:
        """Write the rows at consecutive positions; returns the first position."""
        n = len(to_write)
        if not self._pg:
            return self._sqlite_insert(conn, to_write)
        last = conn.execute(_PG_RESERVE, {"n": n}).scalar_one()
        first = int(last) - n + 1
        if n >= self._copy_min_rows:
            self._copy(conn, to_write, first)
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

    def _sqlite_insert(self, conn: sa.Connection, to_write: list[_Stored]) -> int:
        import sqlite3

        cursor = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            return _sqlite_insert_rows(cursor, to_write)
        except sqlite3.IntegrityError as exc:
            # The driver's own error, presented like SQLAlchemy's (the retry path catches it).
            raise sa.exc.IntegrityError(_SQLITE_INSERT, None, exc) from exc
        except sqlite3.OperationalError as exc:
            raise sa.exc.OperationalError(_SQLITE_INSERT, None, exc) from exc
        finally:
            cursor.close()

    def _sqlite_append(
        self,
        batches: Sequence[AppendBatch],
        prepared: list[list[_Row]],
        *,
        check_ids: bool,
        wait: bool,
    ) -> list[AppendResult]:
        """`_append` on SQLite's driver alone: the same plan, one BEGIN IMMEDIATE ... COMMIT,
        no SQLAlchemy statement processing (about half of an append's CPU)."""
        import sqlite3

        try:
            db = self._appender()
            cursor = db.cursor()
            try:
                timeout_s = SQLITE_BUSY_TIMEOUT_MS / 1000 if wait else 0.0
                if not _sqlite_begin_immediate(cursor, timeout_s):
                    raise StoreBusy("the event store's write lock is taken")
                try:
                    streams = {b.stream_id for b in batches if check_ids or b.expected_version != 0}
                    versions = _sqlite_versions(cursor, list(streams))
                    if check_ids:
                        every = _sqlite_by_ids(cursor, [r.event_id for rs in prepared for r in rs])

                        def lookup(ids: list[str]) -> dict[str, _Stored]:
                            return {i: every[i] for i in ids if i in every}
                    else:

                        def lookup(ids: list[str]) -> dict[str, _Stored]:
                            return _sqlite_by_ids(cursor, ids)

                    plan = _plan(batches, prepared, versions, lookup, check_ids=check_ids)
                    first = _sqlite_insert_rows(cursor, plan.to_write) if plan.to_write else 0
                    results = _finish(plan, batches, first)
                    cursor.execute("COMMIT")
                    return results
                except BaseException:
                    if db.in_transaction:
                        cursor.execute("ROLLBACK")
                    raise
            finally:
                cursor.close()
        except sqlite3.IntegrityError as exc:
            if check_ids:
                raise sa.exc.IntegrityError(_SQLITE_INSERT, None, exc) from exc
            raise _IdsNeedChecking() from None
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

    def _copy(self, conn: sa.Connection, to_write: list[_Stored], first: int) -> None:
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

    # reads

    def read_stream(self, stream_id: str) -> list[Recorded]:
        c = events_table.c
        return self._read(_SELECT.where(c.stream_id == stream_id).order_by(c.stream_version))

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = ()
    ) -> list[Recorded]:
        """The events after `after_position`, in position order; with `stream_prefixes`, only
        those of streams starting with one of them (what a control-plane follower tails)."""
        c = events_table.c
        # Appends hold the events table's write lock until they commit, so positions become
        # visible in order and a reader tailing by position never steps past a late commit.
        # (A `txid < pg_snapshot_xmin(...)` filter would also be safe, but that xmin is
        # cluster-wide: one long transaction in any database of the server would stall every
        # tailing fold. Measured here: a bulk load in another database stopped billing.)
        if not self._pg:
            return self._sqlite_tail(after_position, limit, stream_prefixes)
        query = _SELECT.where(c.position > after_position)
        if stream_prefixes:
            query = query.where(_prefixed(stream_prefixes))
        return self._read(query.order_by(c.position).limit(limit))

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]:
        prefixes = [prefix] if isinstance(prefix, str) else list(prefix)
        return self._read(_SELECT.where(_prefixed(prefixes)).order_by(events_table.c.position))

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

    def _sqlite_tail(
        self, after_position: int, limit: int, prefixes: Sequence[str]
    ) -> list[Recorded]:
        params: list[Any] = [after_position]
        for prefix in prefixes:
            params += [len(prefix), prefix]
        params.append(limit)
        with self._connect() as conn:
            cursor = conn.connection.driver_connection.cursor()
            try:
                rows = cursor.execute(_sqlite_tail_sql(len(prefixes)), params).fetchall()
            finally:
                cursor.close()
        return [_recorded_from_sqlite_row(r) for r in rows]

    def _read(self, query: sa.Select[Any]) -> list[Recorded]:
        with self._connect() as conn:
            return [_stored_from_row(r).recorded() for r in conn.execute(query)]

    def _connect(self) -> Any:
        return _Reading(self._engine)


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


# --- in memory ----------------------------------------------------------------------------------


class InMemoryEventStore(EventStore):
    """The contract in a dict, for unit tests. Payloads take the same JSON round trip as in the
    database, so an event that cannot be stored fails here too."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log: list[_Stored] = []
        self._by_id: dict[str, _Stored] = {}
        self._streams: dict[str, list[_Stored]] = {}

    def append(
        self, stream_id: str, expected_version: int | None, events: Sequence[NewEvent]
    ) -> list[Recorded]:
        return self.append_many([AppendBatch(stream_id, expected_version, events)])[0].unwrap()

    def append_many(self, batches: Sequence[AppendBatch]) -> list[AppendResult]:
        prepared = _prepare(batches)
        with self._lock:
            versions = {b.stream_id: len(self._streams.get(b.stream_id, ())) for b in batches}
            plan = _plan(batches, prepared, versions, self._lookup, check_ids=True)
            for s in plan.to_write:
                s.event = from_payload(s.row.type, s.row.version, orjson.loads(s.row.payload))
            results = _finish(plan, batches, len(self._log) + 1)
            for s in plan.to_write:
                self._log.append(s)
                self._by_id[s.row.event_id] = s
                self._streams.setdefault(s.row.stream_id, []).append(s)
            return results

    def _lookup(self, event_ids: list[str]) -> dict[str, _Stored]:
        return {i: self._by_id[i] for i in event_ids if i in self._by_id}

    def read_stream(self, stream_id: str) -> list[Recorded]:
        with self._lock:
            return [s.recorded() for s in self._streams.get(stream_id, ())]

    def read_all(
        self, after_position: int = 0, limit: int = 1000, stream_prefixes: Sequence[str] = ()
    ) -> list[Recorded]:
        prefixes = tuple(stream_prefixes)
        with self._lock:
            tail = self._log[max(after_position, 0) :]
            if prefixes:
                tail = [s for s in tail if s.row.stream_id.startswith(prefixes)]
            return [s.recorded() for s in tail[:limit]]

    def read_streams_with_prefix(self, prefix: str | Sequence[str]) -> list[Recorded]:
        prefixes = (prefix,) if isinstance(prefix, str) else tuple(prefix)
        with self._lock:
            return [s.recorded() for s in self._log if s.row.stream_id.startswith(prefixes)]

    def last_position(self) -> int:
        with self._lock:
            return len(self._log)

    def stream_version(self, stream_id: str) -> int:
        with self._lock:
            return len(self._streams.get(stream_id, ()))

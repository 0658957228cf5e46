"""The projection runner on real databases: incremental == rebuild, crash-safe, redelivery-safe,
and usable inline in the append transaction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.requests.events import FirstTokenStreamed, RequestRouted
from tollgate_llm.ledger import schema
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import ProjectionError
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.schema import UTCDateTime
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)

# A test-only view: per stream, how many FirstTokenStreamed events and their total ttft; a
# RequestRouted to replica "drop" deletes the row. It exercises insert, update and delete.
test_meta = sa.MetaData()
stream_counts = sa.Table(
    "test_stream_counts",
    test_meta,
    sa.Column("stream_id", sa.String(200), primary_key=True),
    sa.Column("tenant_id", sa.String(100), primary_key=True),
    sa.Column("events", sa.BigInteger, nullable=False),
    sa.Column("ttft_ms_sum", sa.BigInteger, nullable=False),
    sa.Column("last_at", UTCDateTime, nullable=False),
)


@dataclass(frozen=True)
class Spec:
    name: str
    key_columns: tuple[str, ...]
    columns: tuple[str, ...]
    key: Any
    project: Any
    opens_row: Any = lambda _recorded: False


def _key(r: Recorded) -> tuple[str, str] | None:
    return (
        (r.stream_id, r.tenant_id)
        if isinstance(r.event, FirstTokenStreamed | RequestRouted)
        else None
    )


def _project(row: dict[str, Any] | None, r: Recorded) -> dict[str, Any] | None:
    if isinstance(r.event, RequestRouted):
        return None if r.event.replica_id == "drop" else row
    assert isinstance(r.event, FirstTokenStreamed)
    row = row or {"stream_id": r.stream_id, "tenant_id": r.tenant_id, "events": 0, "ttft_ms_sum": 0}
    return {
        **row,
        "events": row["events"] + 1,
        "ttft_ms_sum": row["ttft_ms_sum"] + r.event.ttft_ms,
        "last_at": r.occurred_at,
    }


SPEC = Spec(
    "test_stream_counts",
    ("stream_id", "tenant_id"),
    ("stream_id", "tenant_id", "events", "ttft_ms_sum", "last_at"),
    _key,
    _project,
)


def ttft(stream_id: str, ms: int, minute: int = 0, tenant: str = "acme") -> NewEvent:
    at = T0 + timedelta(minutes=minute)
    return NewEvent(str(uuid.uuid4()), stream_id, tenant, at, FirstTokenStreamed(stream_id, ms))


def routed(stream_id: str, replica: str) -> NewEvent:
    return NewEvent(str(uuid.uuid4()), stream_id, "acme", T0, RequestRouted(stream_id, replica, 1))


@pytest.fixture
def db(engine: sa.Engine) -> tuple[sa.Engine, SqlEventStore]:
    stream_counts.create(engine)  # a test-only table, not part of the schema
    return engine, SqlEventStore(engine)


def rows(engine: sa.Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(stream_counts).order_by("stream_id"))]


def fold_in_memory(records: list[Recorded]) -> list[tuple[Any, ...]]:
    """The oracle: the same spec folded in a dict."""
    view: dict[tuple[Any, ...], dict[str, Any] | None] = {}
    for r in records:
        if (k := SPEC.key(r)) is not None:
            view[k] = SPEC.project(view.get(k), r)
    return sorted(tuple(row[c] for c in SPEC.columns) for row in view.values() if row)


def append_history(store: SqlEventStore, runner: ProjectionRunner | None = None) -> None:
    for i in range(30):
        s = f"req-{i % 7}"
        events = [ttft(s, i, minute=i)] + ([routed(s, "drop")] if i == 20 else [])
        events += [routed(s, "keep")] if i % 5 == 0 else []
        store.append(s, None, events)
        if runner is not None and i % 4 == 0:
            runner.run_once(batch=3)  # fold part of the way, in small steps


def test_incremental_and_rebuild_reach_identical_rows(db: tuple[sa.Engine, SqlEventStore]) -> None:
    engine, store = db
    runner = ProjectionRunner(engine, store, SPEC, stream_counts)
    append_history(store, runner)
    runner.run_to_end(batch=5)
    incremental = runner.table_digest()
    before = rows(engine)
    assert runner.checkpoint() == store.last_position()
    assert before == fold_in_memory(store.read_all(limit=10_000))
    assert ("req-6", "acme", 1, 27, T0 + timedelta(minutes=27)) in before  # dropped at i=20

    read = runner.rebuild(batch=1000)
    assert read == len(store.read_all(limit=10_000))
    assert runner.table_digest() == incremental
    assert rows(engine) == before


def test_a_deleted_row_stays_deleted_after_rebuild(db: tuple[sa.Engine, SqlEventStore]) -> None:
    engine, store = db
    runner = ProjectionRunner(engine, store, SPEC, stream_counts)
    store.append("req-x", 0, [ttft("req-x", 1), routed("req-x", "drop")])
    runner.run_to_end()
    assert rows(engine) == []
    runner.rebuild()
    assert rows(engine) == []


def test_a_crash_mid_batch_leaves_rows_and_checkpoint_untouched(
    db: tuple[sa.Engine, SqlEventStore],
) -> None:
    engine, store = db
    append_history(store)
    crashes = {"left": 1}

    def flaky(row: dict[str, Any] | None, r: Recorded) -> dict[str, Any] | None:
        if r.position == 17 and crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("crash")
        return _project(row, r)

    runner = ProjectionRunner(
        engine, store, Spec(**{**SPEC.__dict__, "project": flaky}), stream_counts
    )
    runner.run_once(batch=10)
    digest, checkpoint = runner.table_digest(), runner.checkpoint()
    with pytest.raises(RuntimeError, match="crash"):
        runner.run_once(batch=10)
    assert (runner.table_digest(), runner.checkpoint()) == (digest, checkpoint)
    runner.run_to_end()

    assert rows(engine) == fold_in_memory(store.read_all(limit=10_000))


def test_applying_records_twice_is_applying_them_once(db: tuple[sa.Engine, SqlEventStore]) -> None:
    engine, store = db
    append_history(store)
    runner = ProjectionRunner(engine, store, SPEC, stream_counts)
    records = store.read_all(limit=10_000)
    with engine.begin() as conn:
        runner.apply_recorded(conn, records[:10])
    with engine.begin() as conn:
        runner.apply_recorded(conn, records)  # the first ten are redelivered
    once = runner.table_digest()
    runner.rebuild()
    assert runner.table_digest() == once


def test_rows_prepared_outside_the_lock_are_written_only_if_the_checkpoint_stayed(
    db: tuple[sa.Engine, SqlEventStore],
) -> None:
    engine, store = db
    append_history(store)
    records = store.read_all(limit=10_000)
    runner = ProjectionRunner(engine, store, SPEC, stream_counts)
    other = ProjectionRunner(engine, store, SPEC, stream_counts)  # e.g. a second worker
    with engine.connect() as conn:
        early = runner.prepare(conn, records[:12])
        late = runner.prepare(conn, records)
    assert early is not None and late is not None
    with engine.begin() as conn:
        assert runner.write(conn, early)
    with engine.begin() as conn:  # computed from checkpoint 0, which has moved: refused
        assert not runner.write(conn, late)
    assert runner.checkpoint() == records[11].position
    with engine.begin() as conn:
        other.apply_recorded(conn, records)  # under the lock: from the checkpoint on
    assert rows(engine) == fold_in_memory(records)
    with engine.connect() as conn:
        assert runner.prepare(conn, records) is None  # nothing new


def test_inline_projection_commits_with_the_append(db: tuple[sa.Engine, SqlEventStore]) -> None:
    engine, store = db
    runner = ProjectionRunner(engine, store, SPEC, stream_counts)
    store.before_commit.append(runner.apply_recorded)
    store.append("req-a", 0, [ttft("req-a", 3)])
    assert rows(engine) == [("req-a", "acme", 1, 3, T0)]
    assert runner.checkpoint() == store.last_position()

    def refuse(conn: sa.Connection, records: list[Recorded]) -> None:
        raise ProjectionError("cannot apply")

    store.before_commit.append(refuse)
    with pytest.raises(ProjectionError):
        store.append("req-a", 1, [ttft("req-a", 4)])
    assert store.stream_version("req-a") == 1  # the append rolled back with the projection
    assert rows(engine) == [("req-a", "acme", 1, 3, T0)]


def test_a_row_that_moves_its_key_is_refused(db: tuple[sa.Engine, SqlEventStore]) -> None:
    engine, store = db

    def moves(row: dict[str, Any] | None, r: Recorded) -> dict[str, Any] | None:
        new = _project(row, r)
        return None if new is None else {**new, "stream_id": "elsewhere"}

    runner = ProjectionRunner(
        engine, store, Spec(**{**SPEC.__dict__, "project": moves}), stream_counts
    )
    store.append("req-a", 0, [ttft("req-a", 3)])
    with pytest.raises(ProjectionError, match="moved row"):
        runner.run_once()
    assert runner.checkpoint() == 0


def test_the_real_read_models_fold_every_kind_of_request(
    db: tuple[sa.Engine, SqlEventStore],
) -> None:
    """The domain's projections into the migrated tables: completed, rejected, cancelled and
    expired requests all fit the schema, and a rebuild reaches the same rows."""
    from dataclasses import replace as dc_replace

    from tests import builders as b
    from tollgate_llm.domain.projections import PROJECTIONS

    engine, store = db
    t0 = datetime(2026, 11, 1, tzinfo=UTC)
    streams = {
        "req-done": b.happy_path(),
        "req-refused": [b.rejected(reason="tokens")],
        "req-invalid": [b.rejected(reason="invalid", model="")],
        "req-left": [b.admitted(), b.estimated(), b.routed(), b.cancelled(), b.refunded()],
        "req-lost": [b.admitted(), b.estimated(), b.lease_expired(), b.refunded()],
    }
    for i, (rid, events) in enumerate(streams.items()):
        new = [
            NewEvent(
                str(uuid.uuid4()),
                rid,
                b.TENANT,
                t0 + timedelta(minutes=i, seconds=j),
                dc_replace(e, request_id=rid),
            )  # type: ignore[type-var]
            for j, e in enumerate(events)
        ]
        store.append(rid, 0, new)
    runners = [
        ProjectionRunner(engine, store, spec)
        for spec in PROJECTIONS
    ]
    digests = []
    for runner in runners:
        runner.run_to_end()
        digests.append(runner.table_digest())
    with engine.connect() as conn:
        statuses = dict(conn.execute(sa.text("SELECT request_id, status FROM request_log")).all())
        ledger = conn.execute(sa.text("SELECT COUNT(*) FROM ledger_entries")).scalar()
    assert statuses == {
        "req-done": "completed",
        "req-refused": "rejected",
        "req-invalid": "rejected",
        "req-left": "cancelled",
        "req-lost": "lease_expired",
    }
    assert ledger == 1
    for runner, digest in zip(runners, digests, strict=True):
        runner.rebuild()
        assert runner.table_digest() == digest
        # One event a batch: every row but its first event's is read back, replaced and
        # written again (the first event opens its row without reading it).
        runner.rebuild(batch=1)
        assert runner.table_digest() == digest


def test_rows_are_stored_as_sqlalchemy_stores_them(db: tuple[sa.Engine, SqlEventStore]) -> None:
    """On SQLite the runner writes on the driver alone; what it stores must be byte-for-byte
    what SQLAlchemy stores (range queries compare SQLite's DATETIME text as text)."""
    engine, store = db
    store.append("req-a", None, [ttft("req-a", 7, minute=3)])
    ProjectionRunner(engine, store, SPEC, stream_counts).run_to_end()
    with engine.begin() as conn:
        conn.execute(
            stream_counts.insert(),
            {"stream_id": "ref", "tenant_id": "acme", "events": 1, "ttft_ms_sum": 7,
             "last_at": T0 + timedelta(minutes=3)},
        )
        stored = conn.execute(
            sa.text(
                "SELECT stream_id, CAST(events AS TEXT), CAST(last_at AS TEXT) "
                "FROM test_stream_counts ORDER BY stream_id"
            )
        ).all()
    assert [tuple(r[1:]) for r in stored] == [("1", stored[1][2])] * 2
    assert [r[0] for r in stored] == ["ref", "req-a"]


def test_rows_are_read_back_as_sqlalchemy_reads_them(db: tuple[sa.Engine, SqlEventStore]) -> None:
    """On SQLite the runner loads rows on the driver alone; they must equal SQLAlchemy's reading
    of the same rows, types and time zones included (the real read models: text, integer and
    instant columns, NULLs, a key with an instant in it)."""
    from dataclasses import replace as dc_replace

    from tests import builders as b
    from tollgate_llm.domain.projections import PROJECTIONS

    engine, store = db
    t0 = datetime(2026, 11, 1, 0, 59, 59, 999_999, tzinfo=UTC)
    streams = {
        "req-done": b.happy_path(),
        "req-refused": [b.rejected(reason="tokens")],
        "req-left": [b.admitted(), b.estimated(), b.routed(), b.cancelled(), b.refunded()],
    }
    for i, (rid, events) in enumerate(streams.items()):
        store.append(rid, 0, [
            NewEvent(str(uuid.uuid4()), rid, b.TENANT, t0 + timedelta(hours=i, seconds=j),
                     dc_replace(e, request_id=rid))  # type: ignore[type-var]
            for j, e in enumerate(events)
        ])
    for spec in PROJECTIONS:
        runner = ProjectionRunner(engine, store, spec)
        runner.run_to_end()
        table = schema.metadata.tables[spec.name]
        with engine.connect() as conn:
            expected = {
                tuple(r[: len(spec.key_columns)]): dict(zip(spec.columns, r, strict=True))
                for r in conn.execute(sa.select(*(table.c[n] for n in spec.columns)))
            }
            assert expected, spec.name
            missing = ("no-such-key", *next(iter(expected))[1:])
            keys = [*expected, missing]
            loaded = dict(runner._load(conn, keys))
        assert loaded == expected, spec.name
        for key, row in loaded.items():
            for name, value in row.items():
                assert type(value) is type(expected[key][name]), (spec.name, name)
                if isinstance(value, datetime):
                    assert value.tzinfo is UTC, (spec.name, name)


@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_ledger_row_records_when_it_was_written_and_a_rebuild_ignores_it(
    request: pytest.FixtureRequest, db: str
) -> None:
    """`recorded_at` (migration 0014) is the database's clock at the insert: the billing lag's
    end (bench/pipeline.py). It is no projection column, so a rebuild has the same digest."""
    from tests import builders as b
    from tollgate_llm.domain.projections import LEDGER_ENTRIES

    url = request.getfixturevalue(f"{db}_url")
    schema.upgrade(url)
    engine = create_engine_from_url(url)
    try:
        store = SqlEventStore(engine)
        finished = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=5)
        bill = b.billed(request_id="req_1", finished_at=finished)
        store.append("req_1", None, [NewEvent(str(uuid.uuid4()), "req_1", b.TENANT, finished,
                                              bill)])  # fmt: skip
        runner = ProjectionRunner(engine, store, LEDGER_ENTRIES)
        before = datetime.now(UTC).replace(microsecond=0)
        runner.run_to_end()
        digest = runner.table_digest()
        read = sa.select(schema.ledger_entries.c.recorded_at)
        with engine.connect() as conn:
            written = conn.execute(read).scalar_one()
        assert before <= written <= datetime.now(UTC)
        assert written - finished >= timedelta(seconds=5)
        runner.rebuild()
        assert runner.table_digest() == digest
    finally:
        engine.dispose()

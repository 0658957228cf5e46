"""The EventStore contract, run against every implementation: in memory, SQLite, PostgreSQL."""

from __future__ import annotations

import dataclasses
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest

from tests.fakes import InMemoryEventStore
from tollgate_llm.domain.control_plane.events import TenantRegistered
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.events import FirstTokenStreamed, RequestRejected, RequestRouted
from tollgate_llm.ledger import schema
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.ids import IdSource, new_writer_tag, tagged_event_ids
from tollgate_llm.ledger.store import (
    AppendBatch,
    EventIdConflict,
    EventStore,
    NewEvent,
    SqlEventStore,
    WrongExpectedVersion,
    tails,
)

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def new(
    stream_id: str, ttft_ms: int = 10, *, event_id: str | None = None, **kw: object
) -> NewEvent:
    return NewEvent(
        event_id=event_id or str(uuid.uuid4()),
        stream_id=stream_id,
        tenant_id=str(kw.get("tenant_id", "acme")),
        occurred_at=kw.get("occurred_at", T0),  # type: ignore[arg-type]
        event=FirstTokenStreamed(request_id=stream_id, ttft_ms=ttft_ms),
    )


def stream() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


@pytest.fixture(
    params=[
        "memory",
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("postgres-insert", marks=pytest.mark.postgres),
    ]
)
def store(request: pytest.FixtureRequest) -> Iterator[EventStore]:
    if request.param == "memory":
        yield InMemoryEventStore()
        return
    url = request.getfixturevalue(f"{request.param.split('-')[0]}_url")
    schema.upgrade(url)
    engine = create_engine_from_url(url)
    try:
        # "postgres": multi-event appends take PostgreSQL's COPY path, single events the
        # one-statement insert; "postgres-insert": every append the one-statement insert.
        copy_min_rows = 10**9 if request.param == "postgres-insert" else 2
        yield SqlEventStore(engine, copy_min_rows=copy_min_rows)
    finally:
        engine.dispose()


def test_append_then_read_back(store: EventStore) -> None:
    s = stream()
    appended = store.append(s, 0, [new(s, 1), new(s, 2)])

    assert [r.stream_version for r in appended] == [1, 2]
    assert appended[0].position < appended[1].position
    assert [r.event for r in appended] == [FirstTokenStreamed(s, 1), FirstTokenStreamed(s, 2)]
    assert store.read_stream(s) == appended
    assert store.read_all() == appended
    assert store.stream_version(s) == 2
    assert store.last_position() == appended[-1].position
    assert store.read_stream("req-missing") == []
    assert store.stream_version("req-missing") == 0


def test_instants_come_back_as_the_same_utc_instant(store: EventStore) -> None:
    s = stream()
    paris = datetime(2026, 11, 29, 13, 0, 0, 123456, tzinfo=timezone(timedelta(hours=1)))
    store.append(s, 0, [new(s, occurred_at=paris)])

    (read,) = store.read_stream(s)
    assert read.occurred_at == paris
    assert read.occurred_at.tzinfo == UTC


def test_expected_version_must_match(store: EventStore) -> None:
    s = stream()
    store.append(s, 0, [new(s)])

    with pytest.raises(WrongExpectedVersion) as stale:
        store.append(s, 0, [new(s)])
    assert (stale.value.stream_id, stale.value.expected, stale.value.actual) == (s, 0, 1)
    assert "is at version 1, expected 0" in str(stale.value)

    with pytest.raises(WrongExpectedVersion) as ahead:
        store.append(s, 5, [new(s)])
    assert (ahead.value.expected, ahead.value.actual) == (5, 1)

    assert [r.stream_version for r in store.append(s, 1, [new(s)])] == [2]
    assert [r.stream_version for r in store.append(s, None, [new(s)])] == [3]
    assert store.stream_version(s) == 3


def test_concurrent_appends_to_one_stream_exactly_one_wins(store: EventStore) -> None:
    for _ in range(10):
        s = stream()
        barrier = threading.Barrier(2)
        outcomes: list[object] = []

        def append(
            s: str = s, barrier: threading.Barrier = barrier, outcomes: list[object] = outcomes
        ) -> None:
            event = new(s)
            barrier.wait()
            try:
                outcomes.append(store.append(s, 0, [event]))
            except WrongExpectedVersion as exc:
                outcomes.append(exc)

        threads = [threading.Thread(target=append) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        errors = [o for o in outcomes if isinstance(o, WrongExpectedVersion)]
        assert len(outcomes) == 2 and len(errors) == 1
        assert (errors[0].expected, errors[0].actual) == (0, 1)
        assert len(store.read_stream(s)) == 1


def test_reappending_the_same_events_is_a_no_op(store: EventStore) -> None:
    s = stream()
    batch = [new(s, 1), new(s, 2)]
    first = store.append(s, 0, batch)
    position = store.last_position()

    assert store.append(s, 0, batch) == first
    assert store.append(s, None, batch) == first
    assert store.append(s, 7, batch) == first
    assert store.last_position() == position
    assert store.read_stream(s) == first


def test_same_event_id_with_different_content_is_refused(store: EventStore) -> None:
    s = stream()
    original = new(s, 1)
    store.append(s, 0, [original])

    with pytest.raises(EventIdConflict) as changed:
        store.append(s, 1, [new(s, 99, event_id=original.event_id)])
    assert changed.value.event_id == original.event_id
    assert changed.value.fields == ("payload.ttft_ms",)

    other = stream()
    with pytest.raises(EventIdConflict) as moved:
        store.append(other, 0, [new(other, 1, event_id=original.event_id, tenant_id="globex")])
    assert set(moved.value.fields) == {"stream_id", "tenant_id", "payload.request_id"}

    with pytest.raises(EventIdConflict) as mixed:
        store.append(s, 1, [original, new(s, 2)])
    assert mixed.value.fields == ("batch",)
    assert store.read_stream(s)[0].event == FirstTokenStreamed(s, 1)
    assert store.stream_version(s) == 1 and store.stream_version(other) == 0


def test_an_append_is_all_or_nothing(store: EventStore) -> None:
    s = stream()
    bad = NewEvent(str(uuid.uuid4()), s, "acme", T0, FirstTokenStreamed(s, 1.5))  # type: ignore[arg-type]
    with pytest.raises(DomainError):
        store.append(s, 0, [new(s), bad])
    with pytest.raises(ValueError):
        store.append(s, 0, [new(s), new("req-elsewhere")])
    assert store.read_stream(s) == []
    assert store.last_position() == 0


def test_append_many_a_conflicting_batch_does_not_sink_the_others(store: EventStore) -> None:
    taken, a, b = stream(), stream(), stream()
    store.append(taken, 0, [new(taken)])
    repeated = [new(a, 1)]
    store.append(a, 0, repeated)

    results = store.append_many(
        [
            AppendBatch(b, 0, [new(b, 1), new(b, 2)]),
            AppendBatch(taken, 0, [new(taken)]),  # stale
            AppendBatch(a, 0, repeated),  # a retry: answered from the store
            AppendBatch(a, 1, [new(a, 2)]),
            AppendBatch(b, 2, [new(b, 3)]),  # sees the first batch of this call
            AppendBatch(b, 2, [new(b, 4)]),  # and so this one is stale
        ]
    )

    assert [r.ok for r in results] == [True, False, True, True, True, False]
    assert isinstance(results[1].error, WrongExpectedVersion)
    assert results[2].duplicate and results[2].records == store.read_stream(a)[:1]
    assert isinstance(results[5].error, WrongExpectedVersion)
    assert (results[5].error.expected, results[5].error.actual) == (2, 3)
    with pytest.raises(WrongExpectedVersion):
        results[1].unwrap()
    assert [r.event.ttft_ms for r in store.read_stream(b)] == [1, 2, 3]  # type: ignore[attr-defined]
    assert [r.stream_version for r in store.read_stream(b)] == [1, 2, 3]
    assert len(store.read_stream(taken)) == 1
    assert len(store.read_stream(a)) == 2
    written = [r for res in results if res.ok and not res.duplicate for r in res.records]
    assert sorted(r.position for r in written) == [r.position for r in written]


def test_append_many_finds_repeated_ids_that_pass_the_version_check(store: EventStore) -> None:
    a, b = stream(), stream()
    first = store.append(a, None, [new(a, 1)])
    original = NewEvent(first[0].event_id, a, "acme", T0, FirstTokenStreamed(a, 1))
    changed = NewEvent(first[0].event_id, a, "acme", T0, FirstTokenStreamed(a, 2))

    results = store.append_many(
        [
            AppendBatch(b, None, [new(b)]),
            AppendBatch(a, None, [original]),
            AppendBatch(a, None, [changed]),
            AppendBatch(b, None, [new(b)]),
        ]
    )

    assert [r.ok for r in results] == [True, True, False, True]
    assert results[1].duplicate and results[1].records == first
    assert isinstance(results[2].error, EventIdConflict)
    assert [r.stream_version for r in store.read_stream(b)] == [1, 2]
    assert store.stream_version(a) == 1


def test_read_all_is_in_position_order_and_pages(store: EventStore) -> None:
    streams = [stream() for _ in range(5)]
    for round_ in range(5):
        for s in streams:
            store.append(s, round_, [new(s, round_)])
    everything = store.read_all(limit=1000)
    assert len(everything) == 25
    positions = [r.position for r in everything]
    assert positions == sorted(positions) and len(set(positions)) == 25

    pages, after = [], 0
    while page := store.read_all(after_position=after, limit=7):
        assert len(page) <= 7
        pages.extend(page)
        after = page[-1].position
    assert pages == everything
    assert store.read_all(after_position=everything[-1].position) == []
    assert store.last_position() == everything[-1].position


def test_read_all_gives_back_the_callers_own_records_and_only_those(store: EventStore) -> None:
    """`known`: records the caller holds by position (its appends' answers). What comes back
    equals the plain read either way; a known record whose event id is not the one stored at
    its position is never given back."""
    s = stream()
    appended = store.append(s, 0, [new(s, n) for n in range(4)])
    plain = store.read_all(limit=1000)
    mine = {r.position: r for r in appended[:2]}
    impostor = dataclasses.replace(appended[3], event_id=str(uuid.uuid4()))
    read = store.read_all(limit=1000, known={**mine, impostor.position: impostor})
    assert read == plain
    assert impostor not in read
    if isinstance(store, SqlEventStore):  # the store's own decoding is what it saves
        assert [r for r in read if r.position in mine] == list(mine.values())
        assert all(r is mine[r.position] for r in read if r.position in mine)


def test_read_streams_with_prefix(store: EventStore) -> None:
    def registered(tenant: str) -> NewEvent:
        return NewEvent(
            str(uuid.uuid4()),
            f"tenant-{tenant}",
            tenant,
            T0,
            TenantRegistered(tenant, tenant.title(), "free", "salt"),
        )

    store.append("tenant-acme", 0, [registered("acme")])
    s = stream()
    store.append(s, 0, [new(s)])
    store.append(
        "tenant_x",
        0,
        [NewEvent(str(uuid.uuid4()), "tenant_x", "x", T0, RequestRouted("r", "replica", 1))],
    )
    store.append("tenant-globex", 0, [registered("globex")])
    store.append(
        "fleet",
        0,
        [NewEvent(str(uuid.uuid4()), "fleet", "-", T0, RequestRouted("r", "replica", 1))],
    )

    tenants = store.read_streams_with_prefix("tenant-")
    assert [r.stream_id for r in tenants] == ["tenant-acme", "tenant-globex"]
    assert [r.stream_id for r in store.read_streams_with_prefix(("tenant-", "fleet"))] == [
        "tenant-acme",
        "tenant-globex",
        "fleet",
    ]
    assert store.read_streams_with_prefix("tenant%") == []
    # The tail of the log, filtered the same way (a control-plane follower's read).
    acme = tenants[0].position
    tail = store.read_all(acme, 10, stream_prefixes=("tenant-", "fleet"))
    assert [r.stream_id for r in tail] == ["tenant-globex", "fleet"]
    assert [r.stream_id for r in store.read_all(acme, 1, stream_prefixes=("tenant-",))] == [
        "tenant-globex"
    ]
    assert store.read_all(0, 10, stream_prefixes=("tenant%",)) == []


def test_the_tail_reads_only_the_types_asked_for(store: EventStore) -> None:
    # What an edge's admission views fold: a tail that skips the types they do not.
    s = stream()
    def routed() -> NewEvent:
        return NewEvent(str(uuid.uuid4()), s, "acme", T0, RequestRouted(s, "replica", 1))

    first = store.append(s, 0, [new(s), routed(), new(s), routed()])
    kinds = ("RequestRouted",)
    tail = store.read_all(0, 10, event_types=kinds)
    assert [r.position for r in tail] == [first[1].position, first[3].position]
    assert [r.position for r in store.read_all(first[1].position, 1, event_types=kinds)] == [
        first[3].position
    ]
    assert store.read_all(0, 10, event_types=("NoSuchEvent",)) == []
    assert len(store.read_all(0, 10, event_types=())) == 4  # no filter: every type


def test_a_followers_tail_skips_its_own_writes_and_moves_past_what_it_skipped(
    store: EventStore,
) -> None:
    # An edge's log follower: the types its views fold, less what its own process wrote.
    ours, theirs = tagged_event_ids("0badcafe"), tagged_event_ids("feedf00d")
    s = stream()

    def event(new_id: IdSource, n: int) -> NewEvent:
        return NewEvent(new_id(), s, "acme", T0, RequestRouted(s, "replica", n))

    first = store.append(s, 0, [event(ours, 1), event(theirs, 2), event(ours, 3)])
    kinds = ("RequestRouted",)
    read, position = store.read_tail(0, 10, kinds, "0badcafe")
    assert [r.position for r in read] == [first[1].position]
    assert position == first[2].position  # past its own last event, which it did not read
    assert store.read_tail(position, 10, kinds, "0badcafe") == ([], position)
    # Nothing of those types at all: the position still moves to the head.
    other = store.append(s, 3, [new(s, 9)])
    assert store.read_tail(position, 10, kinds, "0badcafe") == ([], other[0].position)
    # `limit` events back: the position is the last one's, not the head's.
    more = store.append(s, 4, [event(theirs, 5), event(theirs, 6)])
    read, at = store.read_tail(0, 2, kinds, "0badcafe")
    assert [r.position for r in read] == [first[1].position, more[0].position]
    assert at == more[0].position
    # No suffix: every event of the types.
    assert len(store.read_tail(0, 10, kinds)[0]) == 5


def test_a_followers_tail_read_in_windows_is_the_tail_read_at_once(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL reads a tail in windows of positions; two positions a window here, so that
    # a read crosses several, some of them holding only skipped events.
    monkeypatch.setattr(tails, "TAIL_WINDOW", 2)
    ours, theirs = tagged_event_ids("0badcafe"), tagged_event_ids("feedf00d")
    s = stream()
    made = [ours, ours, ours, theirs, ours, theirs, theirs, ours]
    events = [NewEvent(m(), s, "acme", T0, RequestRouted(s, "replica", n)) for n, m in
              enumerate(made, 1)]  # fmt: skip
    written = store.append(s, 0, events)
    theirs_at = [r.position for r, m in zip(written, made, strict=True) if m is theirs]
    read, at = store.read_tail(0, 10, ("RequestRouted",), "0badcafe")
    assert [r.position for r in read] == theirs_at and at == written[-1].position
    assert read == [r for r in store.read_all(0, 10) if r.position in theirs_at]
    read, at = store.read_tail(0, 2, ("RequestRouted",), "0badcafe")
    assert [r.position for r in read] == theirs_at[:2] and at == theirs_at[1]


def test_tagged_event_ids_are_uuids_ending_with_the_writers_tag() -> None:
    ids = tagged_event_ids(new_writer_tag())
    made = [ids() for _ in range(1000)]
    assert len(set(made)) == 1000 and len({m[-8:] for m in made}) == 1
    assert all(str(uuid.UUID(m)) == m for m in made)
    with pytest.raises(ValueError):
        tagged_event_ids("0BADCAFE")


def test_awkward_text_survives_the_round_trip(store: EventStore) -> None:
    s = "req-\\weird\tstream"
    detail = 'tab\there, newline\nthere, back\\slash, quote " and \u00e9\u4e2d\U0001f600 and \\N'
    rejected = RequestRejected(s, "acme", "key", "model", "free", "invalid", 1, detail=detail)
    events = [NewEvent(str(uuid.uuid4()), s, "acme\\x", T0, rejected), new(s)]
    appended = store.append(s, 0, events)
    assert store.read_stream(s) == appended
    assert appended[0].event == rejected and appended[0].tenant_id == "acme\\x"
    assert store.append(s, 0, events) == appended  # and compares equal to itself on retry


def test_read_streams_answers_each_stream_in_version_order(store: EventStore) -> None:
    a, b_, c = stream(), stream(), stream()
    store.append(a, 0, [new(a, 1)])
    store.append(b_, 0, [new(b_, 1), new(b_, 2)])
    store.append(a, 1, [new(a, 2)])
    read = store.read_streams([a, b_, "req-missing", a])
    assert set(read) == {a, b_}
    assert [r.stream_version for r in read[a]] == [1, 2]
    assert [r.event for r in read[b_]] == [FirstTokenStreamed(b_, 1), FirstTokenStreamed(b_, 2)]
    assert read[a] == store.read_stream(a)
    assert store.read_streams([]) == {}
    # c was never written: asking for it alone answers nothing
    assert store.read_streams([c]) == {}


def test_read_stream_for_a_tenant_reads_another_tenants_stream_as_empty(store: EventStore) -> None:
    """Issue 27, item 9: a customer's read of an id filters by its tenant in the same query, so
    another tenant's stream is answered like an unknown one without being decoded."""
    s = stream()
    mine = store.append(s, 0, [new(s, 1, tenant_id="acme"), new(s, 2, tenant_id="acme")])
    assert store.read_stream(s, "acme") == mine == store.read_stream(s)
    assert store.read_stream(s, "globex") == [] == store.read_stream("req-missing", "globex")


def test_read_stream_window_slices_one_stream_by_position(store: EventStore) -> None:
    edge, other = stream(), stream()
    first = store.append(edge, None, [new(edge, 1)])[0]
    lo = store.append(other, 0, [new(other, 1)])[0].position
    middle = store.append(edge, None, [new(edge, 2), new(edge, 3)])
    hi = store.append(other, 1, [new(other, 2)])[0].position
    store.append(edge, None, [new(edge, 4)])
    assert store.read_stream_window(edge, lo, hi) == middle
    assert store.read_stream_window(edge, 0, lo) == [first]
    assert store.read_stream_window(edge, hi, hi) == []


def test_streams_with_finds_the_streams_of_an_event_type_in_a_period(store: EventStore) -> None:
    early, inside, late = stream(), stream(), stream()
    store.append(early, 0, [new(early, occurred_at=T0 - timedelta(seconds=1))])
    store.append(inside, 0, [new(inside, occurred_at=T0), new(inside, occurred_at=T0)])
    store.append(late, 0, [new(late, occurred_at=T0 + timedelta(hours=1))])
    found = store.streams_with("FirstTokenStreamed", T0, T0 + timedelta(hours=1))
    assert found == [inside]
    assert store.streams_with("RequestRouted", T0, T0 + timedelta(hours=1)) == []


def test_streams_with_a_tenant_finds_that_tenant_s_streams_only(store: EventStore) -> None:
    mine, theirs = stream(), stream()
    store.append(mine, 0, [new(mine, tenant_id="acme")])
    store.append(theirs, 0, [new(theirs, tenant_id="globex")])
    window = (T0, T0 + timedelta(hours=1))
    assert store.streams_with("FirstTokenStreamed", *window, tenant_id="acme") == [mine]
    assert store.streams_with("FirstTokenStreamed", *window, tenant_id="nobody") == []
    assert set(store.streams_with("FirstTokenStreamed", *window)) >= {mine, theirs}

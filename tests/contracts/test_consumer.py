"""The consumer port's contract (streams/consumer.py), run on the SQL tail and on both Kafka
consumers (confluent-kafka, faust-streaming) over the real Kafka-protocol broker, all against real
PostgreSQL: ordering per tenant, redelivery after a crash, a checkpoint that moves only with its
effect, rewind, dead letters."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import orjson
import pytest
import sqlalchemy as sa

from tests.kafka_helpers import append_requests, readable_store
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.codec import REASON_HEADER, encode
from tollgate_llm.streams.consumer import Batch, Delivery, EventConsumer
from tollgate_llm.streams.sql_tail import SqlTail
from tollgate_llm.streams.topics import confluent, dead_letter_topic, ensure_topic

pytestmark = pytest.mark.postgres
PARTITIONS = 4
# How long a consumer may take to join its group (and a faust app to start) on a loaded machine;
# what it reads is waited for after that, on the read's own deadline.
JOIN_WAIT_S = 180.0


@dataclass
class Harness:
    engine: sa.Engine
    store: SqlEventStore
    open: Callable[[str], EventConsumer]
    publish: Callable[[], None]  # move what the store holds to where consumers read it
    kind: str
    bootstrap: str = ""
    topic: str = ""


def publish_store(engine: sa.Engine, bootstrap: str, topic: str) -> None:
    """What the relay does, once, from the beginning (the relay has its own tests)."""
    ck = confluent()
    ensure_topic(bootstrap, topic, PARTITIONS)
    producer = ck.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for row in readable_store(engine, JOIN_WAIT_S):
        key, value = encode(row)
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def _harness(request: pytest.FixtureRequest, kind: str, postgres_url: str) -> Iterator[Harness]:
    upgrade(postgres_url)
    engine = create_engine_from_url(postgres_url)
    store = SqlEventStore(engine)
    opened: list[EventConsumer] = []
    bootstrap = topic = ""
    if kind == "sql_tail":

        def open_(name: str) -> EventConsumer:
            consumer = SqlTail(store, engine, name)
            opened.append(consumer)
            return consumer

        publish: Callable[[], None] = lambda: None  # noqa: E731 - the log is the transport
    else:
        from tollgate_llm.streams.faust_worker import FaustEventConsumer
        from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer

        bootstrap = request.getfixturevalue("kafka_broker").bootstrap
        topic = request.getfixturevalue("kafka_topic")
        ensure_topic(bootstrap, topic, PARTITIONS)

        def open_(name: str) -> EventConsumer:
            # A group of its own per test: the session's one broker keeps a group's protocol
            # and members across tests, and the two clients' protocols differ (a faust member
            # joining a group that confluent members formed is refused).
            group = f"{topic}.{name}"
            consumer = (
                FaustEventConsumer(engine, bootstrap, topic, group, start_timeout_s=JOIN_WAIT_S)
                if kind == "faust"
                else KafkaEventConsumer(engine, bootstrap, topic, group)
            )
            opened.append(consumer)
            return consumer

        def publish() -> None:
            publish_store(engine, bootstrap, topic)

    yield Harness(engine, store, open_, publish, kind, bootstrap, topic)
    for consumer in opened:
        with contextlib.suppress(RuntimeError):  # closed by the test already
            consumer.close()
    engine.dispose()


@pytest.fixture(params=["sql_tail", "kafka", "faust"])
def harness(request: pytest.FixtureRequest, postgres_url: str) -> Iterator[Harness]:
    yield from _harness(request, request.param, postgres_url)


@pytest.fixture
def kafka_harness(request: pytest.FixtureRequest, postgres_url: str) -> Iterator[Harness]:
    yield from _harness(request, "kafka", postgres_url)


def _effects_table(engine: sa.Engine) -> sa.Table:
    table = sa.Table(
        "effects", sa.MetaData(), sa.Column("event_id", sa.String(36), primary_key=True)
    )
    table.create(engine)
    return table


@pytest.fixture
def effects(harness: Harness) -> sa.Table:
    return _effects_table(harness.engine)


def _read(consumer: EventConsumer, want: int, wait_s: float = 60.0) -> list[Batch]:
    """Poll until `want` records came, within `wait_s` of the consumer's latest placement
    (bounded: a missing record fails, it never hangs).

    The group's join is waited for first, on a deadline of its own, and a consumer never
    assigned fails; a rebalance that places the consumer again starts the wait for the records
    over (it reads them from the checkpoint). On a loaded machine the join (a faust app's start
    with it) took over a minute, and a read whose wait it used up missed records on their way
    (or, reading for none, passed without having read anything)."""
    batches: list[Batch] = []
    start = time.monotonic()
    give_up = start + 2 * (JOIN_WAIT_S + wait_s)  # however often the group rebalances
    join_by: float = start + JOIN_WAIT_S
    deadline: float | None = None  # None: waiting for a placement (until join_by)
    placed: frozenset[int] = frozenset()
    while sum(len(x) for x in batches) < want:
        now = time.monotonic()
        held = _assignment(consumer)
        if held != placed:  # placed, or revoked (a confluent member's, until the next placement)
            placed = held
            if held:
                deadline = min(now + wait_s, give_up)
            else:
                deadline, join_by = None, min(now + JOIN_WAIT_S, give_up)
        if deadline is None and now >= join_by:
            pytest.fail(f"{consumer.name}: no partition assigned in {JOIN_WAIT_S:.0f} s")
        if deadline is not None and now >= deadline:
            break
        batch = consumer.poll(100, 0.5)
        if batch.next_offsets:
            batches.append(batch)
    return batches


def _assignment(consumer: EventConsumer) -> frozenset[int]:
    """The partitions the group gave the consumer (the SQL tail has no group: all, as one)."""
    return frozenset(getattr(consumer, "assigned", {0}))


def _apply(engine: sa.Engine, consumer: EventConsumer, batch: Batch, table: sa.Table) -> int:
    with engine.begin() as conn:
        fresh = consumer.claim(conn, batch)
        if fresh:
            conn.execute(table.insert(), [{"event_id": d.record.event_id} for d in fresh])
        consumer.commit(conn, batch)
    return len(fresh)


def _ids(batches: list[Batch]) -> list[str]:
    return [d.record.event_id for x in batches for d in x.deliveries]


def test_one_tenants_events_arrive_in_the_order_they_were_recorded(harness: Harness) -> None:
    tenants = [f"tenant-{uuid.uuid4().hex[:6]}" for _ in range(5)]
    appended = append_requests(harness.store, tenants, 6)
    harness.publish()
    batches = _read(harness.open("folds"), len(appended))
    got: list[Delivery] = [d for x in batches for d in x.deliveries]
    assert sorted(d.record.event_id for d in got) == sorted(appended)
    for tenant in tenants:
        positions = [d.record.position for d in got if d.record.tenant_id == tenant]
        assert positions == sorted(positions) and len(positions) == 18
        partitions = {d.partition for d in got if d.record.tenant_id == tenant}
        assert len(partitions) == 1  # a tenant never spans partitions


def test_what_was_polled_but_not_committed_is_delivered_again(
    harness: Harness, effects: sa.Table
) -> None:
    appended = append_requests(harness.store, ["a", "b", "c"], 4)
    harness.publish()
    first = harness.open("billing")
    seen = _read(first, len(appended))
    assert sorted(_ids(seen)) == sorted(appended)
    # Part of it is applied and committed; then the consumer dies before the rest.
    _apply(harness.engine, first, seen[0], effects)
    first.close()
    second = harness.open("billing")
    again = _read(second, len(appended) - len(seen[0]))
    applied = sum(_apply(harness.engine, second, batch, effects) for batch in again)
    assert applied == len(appended) - len(seen[0])
    with harness.engine.connect() as conn:
        stored = list(conn.execute(sa.select(effects.c.event_id)).scalars())
    assert sorted(stored) == sorted(appended)  # each once: the primary key would refuse twice


def test_the_checkpoint_moves_only_when_the_effect_commits(
    harness: Harness, effects: sa.Table
) -> None:
    appended = append_requests(harness.store, ["a", "b"], 3)
    harness.publish()
    first = harness.open("ledger")
    batches = _read(first, len(appended))
    for batch in batches:
        with pytest.raises(RuntimeError), harness.engine.begin() as conn:
            fresh = first.claim(conn, batch)
            conn.execute(effects.insert(), [{"event_id": d.record.event_id} for d in fresh])
            first.commit(conn, batch)
            raise RuntimeError("the effect's transaction fails after the commit call")
    first.close()
    second = harness.open("ledger")
    again = _read(second, len(appended))
    assert sorted(_ids(again)) == sorted(appended)
    assert sum(_apply(harness.engine, second, batch, effects) for batch in again) == len(appended)
    # A redelivery of what committed (a crash before the consumer learnt of its commit) is
    # claimed as nothing new.
    with harness.engine.begin() as conn:
        assert [second.claim(conn, batch) for batch in again] == [[] for _ in again]
    second.close()
    third = harness.open("ledger")
    assert _read(third, 1, wait_s=8.0) == []


def test_rewind_reads_again_what_a_failed_effect_did_not_commit(
    harness: Harness, effects: sa.Table
) -> None:
    appended = append_requests(harness.store, ["a"], 2)
    harness.publish()
    consumer = harness.open("rewind")
    batches = _read(consumer, len(appended))
    consumer.rewind()
    again = _read(consumer, len(appended))
    # At least once: a message fetched before the seek may come as well.
    assert set(_ids(again)) == set(_ids(batches)) == set(appended)


def test_groups_keep_their_own_checkpoints(harness: Harness, effects: sa.Table) -> None:
    appended = append_requests(harness.store, ["a", "b"], 2)
    harness.publish()
    one = harness.open("group-one")
    for batch in _read(one, len(appended)):
        _apply(harness.engine, one, batch, effects)
    two = harness.open("group-two")
    assert sorted(_ids(_read(two, len(appended)))) == sorted(appended)


# --- Kafka only: what cannot reach a topic through the store ---------------------------------


def test_bad_records_are_dead_lettered_with_their_reason_and_the_rest_flows(
    kafka_harness: Harness,
) -> None:
    """Kafka only: the SQL store refuses such records at append, only a topic can carry them."""
    h = kafka_harness
    effects = _effects_table(h.engine)
    appended = append_requests(h.store, ["good"], 2)
    h.publish()
    row = readable_store(h.engine, JOIN_WAIT_S)[0]
    good = orjson.loads(encode(row)[1])
    ck = confluent()
    producer = ck.Producer({"bootstrap.servers": h.bootstrap})
    for value in (
        b"not json", b"[1, 2]", orjson.dumps({**good, "type": "RequestTeleported"}),
        orjson.dumps({**good, "version": 99}),
    ):
        producer.produce(h.topic, key=b"good", value=value)
    assert producer.flush(10) == 0
    consumer = h.open("dead-letters")
    batches = _read(consumer, len(appended))
    deadline = time.monotonic() + 60
    while consumer.dead_letters < 4 and time.monotonic() < deadline:
        batches.append(consumer.poll(100, 0.5))
    assert sorted(_ids(batches)) == sorted(appended)
    assert consumer.dead_letters == 4
    for batch in batches:
        _apply(h.engine, consumer, batch, effects)
    reader = ck.Consumer({
        "bootstrap.servers": h.bootstrap, "group.id": f"dlq-{uuid.uuid4()}",
        "auto.offset.reset": "earliest",
    })
    reader.subscribe([dead_letter_topic(h.topic)])
    reasons: list[str] = []
    deadline = time.monotonic() + JOIN_WAIT_S  # the reader joins a group of its own first
    while len(reasons) < 4 and time.monotonic() < deadline:
        for message in reader.consume(10, 0.5):
            if message.error() is None:
                reasons.append(dict(message.headers())[REASON_HEADER].decode())
    reader.close()
    assert len(reasons) == 4
    assert reasons[0].startswith("not JSON") and reasons[1] == "not a JSON object"
    assert "unknown_event_type" in reasons[2] and "event_version_too_new" in reasons[3]
    # The checkpoint moved past them: a new member of the group reads nothing again.
    consumer.close()
    assert _read(h.open("dead-letters"), 1, wait_s=8.0) == []


def test_a_faust_member_that_its_group_refuses_fails_its_poll(kafka_harness: Harness) -> None:
    """faust only: aiokafka keeps a fatal group error for a fetch that faust never makes, so
    the consumer raises it itself instead of waiting, silent, for an assignment."""
    from tollgate_llm.streams.faust_worker import FaustEventConsumer
    from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer

    h = kafka_harness
    h.publish()
    group = f"{h.topic}.mixed"
    # A confluent member forms the group with its own protocol.
    formed = KafkaEventConsumer(h.engine, h.bootstrap, h.topic, group)
    refused = None
    try:
        deadline = time.monotonic() + JOIN_WAIT_S
        while not formed.assigned and time.monotonic() < deadline:
            formed.poll(100, 0.5)
        assert formed.assigned
        refused = FaustEventConsumer(
            h.engine, h.bootstrap, h.topic, group, start_timeout_s=JOIN_WAIT_S
        )
        with pytest.raises(RuntimeError, match="refused"):
            deadline = time.monotonic() + JOIN_WAIT_S
            while time.monotonic() < deadline:
                refused.poll(100, 0.5)
    finally:
        if refused is not None:
            refused.close()
        formed.close()

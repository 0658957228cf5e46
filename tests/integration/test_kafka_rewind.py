"""A rewind that fails (issue 26, item 1; DESIGN.md invariant 11): a Kafka worker's batch fails,
and so does the rewind that should read it again — on confluent it reads the saved offsets from
PostgreSQL, which is still refusing connections. The worker then owes the rewind: it retries it
before its next poll and applies nothing while it fails, so no later batch commits offsets past
the records of the failed one. With that rule switched off (the safeguard-off twin) the next
batch moves past them and their requests are never billed.

The failures are injected in-process (the rewind's database read raises once or several times,
on the real PostgreSQL and the real Kafka-protocol broker); tests/integration/test_pg_restart.py
does the same with a real PostgreSQL restart."""

from __future__ import annotations

import random
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests import builders as b
from tests.kafka_helpers import publish_all
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest, RouteRequest
from tollgate_llm.ledger.schema import ledger_entries
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.streams.relay import OutboxRelay

pytestmark = [pytest.mark.postgres, pytest.mark.kafka]
MODEL = "llama-3.1-8b-2026-05"
PARTITIONS = 4


class DatabaseDown(sa.exc.OperationalError):
    def __init__(self, what: str) -> None:
        super().__init__(what, None, Exception("connection refused (injected)"))


@pytest.fixture
def engine(postgres_engine: sa.Engine) -> sa.Engine:
    return postgres_engine  # offsets and the outbox: PostgreSQL only


def append_requests(store: SqlEventStore, count: int, rng: random.Random) -> set[str]:
    """`count` completed requests of six tenants (with the price they are billed at)."""
    at = datetime.now(UTC) - timedelta(days=1)
    price = NewEvent(
        str(uuid.uuid4()), f"prices-{MODEL}", "", at, PriceSet(MODEL, 150_000, 600_000, 75_000, at)
    )
    store.append(price.stream_id, 0, [price])
    batches, ids = [], set()
    for _ in range(count):
        rid, tenant = "req_" + uuid.uuid4().hex, f"tenant-{rng.randrange(6)}"
        prompt, completion = rng.randrange(10, 2000), rng.randrange(1, 500)
        now = datetime.now(UTC)
        decided = b.decided(
            AdmitRequest(
                rid, tenant, "key-1", MODEL, "standard", "edge-1",
                Estimate(prompt, 500, 1_000, 40_000),
            ),
            RouteRequest("replica-1", 0, request_id=rid),
            CompleteRequest(prompt, completion, 0, "stop", 30, 20_000, request_id=rid),
            at=now,
        )  # fmt: skip
        batches.append(
            AppendBatch(rid, 0, [NewEvent(str(uuid.uuid4()), rid, tenant, now, e) for e in decided])
        )
        ids.add(rid)
    for result in store.append_many(batches):
        result.unwrap()
    return ids


def ledger_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(ledger_entries.c.request_id)).scalars())


def open_consumer(client: str, engine: sa.Engine, bootstrap: str, topic: str) -> Any:
    from tollgate_llm.streams.topics import group_for

    if client == "faust":
        from tollgate_llm.streams.faust_worker import FaustEventConsumer

        return FaustEventConsumer(engine, bootstrap, topic, group_for(topic), max_records=40)
    from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer

    return KafkaEventConsumer(engine, bootstrap, topic, group_for(topic))


@pytest.mark.parametrize("client", ["confluent", "faust"])
@pytest.mark.parametrize(("safeguard", "rewind_failures"), [("on", 1), ("on", 3), ("off", 1)])
def test_a_failed_rewind_is_retried_before_anything_else_is_applied(
    engine: sa.Engine,
    kafka_broker: Any,
    kafka_topic: str,
    monkeypatch: pytest.MonkeyPatch,
    client: str,
    rewind_failures: int,
    safeguard: str,
) -> None:
    import tollgate_llm.streams.kafka_consumer as kc
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker

    store = SqlEventStore(engine)
    truth = append_requests(store, 60, random.Random(26))
    relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=PARTITIONS)
    relay.check_topic()
    published = publish_all(relay, engine)
    consumer = open_consumer(client, engine, kafka_broker.bootstrap, kafka_topic)
    worker = KafkaFoldWorker(engine, consumer)
    worker.rewinds_owed_first = safeguard == "on"
    try:
        # One batch folds (its offsets are saved), so the rewind has a place to go back to.
        deadline = time.monotonic() + 60
        while worker.folded == 0 and time.monotonic() < deadline:
            worker.run_batch(40, 0.5)
        assert 0 < worker.folded < published

        # The database goes down under the next batch and stays down for the rewind's read(s).
        failures = {"apply": 1, "rewind": rewind_failures}
        follow = worker.control_log.follow

        def follow_or_fail() -> None:
            if failures["apply"]:
                failures["apply"] -= 1
                raise DatabaseDown("the batch's first read")
            follow()

        monkeypatch.setattr(worker.control_log, "follow", follow_or_fail)
        if client == "faust":  # its rewind reads memory, not PostgreSQL: fail the rewind itself
            rewind = consumer.rewind

            def rewind_or_fail() -> None:
                if failures["rewind"]:
                    failures["rewind"] -= 1
                    raise DatabaseDown("the rewind")
                rewind()

            monkeypatch.setattr(consumer, "rewind", rewind_or_fail)
        else:
            read_places = kc.read_places

            def read_places_or_fail(*args: Any, **kwargs: Any) -> Any:
                if failures["rewind"]:
                    failures["rewind"] -= 1
                    raise DatabaseDown("the rewind's read of the saved offsets")
                return read_places(*args, **kwargs)

            monkeypatch.setattr(kc, "read_places", read_places_or_fail)

        failed = idle = 0
        folded_while_owed: list[int] = []
        deadline = time.monotonic() + 60
        while idle < 3 and time.monotonic() < deadline:
            before = worker.folded
            owed = failed > 0 and failures["rewind"] > 0
            try:
                applied = worker.run_batch(40, 0.5)
            except DatabaseDown:
                failed += 1
                applied = -1
            idle = idle + 1 if applied == 0 and failed else 0
            if owed:
                folded_while_owed.append(worker.folded - before)
    finally:
        consumer.close()
        relay.close()
    lost = truth - ledger_ids(engine)
    print(
        f"failed rewind ({client}, {rewind_failures} failure(s), safeguard {safeguard}): "
        f"{len(truth)} requests, {failed} batches failed, {len(lost)} never billed"
    )
    assert failures == {"apply": 0, "rewind": 0}  # every injected failure happened
    if safeguard == "off":
        assert lost, "with the rule off the next batch should move past the failed one"
        return
    assert failed == rewind_failures  # the batch, then each retry of the owed rewind
    if rewind_failures > 1:  # nothing applied while the rewind was owed
        assert folded_while_owed and set(folded_while_owed) == {0}
    assert lost == set()
    assert worker.folded == published


@pytest.mark.parametrize("client", ["confluent", "faust"])
def test_a_rebalance_while_postgres_is_down_neither_skips_nor_stalls(
    engine: sa.Engine,
    kafka_broker: Any,
    kafka_topic: str,
    monkeypatch: pytest.MonkeyPatch,
    client: str,
) -> None:
    """The saved offsets cannot be read when the group assigns the partitions (the database is
    down during the rebalance): confluent reads each partition from its start (`claim` drops
    what was applied), faust tries the read again until it succeeds. Before, faust's rebalance
    ended there and the worker folded nothing, reporting nothing."""
    import tollgate_llm.streams.kafka_consumer as kc
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker

    store = SqlEventStore(engine)
    truth = append_requests(store, 60, random.Random(27))
    relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=PARTITIONS)
    relay.check_topic()
    published = publish_all(relay, engine)
    failures = {"read": 3}
    read_places = kc.read_places

    def read_places_or_fail(*args: Any, **kwargs: Any) -> Any:
        if failures["read"]:
            failures["read"] -= 1
            raise DatabaseDown("the assignment's read of the saved offsets")
        return read_places(*args, **kwargs)

    monkeypatch.setattr(kc, "read_places", read_places_or_fail)
    consumer = open_consumer(client, engine, kafka_broker.bootstrap, kafka_topic)
    worker = KafkaFoldWorker(engine, consumer)
    failed = 0
    try:
        deadline = time.monotonic() + 60
        while worker.folded < published and time.monotonic() < deadline:
            try:
                worker.run_batch(40, 0.5)
            except Exception:
                failed += 1
    finally:
        consumer.close()
        relay.close()
    lost = truth - ledger_ids(engine)
    print(
        f"rebalance with PostgreSQL down ({client}): {3 - failures['read']} failed reads, "
        f"{failed} batches failed, {worker.folded} of {published} records applied, "
        f"{len(lost)} never billed"
    )
    assert failures["read"] < 3  # the assignment did meet the failure
    assert worker.folded == published and lost == set()


@pytest.mark.parametrize("client", ["confluent", "faust"])
@pytest.mark.parametrize("safeguard", ["on", "off"])
def test_a_poll_that_fails_after_taking_records_is_read_again(
    engine: sa.Engine, kafka_broker: Any, kafka_topic: str, client: str, safeguard: str
) -> None:
    """Found by the fault matrix (`broker.poll:after`): a poll that raises after the consumer
    took records from the broker never handed them over, and the next batch committed offsets
    past them — 216 of 274 requests with a terminal event and no bill. The failed poll is now
    owed a rewind like a failed batch."""
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker

    store = SqlEventStore(engine)
    truth = append_requests(store, 60, random.Random(27))
    relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=PARTITIONS)
    relay.check_topic()
    publish_all(relay, engine)
    consumer = open_consumer(client, engine, kafka_broker.bootstrap, kafka_topic)
    worker = KafkaFoldWorker(engine, consumer)
    worker.rewinds_owed_first = safeguard == "on"
    poll = consumer.poll
    taken: list[int] = []

    def poll_then_fail(*args: Any, **kwargs: Any) -> Any:
        batch = poll(*args, **kwargs)
        if batch.deliveries and not taken:  # the records are taken, then the call fails
            taken.append(len(batch.deliveries))
            raise ConnectionResetError("the poll failed after taking records (injected)")
        return batch

    consumer.poll = poll_then_fail  # type: ignore[method-assign]
    try:
        deadline = time.monotonic() + 60
        idle = 0
        while idle < 3 and time.monotonic() < deadline:
            try:
                applied = worker.run_batch(40, 0.5)
            except ConnectionResetError:
                applied = -1
            idle = idle + 1 if applied == 0 and taken else 0
    finally:
        consumer.close()
        relay.close()
    lost = truth - ledger_ids(engine)
    print(f"failed poll ({client}, safeguard {safeguard}): {taken} taken, {len(lost)} lost")
    assert taken
    if safeguard == "off":
        assert lost, "without the owed rewind the taken records should be lost"
        return
    assert lost == set()

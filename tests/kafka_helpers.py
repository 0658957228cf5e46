"""Helpers for tests on the real Kafka-protocol broker: what a topic holds, and events to put in
the store."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.ledger.outbox import OutboxReader, OutboxRow
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.streams.codec import EPOCH_HEADER, decode
from tollgate_llm.streams.topics import confluent


@dataclass(frozen=True)
class OnTopic:
    partition: int
    offset: int
    record: Recorded
    txid: int
    epoch: int

    @property
    def key(self) -> tuple[int, int]:
        return (self.txid, self.record.position)


def read_topic(bootstrap: str, topic: str, *, wait_s: float = 30.0) -> list[OnTopic]:
    """Every message the topic holds now, from each partition's start to its high watermark."""
    ck = confluent()
    consumer = ck.Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4()}",
         "enable.auto.commit": False}
    )
    try:
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = sorted(metadata.topics[topic].partitions)
        ends = {
            p: consumer.get_watermark_offsets(ck.TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        }
        consumer.assign(
            [ck.TopicPartition(topic, p, ck.OFFSET_BEGINNING) for p in partitions if ends[p]]
        )
        got: list[OnTopic] = []
        done = {p: 0 for p in partitions if ends[p]}
        deadline = time.monotonic() + wait_s
        while any(done[p] < ends[p] for p in done) and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                if message.error() is not None:
                    continue
                record, txid = decode(message.value())
                headers = dict(message.headers() or [])
                got.append(
                    OnTopic(message.partition(), message.offset(), record, txid,
                            int(headers.get(EPOCH_HEADER, b"0")))
                )
                done[message.partition()] = message.offset() + 1
        assert all(done[p] >= ends[p] for p in done), "the topic could not be read to its end"
        return got
    finally:
        consumer.close()


def append_requests(
    store: SqlEventStore, tenants: list[str], per_tenant: int, *, group: int = 1
) -> list[str]:
    """`per_tenant` small request streams (three events) per tenant, interleaved, `group`
    streams per group commit; the event ids appended."""
    ids: list[str] = []
    pending: list[AppendBatch] = []
    for i in range(per_tenant):
        for tenant in tenants:
            rid = f"req_{uuid.uuid4().hex}"
            events = [b.admitted(tenant_id=tenant, request_id=rid), b.routed(), b.completed()]
            new = [NewEvent(str(uuid.uuid4()), rid, tenant, b.at(i), event) for event in events]
            pending.append(AppendBatch(rid, 0, new))
            ids += [n.event_id for n in new]
            if len(pending) >= group:
                _commit(store, pending)
    _commit(store, pending)
    return ids


def _commit(store: SqlEventStore, pending: list[AppendBatch]) -> None:
    if pending:
        for result in store.append_many(pending):
            result.unwrap()
        pending.clear()


def readable_store(engine: sa.Engine, wait_s: float = 180.0) -> list[OutboxRow]:
    """Every event the store holds, as the relay reads them, once all are readable. The relay
    reads an event only once no transaction older than it is still open anywhere on the server
    (`OutboxReader.read_committed`), and other suites' tests (or their services) may hold one
    open on the same server for a while: read once, the store gave part of its events or none,
    and a consumer then waited for records that were never published."""
    reader = OutboxReader(engine)
    held = reader.backlog((0, 0))
    deadline = time.monotonic() + wait_s
    rows = reader.read_committed((0, 0), 100_000)
    while len(rows) < held and time.monotonic() < deadline:
        time.sleep(0.1)
        rows = reader.read_committed((0, 0), 100_000)
    assert len(rows) == held, f"{len(rows)} of the store's {held} events readable"
    return rows


def publish_all(relay: Any, engine: sa.Engine, *, wait_s: float = 180.0) -> int:
    """A fresh relay's first run, once every stored event is readable by its rule
    (`readable_store`): until a pass publishes nothing; the count, which is all of them."""
    held = len(readable_store(engine, wait_s))
    published = 0
    while n := relay.publish_once():
        published += n
    assert published == held, f"{published} of the store's {held} events published"
    return published

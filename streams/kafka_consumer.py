"""`KafkaEventConsumer`: the consumer port over the event topic (confluent-kafka), with its
offsets in PostgreSQL (`ledger.offsets`), saved in the transaction of the effect they cover.

Kafka's own offset commits are not used: an offset committed to the broker and a row committed to
the database can never be one atomic step without Kafka transactions (which nothing here may rely
on), so the database is the only place the group's position lives. On every assignment the
consumer seeks each partition to its saved offset (from the beginning when the saved offset
belongs to an older relay epoch: the topic was re-published after a broker loss), and `claim`
drops records at or below the partition's saved order key, which makes a redelivery of any
kind harmless.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.offsets import PartitionPlace, claim_places, read_places, save_places
from tollgate_llm.ledger.outbox import current_epoch
from tollgate_llm.streams.codec import EPOCH_HEADER, REASON_HEADER, BadRecord, decode
from tollgate_llm.streams.consumer import Batch, Delivery
from tollgate_llm.streams.topics import client_settings, confluent, dead_letter_topic

log = logging.getLogger("tollgate.kafka_consumer")


class SavedOffsets:
    """What every consumer of the event topic keeps in PostgreSQL, whichever client reads the
    topic (confluent-kafka here, faust-streaming in `streams/faust_worker.py`): where each
    partition resumes, `claim` and `commit` inside the effect's transaction, and the dead-letter
    topic. A subclass reads the messages and seeks its client to `_seek_targets` on every
    assignment."""

    def __init__(
        self, engine: sa.Engine, bootstrap: str, topic: str, name: str,
        kafka_settings: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        ck = confluent()
        self._ck = ck
        self.engine = engine
        self.topic = topic
        self.name = name
        self.dead_letters = 0
        self.assigned: set[int] = set()
        self._claimed: dict[int, PartitionPlace] = {}
        # Per partition, the relay epoch of the messages being read (None: reading from the
        # start, whatever epoch that is).
        self._epochs: dict[int, int | None] = {}
        self.kafka_settings = dict(kafka_settings or {})  # the cluster's own (TLS, SASL)
        self._producer = ck.Producer(client_settings(
            bootstrap, {"enable.idempotence": True}, kafka_settings=self.kafka_settings
        ))  # fmt: skip

    def _seek_targets(self, partitions: list[int], beginning: int) -> dict[int, int]:
        epoch = current_epoch(self.engine, self.topic)
        places = read_places(self.engine, self.name, self.topic, partitions)
        targets = {}
        for p in partitions:
            if p in places and places[p].epoch == epoch:
                targets[p], self._epochs[p] = places[p].next_offset, epoch
            else:  # never read, or the offsets of an epoch whose messages are gone
                targets[p], self._epochs[p] = beginning, None
        return targets

    def claim(self, conn: sa.Connection, batch: Batch) -> list[Delivery]:
        self._claimed = claim_places(conn, self.name, self.topic, batch.next_offsets)
        return [d for d in batch.deliveries if d.key > self._claimed[d.partition].key]

    @faults.seam("broker.commit")
    def commit(self, conn: sa.Connection, batch: Batch) -> None:
        if not batch.next_offsets:
            return
        claimed = self._claimed
        if not set(batch.next_offsets) <= set(claimed):
            claimed = claim_places(conn, self.name, self.topic, batch.next_offsets)
        last: dict[int, tuple[int, int]] = {}
        for d in batch.deliveries:
            last[d.partition] = max(last.get(d.partition, (0, 0)), d.key)
        places = {}
        for partition, end in batch.next_offsets.items():
            old = claimed[partition]
            epoch = batch.epochs.get(partition, 0)
            # Another member may have committed further meanwhile (a rebalance): never go back.
            offset = max(end, old.next_offset) if epoch == old.epoch else end
            txid, position = max(old.key, last.get(partition, (0, 0)))
            places[partition] = PartitionPlace(offset, epoch, txid, position)
        save_places(conn, self.name, self.topic, places)
        self._claimed = {}

    def _dead_letter(
        self, partition: int, offset: int, key: bytes | None, value: bytes | None, reason: str
    ) -> None:
        self.dead_letters += 1
        log.error(
            "%s: dead-lettered %s[%d]@%d: %s",
            self.name, self.topic, partition, offset, reason,
        )
        self._producer.produce(
            dead_letter_topic(self.topic),
            key=key,
            value=value,
            headers=[
                (REASON_HEADER, reason[:500].encode()),
                ("tollgate-source", f"{self.topic}/{partition}/{offset}"),
                ("tollgate-consumer", self.name.encode()),
            ],
        )


class KafkaEventConsumer(SavedOffsets):
    """A member of consumer group `name` on `topic` (see EventConsumer for the contract)."""

    def __init__(
        self,
        engine: sa.Engine,
        bootstrap: str,
        topic: str,
        name: str,
        *,
        settings: Mapping[str, Any] | None = None,
        kafka_settings: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(engine, bootstrap, topic, name, kafka_settings)
        self._consumer = self._ck.Consumer(
            client_settings(
                bootstrap,
                {
                    "group.id": name,
                    "enable.auto.commit": False,
                    "enable.auto.offset.store": False,
                    "auto.offset.reset": "earliest",
                    # A dead member's partitions move within seconds, not Kafka's default 45 s.
                    "session.timeout.ms": 6000,
                    "heartbeat.interval.ms": 1000,
                    # A worker started before the relay created the topic finds it within
                    # seconds (librdkafka's default re-reads metadata every 5 minutes).
                    "topic.metadata.refresh.interval.ms": 3000,
                    **(settings or {}),
                },
            )
        )
        self._consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke)

    # --- assignment -------------------------------------------------------------------------

    def _on_assign(self, consumer: Any, partitions: list[Any]) -> None:
        beginning = self._ck.OFFSET_BEGINNING
        try:
            targets = self._seek_targets([tp.partition for tp in partitions], beginning)
        except Exception:
            # PostgreSQL is down during the rebalance. Never from a guessed offset: from each
            # partition's start, which `claim` makes harmless (it drops every record at or
            # below the saved order key), and slower only. Raised from here, the client would
            # assign the partitions itself, from the same start, with `assigned` left empty.
            log.exception(
                "%s: the saved offsets could not be read; reading from the start", self.name
            )
            targets = {tp.partition: beginning for tp in partitions}
            for tp in partitions:
                self._epochs[tp.partition] = None
        for tp in partitions:
            tp.offset = targets[tp.partition]
        consumer.assign(partitions)
        self.assigned = {tp.partition for tp in partitions}
        log.info("%s assigned %s", self.name, sorted(self.assigned))

    def _on_revoke(self, consumer: Any, partitions: list[Any]) -> None:
        self.assigned -= {tp.partition for tp in partitions}

    # --- the port ---------------------------------------------------------------------------

    @faults.seam("broker.poll")
    def poll(self, max_records: int = 500, timeout_s: float = 0.5) -> Batch:
        # What has arrived, at once; only when nothing has, wait (up to timeout_s) for the first
        # record, then take what came with it. consume(n, timeout) alone waits for n records or
        # the whole timeout: a busy worker back from a batch sat out the timeout with its next
        # batch already there (bench/pipeline.py: a batch every 0.55 s, 0.2 s of it waiting).
        consume = self._consumer.consume
        messages = consume(max_records, 0)
        if not messages:
            messages = consume(1, timeout_s)
            if messages and max_records > 1:
                messages += consume(max_records - 1, 0)
        batch = Batch()
        dead = False
        restarted: set[int] = set()
        for message in messages:
            error = message.error()
            if error is not None:
                if error.code() != self._ck.KafkaError._PARTITION_EOF:
                    log.warning("%s: %s", self.name, error)
                continue
            partition, offset = message.partition(), message.offset()
            if partition in restarted:
                continue
            epoch = _epoch(message.headers())
            known = self._epochs.get(partition)
            if known is not None and epoch > known and offset > 0:
                # The relay re-published the topic (a broker loss) and this partition was read
                # on at an offset of the old epoch: read the new epoch from its start.
                log.warning("%s: partition %d re-published (epoch %d)", self.name, partition, epoch)
                self._consumer.seek(
                    self._ck.TopicPartition(self.topic, partition, self._ck.OFFSET_BEGINNING)
                )
                self._epochs[partition] = None
                restarted.add(partition)
                continue
            self._epochs[partition] = epoch
            batch.next_offsets[partition] = offset + 1
            batch.epochs[partition] = epoch
            try:
                record, txid = decode(message.value())
            except BadRecord as exc:
                self._dead_letter(
                    partition, offset, message.key(), message.value(), exc.reason
                )
                dead = True
                continue
            batch.deliveries.append(Delivery(record, partition, offset, txid))
        if dead:
            # The dead letters are on the broker before the checkpoint moves past them.
            self._producer.flush(30)
        return batch

    def lag(self) -> int | None:
        """Messages behind on this member's partitions, from the high watermarks its own fetches
        brought (no broker round trip); None while it does not know one of them yet."""
        assignment = self._consumer.assignment()
        if not assignment:
            return None
        total = 0
        try:
            for tp in self._consumer.position(assignment):
                found = self._consumer.get_watermark_offsets(tp, cached=True)
                if found is None or found[1] < 0 or tp.offset < 0:
                    return None
                total += max(0, found[1] - tp.offset)
        except self._ck.KafkaException:
            return None
        return total

    def rewind(self) -> None:
        assignment = self._consumer.assignment()
        targets = self._seek_targets(
            [tp.partition for tp in assignment], self._ck.OFFSET_BEGINNING
        )
        for tp in assignment:
            tp.offset = targets[tp.partition]
            self._consumer.seek(tp)

    def close(self) -> None:
        self._producer.flush(10)
        self._consumer.close()


def _epoch(headers: list[tuple[str, bytes]] | None) -> int:
    for name, value in headers or ():
        if name == EPOCH_HEADER:
            epoch = _EPOCHS.get(value)
            if epoch is None:
                try:
                    epoch = int(value)
                except (TypeError, ValueError):
                    epoch = 0
                if len(_EPOCHS) < 64:
                    _EPOCHS[value] = epoch
            return epoch
    return 0


# Every message of an epoch carries the same header value: parsed once, not per message.
_EPOCHS: dict[bytes, int] = {}

"""The outbox relay: publishes every committed event of the PostgreSQL store to the event topic,
keyed by tenant id (one tenant's events stay in one partition, in order), at least once.

Each step reads the next committed events in `(txid, position)` order below the snapshot's xmin
(`ledger.outbox`: a late commit is never skipped), produces them with the idempotent producer,
waits until the broker acknowledged all of them, and only then saves its place. A relay killed
at any moment re-publishes at most the step it was in; consumers drop the copies by their order
key. The idempotent producer is what makes that safe: it never leaves a gap inside a partition
(a lost message followed by a delivered one), which a consumer would otherwise step over.

A broker can lose what it held (the development broker keeps nothing across a restart). Before
publishing and every `check_every_s`, the relay compares each partition's high watermark with
what it had acknowledged there; a missing topic or a partition that ends earlier starts a new
epoch: the topic is created again and the whole store is published from the start, every
message carrying the epoch so consumers know their saved offsets are void. The mark compared is
the first offset acknowledged in the latest step that wrote to the partition (plus one), not
the last: the development broker answers a partition's high watermark with the base offset of
its last record batch plus one (measured: 1,250 messages in one batch, high watermark 1), which
a comparison with the last offset would read as a loss every time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.outbox import OutboxReader, RelayState
from tollgate_llm.streams.codec import EPOCH_HEADER, encode
from tollgate_llm.streams.gc_settings import settle_for_batches
from tollgate_llm.streams.topics import (
    DEFAULT_PARTITIONS,
    DEFAULT_TOPIC,
    client_settings,
    confluent,
    ensure_topic,
    partition_count,
    replace_topic,
)

log = logging.getLogger("tollgate.relay")


class RelayError(Exception):
    """A step's messages were not all acknowledged: nothing was checkpointed, retry."""


class TopicMismatch(RelayError):
    """The topic has another partition count than the relay publishes to. Consumers tell what
    they applied by each partition's order key, which holds only while every tenant stays on
    its partition; the relay refuses to publish rather than move tenants between partitions."""


class OutboxRelay:
    def __init__(
        self,
        engine: sa.Engine,
        bootstrap: str,
        topic: str = DEFAULT_TOPIC,
        *,
        partitions: int = DEFAULT_PARTITIONS,
        batch: int = 5000,
        settings: Mapping[str, Any] | None = None,
        kafka_settings: Mapping[str, str] | None = None,
        check_every_s: float = 1.0,
    ) -> None:
        self._ck = confluent()
        self.engine = engine
        self.bootstrap = bootstrap
        self.topic = topic
        self.partitions = partitions
        self.batch = batch
        self.check_every_s = check_every_s
        self._settings = dict(settings or {})
        self.kafka_settings = dict(kafka_settings or {})  # the cluster's own (TLS, SASL)
        self.reader = OutboxReader(engine)
        self.state = self.reader.load_state(topic)
        self._producer = self._new_producer()
        self._probe = self._ck.Consumer(
            client_settings(bootstrap, {"group.id": f"{topic}.relay-probe"},
                            kafka_settings=self.kafka_settings)  # fmt: skip
        )
        self._checked_at = 0.0
        self.epochs_started = 0

    def _new_producer(self) -> Any:
        return self._ck.Producer(
            client_settings(
                self.bootstrap,
                {
                    "enable.idempotence": True,
                    "acks": "all",
                    # Only check_topic creates the topic, with the relay's partition count
                    # (librdkafka's producer would otherwise have a missing topic created with
                    # the broker's count when it produces after a broker loss).
                    "allow.auto.create.topics": False,
                    "linger.ms": 5,
                    "batch.num.messages": 10_000,
                    "queue.buffering.max.messages": 500_000,
                    # A broker that is down fails a step within this, and the relay retries.
                    "message.timeout.ms": 15_000,
                    **self._settings,
                },
                kafka_settings=self.kafka_settings,
            )
        )

    # --- broker loss ----------------------------------------------------------------------

    def check_topic(self) -> bool:
        """Make sure the topic holds what this epoch published; start a new epoch (re-publish
        from the store) if it does not. True if a new epoch started."""
        self._checked_at = time.monotonic()
        lost, count = self._lost()
        if lost is None and self.state.published and count == self.partitions:
            return False
        created = ensure_topic(
            self.bootstrap, self.topic, self.partitions, kafka_settings=self.kafka_settings
        )
        if not created:  # it was there, or another client's creation came first
            count = partition_count(
                self.bootstrap, self.topic, kafka_settings=self.kafka_settings
            )
        if count is not None and count != self.partitions:
            if lost is None or not self.state.published:
                raise TopicMismatch(
                    f"topic {self.topic} has {count} partitions and the relay publishes to "
                    f"{self.partitions}: start the relay with --partitions {count} "
                    f"(TOLLGATE_KAFKA_PARTITIONS={count}), or delete the topic"
                )
            # Lost, and created again behind the relay's back (a client whose metadata request
            # may create topics) with the broker's count: what it holds is to be re-published
            # anyway.
            log.warning(
                "topic %s came back with %d partitions, not %d: creating it again",
                self.topic, count, self.partitions,
            )
            replace_topic(
                self.bootstrap, self.topic, self.partitions, kafka_settings=self.kafka_settings
            )
        if lost is None or (created and not self.state.published):
            if self.state.published == 0 and self.state.last_txid == 0:
                self.reader.save_state(self.state)  # the first epoch, on record for consumers
            return False
        log.warning(
            "topic %s lost what epoch %d published (%s): re-publishing from the store",
            self.topic, self.state.epoch, lost,
        )
        self.state = RelayState(self.topic, epoch=self.state.epoch + 1)
        self.reader.save_state(self.state)
        self.epochs_started += 1
        # A producer whose broker forgot it (its producer id, its sequences) is not reused.
        self._producer = self._new_producer()
        return True

    def _lost(self) -> tuple[str | None, int | None]:
        """Why the topic no longer holds this epoch's messages (None if it does), and its
        partition count (None if it is missing)."""
        try:
            metadata = self._probe.list_topics(self.topic, timeout=10)
        except self._ck.KafkaException as exc:
            raise RelayError(f"cannot reach the cluster: {exc}") from exc
        found = metadata.topics.get(self.topic)
        if found is None or found.error is not None or not found.partitions:
            return "the topic is missing", None
        count = len(found.partitions)
        for partition, end in self.state.partition_ends.items():
            if partition >= count:  # created again with fewer partitions
                return f"partition {partition} is missing", count
            tp = self._ck.TopicPartition(self.topic, partition)
            try:
                _low, high = self._probe.get_watermark_offsets(tp, timeout=10, cached=False)
            except self._ck.KafkaException as exc:
                raise RelayError(f"cannot read partition {partition}: {exc}") from exc
            if high < end:
                return (
                    f"partition {partition} ends at {high}, offset {end - 1} was acknowledged",
                    count,
                )
        return None, count

    # --- publishing -----------------------------------------------------------------------

    @faults.seam("broker.produce")
    def publish_once(self) -> int:
        """Publish the next committed events; returns how many (0: nothing new)."""
        if time.monotonic() - self._checked_at >= self.check_every_s:
            self.check_topic()
        rows = self.reader.read_committed(self.state.key, self.batch)
        if not rows:
            return 0
        acknowledged: dict[int, int] = {}
        failures: list[str] = []

        def delivered(err: Any, message: Any) -> None:
            if err is not None:
                failures.append(str(err))
                return
            partition = message.partition()
            first = acknowledged.get(partition)
            acknowledged[partition] = message.offset() + 1 if first is None else min(
                first, message.offset() + 1
            )

        headers = [(EPOCH_HEADER, str(self.state.epoch).encode())]
        produce = self._producer.produce
        for row in rows:
            key, value = encode(row)
            while True:
                try:
                    produce(self.topic, value, key, headers=headers, on_delivery=delivered)
                    break
                except BufferError:  # the local queue is full: let it drain
                    self._producer.poll(0.05)
        left = self._producer.flush(30)
        if left or failures:
            self._producer = self._new_producer()
            raise RelayError(
                f"{left} message(s) unacknowledged, {len(failures)} failed"
                + (f" ({failures[0]})" if failures else "")
            )
        last = rows[-1]
        self.state.last_txid, self.state.last_position = last.txid, last.position
        self.state.published += len(rows)
        self.state.partition_ends.update(acknowledged)
        self.reader.save_state(self.state)
        return len(rows)

    def lag(self) -> int:
        """Stored events not yet published (the relay lag, in events)."""
        return self.reader.backlog(self.state.key)

    def run(self, stop: threading.Event, *, idle_s: float = 0.02) -> None:
        """Publish until `stop`; a failed step is retried after a pause (the broker is down, or
        came back empty: the next check starts a new epoch)."""
        while not stop.is_set():
            try:
                if not self.publish_once():
                    stop.wait(idle_s)
            # The broker (produce() raises KafkaException too: a topic gone, a fatal producer
            # error; the fault matrix's broker.produce:before killed the relay here) or the
            # database.
            except (RelayError, self._ck.KafkaException, sa.exc.DBAPIError) as exc:
                log.warning("relay step failed: %s; retrying", exc)
                self._checked_at = 0.0
                stop.wait(0.5)

    def close(self) -> None:
        self._producer.flush(10)
        self._probe.close()


def run_relay(
    database_url: str, bootstrap: str, topic: str = DEFAULT_TOPIC,
    partitions: int = DEFAULT_PARTITIONS, *, metrics_port: int = 0,
    metrics_host: str = "127.0.0.1", kafka_settings: Mapping[str, str] | None = None,
) -> None:
    """`tollgate relay`: publish until SIGTERM/SIGINT (its /metrics on `metrics_port`, 0: off)."""
    import signal

    from tollgate_llm.ledger.engine import create_engine_from_url
    from tollgate_llm.streams.metrics import PipelineMetrics, serve_metrics

    engine = create_engine_from_url(database_url)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    relay = OutboxRelay(
        engine, bootstrap, topic, partitions=partitions, kafka_settings=kafka_settings
    )
    metrics = PipelineMetrics(billing=False)
    metrics.add_relay(topic, relay.lag, lambda: relay.state.last_position)
    serve_metrics(metrics_port, metrics.registry, metrics_host)
    try:
        while True:  # a broker or a database that is away at start is waited for
            try:
                relay.check_topic()
                break
            except TopicMismatch:
                raise  # not the broker's weather: the operator's to settle
            except (RelayError, sa.exc.DBAPIError) as exc:
                log.warning("relay start failed: %s; retrying", exc)
                if stop.wait(1.0):
                    return
        log.info(
            "relay publishing %s to %s (epoch %d, %d published)",
            topic, bootstrap, relay.state.epoch, relay.state.published,
        )
        settle_for_batches()
        relay.run(stop)
    finally:
        relay.close()
        engine.dispose()

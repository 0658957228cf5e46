"""`FaustEventConsumer`: the consumer port over the event topic read by a faust-streaming app, so
that `KafkaFoldWorker` runs its same batches (the same folds, the same PostgreSQL transaction
with the offsets) on faust (`tollgate worker --kafka-client faust`).

The app runs on an asyncio loop of its own thread: its agent takes up to `max_records` events
(or what came within `within_s`) and hands them to the worker's thread, where the synchronous
folds and the transaction run, so a batch never blocks the loop that sends faust's heartbeats.

Faust's own offsets never decide what is applied. The app commits nothing to Kafka (`commit` is
a no-op), and where faust would seek its partitions to their committed offsets after every
rebalance (`seek_to_committed`), it seeks them to the offsets saved in PostgreSQL instead. A
seek does not empty faust's queues, so after one a partition's messages are taken only from the
one at the offset sought: what was queued before the seek is dropped, whatever its offset
(taking a message queued beyond the seek target would move the saved order key past records
never applied). `claim` still drops every record at or below the saved key, as on confluent.
Two more guards keep that key from passing a record never applied: a message of another epoch
than the partition's reads the partition again from its start (or from that message, the new
epoch's first), and offsets that did not come in order are read again before any after them.
Every seek holds one lock with the expectation it sets, so a rebalance's placement and the
agent's own seek never leave the partition at one offset and the agent waiting for another.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from tollgate_llm.streams.codec import BadRecord, decode
from tollgate_llm.streams.consumer import Batch, Delivery
from tollgate_llm.streams.kafka_consumer import SavedOffsets, _epoch
from tollgate_llm.streams.topics import KafkaSettingError, client_settings

log = logging.getLogger("tollgate.faust_worker")

# `_resume`'s mark for a partition being placed: no offset matches it.
_PLACING = -1
# A partition that waited this long for the offset it was sought to is sought there again.
RESEEK_S = 5.0


@dataclass(frozen=True, slots=True)
class _Message:
    partition: int
    offset: int
    epoch: int
    key: bytes | None
    value: bytes | None


class FaustEventConsumer(SavedOffsets):
    """A member of consumer group `name` on `topic` through faust-streaming (see EventConsumer
    for the contract)."""

    def __init__(
        self,
        engine: sa.Engine,
        bootstrap: str,
        topic: str,
        name: str,
        *,
        max_records: int = 5000,
        within_s: float = 0.2,
        kafka_settings: Mapping[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(engine, bootstrap, topic, name, kafka_settings)
        self._bootstrap = bootstrap
        # Refused here, before any thread, when a setting cannot be taken.
        self._credentials = faust_credentials(
            client_settings(bootstrap, kafka_settings=self.kafka_settings)
        )
        self._max_records = max_records
        self._within_s = within_s
        # Two batches ahead of the worker at most: faust pauses fetching behind them.
        self._handoff: queue.Queue[list[_Message]] = queue.Queue(maxsize=2)
        self._pending: list[_Message] = []  # taken from the hand-off, not yet polled
        # Batches polled since the checkpoint, in order: `rewind` hands them out again (faust
        # cannot seek back without the queue problem above). Those passed to `commit` are
        # forgotten at the next poll: the worker polls again only once their transaction
        # committed, and after a failure it rewinds first.
        self._uncommitted: list[Batch] = []
        self._committing: list[Batch] = []
        self._replay: deque[Batch] = deque()
        # Loop thread only: per partition, the offset a seek went to, until its message comes;
        # then the next offset expected.
        self._resume: dict[int, int] = {}
        self._expected: dict[int, int] = {}
        self._datadir = tempfile.mkdtemp(prefix="tollgate-faust-")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._app: Any = None
        self._coordinator: Any = None  # aiokafka's group coordinator, once the app started
        self._started = threading.Event()
        self._failure: BaseException | None = None
        # Set while an assignment's saved offsets cannot be read (`_seek_saved`).
        self._seek_failure: BaseException | None = None
        # Held by every seek with the expectation it sets (`_seek_saved`, `_read_from`):
        # a rebalance's seek that ran while the agent sought a partition to a new epoch's start
        # left the partition at one offset and the agent waiting for another, for good.
        self._placing = asyncio.Lock()
        # Per partition with a seek pending (`_resume`), when it was sought (monotonic s).
        self._sought_at: dict[int, float] = {}
        self.seeks_again = 0
        self._thread = threading.Thread(target=self._run_app, name=f"faust-{name}", daemon=True)
        self._thread.start()
        # The app's start returns once the group assigned it partitions; a refusal ends the wait.
        # Past `start_timeout_s` the wait ends too, and only an app never built is a failure
        # (one that is still joining its group is left to join it, and `poll` waits meanwhile).
        # On a machine starved of CPU, building the app alone took more than a minute.
        deadline = time.monotonic() + start_timeout_s
        while not self._started.wait(0.1) and self._refusal() is None:
            if time.monotonic() > deadline:
                break
        if self._failure is not None or self._app is None:
            raise RuntimeError(f"the faust app did not start: {self._failure!r}")

    # --- the app, on its own thread ---------------------------------------------------------

    def _run_app(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            self._app = _build_app(self)
            loop.run_until_complete(self._app.start())
        except BaseException as exc:
            self._failure = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        watch = loop.create_task(self._watch_seeks())
        try:
            loop.run_forever()
        finally:
            watch.cancel()
            loop.run_until_complete(asyncio.gather(watch, return_exceptions=True))
            loop.close()

    async def _agent(self, stream: Any) -> None:
        async for events in stream.take_events(self._max_records, within=self._within_s):
            messages = await self._take(events)
            while messages:
                try:
                    self._handoff.put_nowait(messages)
                    messages = []
                except queue.Full:
                    await asyncio.sleep(0.01)

    async def _take(self, events: Sequence[Any]) -> list[_Message]:
        taken = []
        for event in events:
            message = event.message
            if message.topic != self.topic:
                continue
            p, offset = message.partition, message.offset
            resume = self._resume.get(p)
            if resume == _PLACING:
                continue  # a rebalance is placing the partition
            headers = message.headers
            epoch = _epoch(list(headers.items()) if isinstance(headers, Mapping) else headers)
            known = self._epochs.get(p)
            if known is not None and epoch != known:
                # The relay re-published the topic (a broker loss), or a message queued before
                # a seek: whatever the offsets sought or expected were, they were another
                # epoch's. From the new epoch's first message on, or from the partition's start.
                if offset > 0:
                    log.warning(
                        "%s: partition %d at epoch %d after %d: reading it from its start",
                        self.name, p, epoch, known,
                    )
                    await self._read_from_start(p)
                    continue
                self._resume.pop(p, None)
                self._sought_at.pop(p, None)
            elif resume is not None:
                if offset != resume:
                    continue  # queued before the seek, or the sought one is still to come
                del self._resume[p]
                self._sought_at.pop(p, None)
            elif offset < self._expected.get(p, 0):
                continue  # taken already (read again after a rebalance)
            elif offset > self._expected.get(p, offset):
                # Offsets the partition holds never came (the relay's idempotent producer
                # leaves none out, so they were lost between the client and the agent): taking
                # this one would move the saved order key past them, and `claim` would drop
                # them for good. They are read again; were they truly missing on the broker,
                # the partition would wait there, its lag growing, rather than skip them.
                log.error(
                    "%s: partition %d went from offset %d to %d: reading the gap again",
                    self.name, p, self._expected[p], offset,
                )
                await self._read_from(p, self._expected[p])
                continue
            self._epochs[p] = epoch
            self._expected[p] = offset + 1
            taken.append(_Message(p, offset, epoch, message.key, message.value))
        return taken

    async def _watch_seeks(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.seek_again(time.monotonic())

    async def seek_again(self, now: float) -> None:
        """Every partition that has waited `RESEEK_S` for the offset it was sought to is sought
        there again. faust drops every message below a partition's read offset, which its
        fetch loop sets after each message it hands on: one handed on while a seek ran put the
        read offset back past the offset sought, and the partition's messages from there on
        were dropped before the agent saw them (measured: a partition's every message, at
        start-up, for good). A seek again is harmless where the offset is merely not there
        yet."""
        for p, at in list(self._sought_at.items()):
            resume = self._resume.get(p)
            if resume is None or p not in self.assigned:
                self._sought_at.pop(p, None)
            elif resume != _PLACING and now - at >= RESEEK_S:
                # Debug only: a partition idle at its end waits the same way, every RESEEK_S.
                log.debug("%s: partition %d waits for offset %d: seek again", self.name, p, resume)
                self.seeks_again += 1
                await self._read_from(p, resume)

    async def _read_from_start(self, p: int) -> None:
        await self._read_from(p, 0, new_epoch=True)

    async def _read_from(self, p: int, offset: int, *, new_epoch: bool = False) -> None:
        """Partition `p` read again from `offset`, the expectation set with the seek. A
        rebalance may have placed the partition while this waited for the lock: then the seek
        still goes to `offset` (at worst slower: `claim` drops what was applied), unless the
        partition is no longer this member's."""
        async with self._placing:
            if p not in self.assigned:
                return
            # seek_wait, not seek: faust's `Consumer.seek` calls the aiokafka consumer from this
            # thread while its own thread fetches, and the fetcher crashed on the records a
            # seek deleted under it (KeyError in `fetched_records`): no message came again.
            await self._app.consumer.seek_wait({_tp(self.topic, p): offset})
            self._resume[p] = offset
            self._sought_at[p] = time.monotonic()
            if new_epoch:
                self._epochs[p] = None

    async def _seek_saved(self, consumer: Any) -> dict[Any, int]:
        async with self._placing:
            return await self._place_saved(consumer)

    async def _place_saved(self, consumer: Any) -> dict[Any, int]:
        """Every assigned partition of the topic to its offset saved in PostgreSQL.

        While PostgreSQL is down the saved offsets cannot be read, and raised from here the
        failure ended faust's rebalance for good: the worker folded nothing, reporting
        nothing. So the read is tried again (0.1 s, doubling to 2 s) until it succeeds;
        meanwhile no message of these partitions is taken (`_resume` at -1 matches no offset)
        and `poll` raises, so the worker reports why it folds nothing."""
        mine = {tp for tp in consumer.assignment() if tp.topic == self.topic}
        partitions = sorted(tp.partition for tp in mine)
        for p in partitions:
            self._resume[p] = _PLACING
        wait_s = 0.1
        while True:
            try:
                targets = await asyncio.to_thread(self._seek_targets, partitions, 0)
                break
            except Exception as exc:
                if self._seek_failure is None:
                    log.exception("%s: the saved offsets could not be read; retrying", self.name)
                self._seek_failure = exc
                await asyncio.sleep(wait_s)
                wait_s = min(2.0, wait_s * 2)
        self._seek_failure = None
        placed = {tp: targets[tp.partition] for tp in mine}
        if placed:
            await consumer.seek_wait(placed)
        self._resume = {tp.partition: offset for tp, offset in placed.items()}
        self._sought_at = dict.fromkeys(self._resume, time.monotonic())
        self.assigned = set(self._resume)
        log.info("%s assigned %s", self.name, sorted(self.assigned))
        return placed

    def _refusal(self) -> BaseException | None:
        """The group's refusal of this member for good (another client's group protocol, a
        session timeout the broker does not allow). aiokafka keeps it for a fetch that faust
        never makes: unasked, the worker would wait, silent, for an assignment never coming."""
        return getattr(self._coordinator, "_pending_exception", None)

    # --- the port ---------------------------------------------------------------------------

    def poll(self, max_records: int = 500, timeout_s: float = 0.5) -> Batch:
        refused = self._refusal()
        if refused is not None:
            raise RuntimeError(f"{self.name}: the consumer group refused this member: {refused!r}")
        fetcher = getattr(self._app, "_fetcher", None)
        if fetcher is not None and fetcher.crashed:
            # faust does not start a crashed fetcher again: nothing would come, silently.
            raise RuntimeError(
                f"{self.name}: the faust fetcher crashed ({fetcher.crash_reason!r}); restart "
                "the worker"
            )
        failing = self._seek_failure
        if failing is not None:
            raise RuntimeError(
                f"{self.name}: the saved offsets of its partitions cannot be read: {failing!r}"
            )
        if self._committing:
            self._uncommitted = [
                b for b in self._uncommitted if not any(b is c for c in self._committing)
            ]
            self._committing.clear()
        if self._replay:
            return self._replay.popleft()
        if not self._pending:
            try:
                self._pending = self._handoff.get(timeout=timeout_s)
            except queue.Empty:
                return Batch()
        # And what the agent handed over meanwhile (a busy worker finds several takes waiting):
        # one batch of them, not a batch per take.
        while len(self._pending) < max_records:
            try:
                self._pending += self._handoff.get_nowait()
            except queue.Empty:
                break
        messages, self._pending = self._pending[:max_records], self._pending[max_records:]
        batch = self._batch(messages)
        self._uncommitted.append(batch)
        return batch

    def _batch(self, messages: list[_Message]) -> Batch:
        batch = Batch()
        dead = False
        for m in messages:
            batch.next_offsets[m.partition] = m.offset + 1
            batch.epochs[m.partition] = m.epoch
            try:
                record, txid = decode(m.value)
            except BadRecord as exc:
                self._dead_letter(m.partition, m.offset, m.key, m.value, exc.reason)
                dead = True
                continue
            batch.deliveries.append(Delivery(record, m.partition, m.offset, txid))
        if dead:
            self._producer.flush(30)  # on the broker before the checkpoint moves past them
        return batch

    def commit(self, conn: sa.Connection, batch: Batch) -> None:
        super().commit(conn, batch)
        self._committing.append(batch)

    def rewind(self) -> None:
        self._replay = deque(self._uncommitted)
        self._committing.clear()

    def close(self) -> None:
        loop, app = self._loop, self._app
        if loop is not None and app is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(app.stop(), loop).result(30)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                self._thread.join(30)
        self._producer.flush(10)
        shutil.rmtree(self._datadir, ignore_errors=True)


def _tp(topic: str, partition: int) -> Any:
    from faust.types import TP

    return TP(topic, partition)


async def _leave_group(coordinator: Any) -> None:
    """The group coordinator's leave on close, in any generation. aiokafka leaves only above
    generation 0, as Kafka numbers a group's generations from 1; the development broker numbers
    them from 0, so a member closed in a group's first generation stayed in it until its session
    expired, and the next member's join waited behind it (~11 s measured, against ~3 s)."""
    from aiokafka.errors import KafkaError  # type: ignore[import-untyped]
    from aiokafka.protocol.group import LeaveGroupRequest  # type: ignore[import-untyped]

    if coordinator.generation >= 0 and coordinator._group_instance_id is None:
        try:
            await coordinator._send_req(
                LeaveGroupRequest(coordinator.group_id, coordinator.member_id)
            )
        except KafkaError as exc:  # best effort, as aiokafka's: the session then expires it
            log.warning("%s: leaving the group failed: %r", coordinator.group_id, exc)
    coordinator.reset_generation()


def _never_create_topics() -> None:
    """aiokafka's metadata requests, with topic auto-creation off. aiokafka asks the broker to
    create every topic it asks about that does not exist (the request's default, which faust's
    `topic_allow_declare` does not reach), so a worker started before the relay, or running
    through a broker loss, created the event topic with the broker's own partition count (4 on
    the development broker, 1 on Kafka's defaults) instead of the relay's. A tenant's events
    then moved to another partition when the relay re-created the topic with its own count, and
    the partition's saved order key no longer told what had been applied: events were applied
    twice. Only the relay creates the event topic. Set once per process, for every aiokafka
    client in it (a faust worker's process has no other)."""
    import aiokafka.client
    from aiokafka.protocol.metadata import MetadataRequest  # type: ignore[import-untyped]

    if getattr(aiokafka.client.MetadataRequest, "_tollgate_no_create", False):
        return

    class NoAutoCreate(MetadataRequest):  # type: ignore[misc]
        _tollgate_no_create = True

        def __init__(
            self, topics: list[str] | None = None, allow_auto_topic_creation: bool = False
        ) -> None:
            super().__init__(topics, allow_auto_topic_creation)

    aiokafka.client.MetadataRequest = NoAutoCreate


# librdkafka's names (TOLLGATE_KAFKA_<SETTING>, streams/topics.py) that faust's client takes.
_SECURITY_SETTINGS = {
    "security.protocol", "sasl.mechanism", "sasl.mechanisms", "sasl.username", "sasl.password",
    "ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.key.password",
}


def faust_credentials(settings: Mapping[str, Any]) -> Any:
    """faust's broker credentials from the librdkafka settings the confluent clients take (a
    production cluster's TLS/SASL, `TOLLGATE_KAFKA_SECURITY_PROTOCOL=SASL_SSL` and the rest),
    or None for a plaintext cluster. A security setting faust's client cannot take is refused
    by name (connecting without what was asked for is not an option); other librdkafka tuning
    (`linger.ms`, ...) does not apply to it and is left to the confluent clients."""
    import ssl

    import faust

    unknown = sorted(
        k for k in settings
        if k.startswith(("security.", "sasl.", "ssl.")) and k not in _SECURITY_SETTINGS
    )
    if unknown:
        raise KafkaSettingError(
            f"the faust worker cannot take the Kafka setting(s) {', '.join(unknown)}: use "
            "the confluent client (--kafka-client confluent)"
        )
    protocol = str(settings.get("security.protocol", "plaintext")).upper()
    if protocol not in ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"):
        raise KafkaSettingError(
            f"security.protocol {protocol!r}: one of plaintext, ssl, sasl_plaintext, sasl_ssl"
        )
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=settings.get("ssl.ca.location"))
        if "ssl.certificate.location" in settings:
            context.load_cert_chain(
                settings["ssl.certificate.location"], settings.get("ssl.key.location"),
                settings.get("ssl.key.password"),
            )
    if protocol.startswith("SASL"):
        mechanism = str(
            settings.get("sasl.mechanism", settings.get("sasl.mechanisms", "PLAIN"))
        ).upper()
        if mechanism not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
            raise KafkaSettingError(
                f"sasl.mechanism {mechanism!r}: one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 on "
                "the faust worker"
            )
        return faust.SASLCredentials(
            username=settings.get("sasl.username"), password=settings.get("sasl.password"),
            ssl_context=context, mechanism=mechanism,
        )
    return faust.SSLCredentials(context) if context is not None else None


def _build_app(owner: FaustEventConsumer) -> Any:
    """The faust app of one worker: one agent on the event topic, no web server, no tables, no
    topic it may create (the relay creates the event topic with its partitions)."""
    import faust
    from faust.transport.drivers import aiokafka as driver

    _never_create_topics()

    class ConsumerThread(driver.AIOKafkaConsumerThread):
        async def on_start(self) -> None:
            await super().on_start()
            coordinator: Any = self._ensure_consumer()._coordinator
            coordinator._maybe_leave_group = functools.partial(_leave_group, coordinator)
            owner._coordinator = coordinator

        def verify_event_path(self, now: float, tp: Any) -> None:
            # Only the fetch path's checks: faust's others report a partition whose offset
            # is never committed to Kafka, which is every partition here, as stuck.
            self._verify_aiokafka_event_path(now, tp)

    class Consumer(driver.Consumer):  # type: ignore[misc]
        def _new_consumer_thread(self) -> Any:
            return ConsumerThread(self, loop=self.loop, beacon=self.beacon)

        async def commit(self, *args: Any, **kwargs: Any) -> bool:
            return False  # the offsets live in PostgreSQL only

        async def seek_to_committed(self) -> Mapping[Any, int]:
            return await owner._seek_saved(self)

    class Transport(driver.Transport):  # type: ignore[misc]
        pass

    Transport.Consumer = Consumer

    class App(faust.App):  # type: ignore[misc]
        def _new_transport(self) -> Any:
            return Transport(self.conf.broker_consumer, self)

    app = App(
        owner.name,
        broker=";".join(f"kafka://{host}" for host in owner._bootstrap.split(",")),
        broker_credentials=owner._credentials,
        autodiscover=False,
        web_enabled=False,
        store="memory://",
        datadir=owner._datadir,
        topic_allow_declare=False,
        topic_disable_leader=True,
        # Only where no seek placed a partition (every assignment seeks it to its saved
        # offset): from the start, which `claim` makes harmless, never from the end, which
        # would skip records.
        consumer_auto_offset_reset="earliest",
        # A dead member's partitions move 6 s after its last heartbeat, not faust's 60 s.
        broker_session_timeout=6.0,
        broker_heartbeat_interval=1.0,
        # How long a group's rebalance waits for its members to join again (Kafka's
        # coordinator; the development broker does not use it). A member here rejoins at
        # once, it waits for no batch (below): 10 s, not faust's 60 s, so a member that hangs
        # holds the group back 10 s at most.
        broker_rebalance_timeout=10.0,
        # A worker started before the relay created the topic (it never creates it) finds it
        # within seconds: aiokafka's default re-reads metadata every 5 minutes.
        consumer_metadata_max_age_ms=3000,
        # A rebalance does not wait for the worker to finish what it was handed: whatever it
        # does not commit is read again by the partition's next owner.
        stream_wait_empty=False,
    )
    topic = app.topic(owner.topic, key_type=bytes, value_type=bytes, key_serializer="raw",
                      value_serializer="raw")
    app.agent(topic, name="folds")(owner._agent)
    return app

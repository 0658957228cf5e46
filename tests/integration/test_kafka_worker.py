"""`tollgate worker` on Kafka: two worker processes in one consumer group, fed by the relay from
real PostgreSQL through the real Kafka-protocol broker, each SIGKILLed once at a named crash
point (bills committed, offsets not; rows and offsets written, not committed) and started again:
every request billed exactly once with the engine's counts, the read models equal to a rebuild
from the store."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests import builders as b
from tests.kafka_helpers import publish_all
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.projections import PROJECTIONS, USAGE_HOURLY
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    CancelRequest,
    Command,
    CompleteRequest,
    FailRequest,
    RouteRequest,
)
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.schema import consumer_offsets, events, ledger_entries, request_log
from tollgate_llm.ledger.store import AppendBatch, NewEvent, SqlEventStore
from tollgate_llm.streams.relay import OutboxRelay

pytestmark = [pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-8b-2026-05"
PARTITIONS = 4
ASSIGNED = re.compile(r"assigned \[([0-9, ]*)\]")


@pytest.fixture
def engine(postgres_engine: sa.Engine) -> sa.Engine:
    return postgres_engine  # the relay tails the outbox by xid8: PostgreSQL only


def _price(store: SqlEventStore) -> None:
    at = datetime.now(UTC) - timedelta(days=1)
    new = NewEvent(
        str(uuid.uuid4()), f"prices-{MODEL}", "", at, PriceSet(MODEL, 150_000, 600_000, 75_000, at)
    )
    store.append(new.stream_id, 0, [new])


def _requests(
    store: SqlEventStore, count: int, rng: random.Random
) -> dict[str, tuple[int, int, int]]:
    """`count` requests of six tenants, each ending completed, cancelled or failed; their
    engine counts (prompt, completion, cached) by request id."""
    truth: dict[str, tuple[int, int, int]] = {}
    batches = []
    for _ in range(count):
        rid, tenant = "req_" + uuid.uuid4().hex, f"tenant-{rng.randrange(6)}"
        prompt, completion = rng.randrange(10, 2000), rng.randrange(0, 500)
        cached = rng.randrange(0, prompt)
        end: Command = rng.choice(
            [
                CompleteRequest(prompt, completion, cached, "stop", 30, 20_000, request_id=rid),
                CancelRequest(prompt, completion, cached, request_id=rid),
                FailRequest(prompt, completion, cached, "replica answered 500", request_id=rid),
            ]
        )
        at = datetime.now(UTC)
        decided = b.decided(
            AdmitRequest(
                rid,
                tenant,
                "key-1",
                MODEL,
                "standard",
                "edge-1",
                Estimate(prompt, 500, 1_000, 40_000),
            ),
            RouteRequest("replica-1", 0, request_id=rid),
            end,
            at=at,
        )
        batches.append(
            AppendBatch(rid, 0, [NewEvent(str(uuid.uuid4()), rid, tenant, at, e) for e in decided])
        )
        truth[rid] = (prompt, completion, cached)
    for start in range(0, len(batches), 50):
        for result in store.append_many(batches[start : start + 50]):
            result.unwrap()
    return truth


def _worker(
    postgres_url: str, bootstrap: str, topic: str, log: Path, fault: str = "",
    client: str = "confluent",
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOLLGATE_FAULT_POINTS": fault}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tollgate_llm.cli",
            "worker",
            "--database-url",
            postgres_url,
            "--kafka-bootstrap",
            bootstrap,
            "--topic",
            topic,
            "--kafka-client",
            client,
        ],
        cwd=ROOT,
        env=env,
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,  # noqa: SIM115
    )


def _ledger_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(ledger_entries)).scalar())


class _Relaying:
    """The relay publishing the store on a thread of its own, until `stop`."""

    def __init__(self, engine: sa.Engine, bootstrap: str, topic: str) -> None:
        self.relay = OutboxRelay(engine, bootstrap, topic, partitions=PARTITIONS)
        self.relay.check_topic()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.relay.run, args=(self.stopping,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.relay.close()


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.terminate()
    for worker in workers:
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()


def _ledger_and_bills(
    conn: sa.Connection,
) -> tuple[dict[str, tuple[int, int, int]], dict[str, int]]:
    """Each request's ledger counts (prompt, completion, cached), and its UsageBilled events."""
    ledger = {
        r.request_id: (r.prompt_tokens, r.completion_tokens, r.cached_tokens)
        for r in conn.execute(sa.select(ledger_entries))
    }
    bills = dict(
        conn.execute(
            sa.select(events.c.stream_id, sa.func.count())
            .where(events.c.type == "UsageBilled")
            .group_by(events.c.stream_id)
        ).all()
    )
    return ledger, bills


def _assert_billed_once(
    engine: sa.Engine, store: SqlEventStore, truth: dict[str, tuple[int, int, int]]
) -> None:
    """One ledger row per request with the engine's counts, one bill each, and the read models
    folded from the topic equal to a rebuild from the store."""
    with engine.connect() as conn:
        ledger, bills = _ledger_and_bills(conn)
    assert ledger == truth  # exactly the requests, each with the engine's counts
    assert set(bills) == set(truth) and set(bills.values()) == {1}
    for spec in PROJECTIONS:
        runner = ProjectionRunner(engine, store, spec)
        from_topic = runner.table_digest()
        runner.rebuild()
        assert runner.table_digest() == from_topic, spec.name


@pytest.mark.parametrize("client", ["confluent", "faust"])
def test_two_workers_killed_mid_batch_bill_every_request_once(
    engine: sa.Engine, postgres_url: str, kafka_broker, kafka_topic: str, tmp_path: Path,
    client: str,
) -> None:
    """On either Kafka client (the same batches: streams/faust_worker.py)."""
    rng = random.Random(12)
    store = SqlEventStore(engine)
    _price(store)
    relay = _Relaying(engine, kafka_broker.bootstrap, kafka_topic)
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log"]
    boot, topic = kafka_broker.bootstrap, kafka_topic
    workers = [
        _worker(postgres_url, boot, topic, logs[0], "kafka.after_bills@2", client),
        _worker(postgres_url, boot, topic, logs[1], "kafka.before_commit@3", client),
    ]
    killed = [False, False]
    truth: dict[str, tuple[int, int, int]] = {}
    try:
        # Requests keep arriving while workers die and come back: at least 8 rounds, and until
        # both were killed (a ledger row no longer waits for its bill's trip through the relay,
        # so the ledger can be complete before a worker's armed batch comes).
        rounds = 0
        while rounds < 8 or (not all(killed) and rounds < 60):
            rounds += 1
            truth.update(_requests(store, 150, rng))
            time.sleep(0.5)
            for i, worker in enumerate(workers):
                if worker.poll() is not None:
                    assert worker.returncode == -9, logs[i].read_text()[-2000:]
                    killed[i] = True
                    workers[i] = _worker(postgres_url, boot, topic, logs[i], client=client)
        deadline = time.monotonic() + 180
        while _ledger_count(engine) < len(truth) and time.monotonic() < deadline:
            for i, worker in enumerate(workers):
                if worker.poll() is not None:
                    assert worker.returncode == -9, logs[i].read_text()[-2000:]
                    killed[i] = True
                    workers[i] = _worker(postgres_url, boot, topic, logs[i], client=client)
            time.sleep(0.5)
        time.sleep(2)  # late redeliveries must change nothing
    finally:
        relay.stop()
        _stop(workers)
    assert killed == [True, True]
    with engine.connect() as conn:
        statuses = dict(
            conn.execute(sa.select(request_log.c.request_id, request_log.c.status)).all()
        )
        partitions = set(conn.execute(sa.select(consumer_offsets.c.partition)).scalars())
    _assert_billed_once(engine, store, truth)
    assert {statuses[r] for r in truth} <= {"completed", "cancelled", "failed"}
    assert partitions == set(range(PARTITIONS))
    both = [log.read_text() for log in logs]
    assert all("assigned" in text for text in both)


def _assignment(log: Path) -> set[int] | None:
    """The partitions the worker's last rebalance gave it (None: none yet)."""
    found = ASSIGNED.findall(log.read_text()) if log.exists() else []
    return {int(p) for p in found[-1].split(",") if p.strip()} if found else None


def test_two_faust_workers_split_the_partitions_and_one_takes_over_when_the_other_is_killed(
    engine: sa.Engine, postgres_url: str, kafka_broker, kafka_topic: str, tmp_path: Path
) -> None:
    """Two faust-streaming workers in one group split the partitions; one is SIGKILLed while
    requests arrive and the other takes over every partition from the offsets saved in
    PostgreSQL: nothing lost, nothing doubled."""
    rng = random.Random(31)
    store = SqlEventStore(engine)
    _price(store)
    relay = _Relaying(engine, kafka_broker.bootstrap, kafka_topic)
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log"]
    boot, topic = kafka_broker.bootstrap, kafka_topic
    workers = [_worker(postgres_url, boot, topic, log, client="faust") for log in logs]
    truth: dict[str, tuple[int, int, int]] = {}
    try:
        # Requests flow until the group has split the partitions between the two.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            truth.update(_requests(store, 100, rng))
            time.sleep(0.5)
            a, b = _assignment(logs[0]), _assignment(logs[1])
            if a and b and not a & b and a | b == set(range(PARTITIONS)):
                break
        split = (_assignment(logs[0]), _assignment(logs[1]))
        assert split[0] and split[1] and not split[0] & split[1], split
        # Both fold for a while, then one dies while requests keep arriving.
        for _ in range(5):
            truth.update(_requests(store, 100, rng))
            time.sleep(0.5)
        workers[0].kill()
        assert workers[0].wait(10) == -9
        for _ in range(6):
            truth.update(_requests(store, 100, rng))
            time.sleep(0.5)
        deadline = time.monotonic() + 120
        while _ledger_count(engine) < len(truth) and time.monotonic() < deadline:
            assert workers[1].poll() is None, logs[1].read_text()[-2000:]
            time.sleep(0.3)
        time.sleep(2)  # late redeliveries must change nothing
        taken_over = _assignment(logs[1])
    finally:
        relay.stop()
        _stop(workers)
    assert taken_over == set(range(PARTITIONS))
    _assert_billed_once(engine, store, truth)


def test_a_ledger_row_commits_with_its_terminal_event_not_after_the_bills_trip(
    engine: sa.Engine, kafka_broker, kafka_topic: str
) -> None:
    """The worker posts a bill's ledger row (and its usage_hourly share) in the transaction that
    claims the terminal event, before the relay has published the bill; the bill coming back
    through the topic then changes nothing."""
    from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker
    from tollgate_llm.streams.topics import group_for

    store = SqlEventStore(engine)
    _price(store)
    truth = _requests(store, 60, random.Random(7))
    relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=PARTITIONS)
    relay.check_topic()
    lifecycle_events = publish_all(relay, engine)
    group = group_for(kafka_topic)
    consumer = KafkaEventConsumer(engine, kafka_broker.bootstrap, kafka_topic, group)
    worker = KafkaFoldWorker(engine, consumer)
    usage = ProjectionRunner(engine, store, USAGE_HOURLY)
    try:
        deadline = time.monotonic() + 60
        while worker.folded < lifecycle_events and time.monotonic() < deadline:
            worker.run_batch(5000, 0.5)
        assert worker.bills == len(truth)
        assert relay.lag() == len(truth)  # every bill is in the store, none on the topic yet
        with engine.connect() as conn:
            posted = {
                r.request_id: (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.recorded_at)
                for r in conn.execute(sa.select(ledger_entries))
            }
        assert {rid: row[:3] for rid, row in posted.items()} == truth
        before = usage.table_digest()
        while relay.publish_once():
            pass
        deadline = time.monotonic() + 60
        while worker.folded < lifecycle_events + len(truth) and time.monotonic() < deadline:
            worker.run_batch(5000, 0.5)
        assert worker.folded == lifecycle_events + len(truth)  # the bills came back, claimed
        with engine.connect() as conn:
            again = {
                r.request_id: (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.recorded_at)
                for r in conn.execute(sa.select(ledger_entries))
            }
        assert again == posted  # not written again
        assert usage.table_digest() == before  # not added twice
        usage.rebuild()
        assert usage.table_digest() == before  # = every bill in the store, once
    finally:
        consumer.close()
        relay.close()


def test_kafka_workers_killed_again_and_again_at_named_points_lose_and_double_nothing(
    engine: sa.Engine, postgres_url: str, kafka_broker, kafka_topic: str, tmp_path: Path
) -> None:
    """The issue's consumer-kill row on Kafka: two workers in one group, each restarted with its
    next crash point armed (bills appended, offsets not: `kafka.after_bills`; read models and
    offsets written, not committed: `kafka.before_commit`; the n-th batch, n in 1..3) until
    `kills` SIGKILLs (6 in the fast tier: each costs the group a rebalance), while requests
    keep arriving (at least 3,400: about 20,000 events); then clean workers to the end."""
    from tests.faults.tier import pick

    rng = random.Random(20)
    kills, per_round = pick(6, 20), 150
    store = SqlEventStore(engine)
    _price(store)
    relay = OutboxRelay(engine, kafka_broker.bootstrap, kafka_topic, partitions=PARTITIONS)
    relay.check_topic()
    stop = threading.Event()
    relaying = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    relaying.start()
    logs = [tmp_path / "worker-a.log", tmp_path / "worker-b.log"]
    boot, topic = kafka_broker.bootstrap, kafka_topic
    armed = 0

    def start(i: int) -> subprocess.Popen[bytes]:
        nonlocal armed
        fault = ""
        if armed < kills:
            armed += 1
            point = ("kafka.after_bills", "kafka.before_commit")[rng.randrange(2)]
            fault = f"{point}@{rng.randint(1, 3)}"
        return _worker(postgres_url, boot, topic, logs[i], fault)

    workers = [start(0), start(1)]
    died = 0
    truth: dict[str, tuple[int, int, int]] = {}

    def restart_the_dead() -> None:
        nonlocal died
        for i, worker in enumerate(workers):
            if worker.poll() is not None:
                assert worker.returncode == -9, logs[i].read_text()[-2000:]
                died += 1
                workers[i] = start(i)

    try:
        # Requests keep arriving while workers die and come back (an armed worker dies at its
        # n-th batch, so it needs new ones), then the clean ones fold to the end.
        deadline = time.monotonic() + pick(240, 900)
        while (died < kills or len(truth) < pick(3_400, 3_400)) and time.monotonic() < deadline:
            truth.update(_requests(store, per_round, rng))
            time.sleep(0.5)
            restart_the_dead()
        while _ledger_count(engine) < len(truth) and time.monotonic() < deadline + 120:
            restart_the_dead()
            time.sleep(0.3)
        time.sleep(2)  # late redeliveries must change nothing
    finally:
        stop.set()
        relaying.join(10)
        relay.close()
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
    with engine.connect() as conn:
        ledger, bills = _ledger_and_bills(conn)
        stored = int(conn.execute(sa.select(sa.func.count()).select_from(events)).scalar())
    lost = set(truth) - set(ledger)
    doubled = [rid for rid, n in bills.items() if n > 1]
    wrong = [rid for rid in truth if rid in ledger and ledger[rid] != truth[rid]]
    print(
        f"kafka worker kills: {stored} events, {len(truth)} requests / {died} kills / "
        f"{len(lost)} lost / {len(doubled)} billed twice / {len(wrong)} wrong counts"
    )
    assert died >= kills
    assert lost == set() and doubled == [] and wrong == []
    assert set(ledger) == set(truth)
    for spec in PROJECTIONS:
        runner = ProjectionRunner(engine, store, spec)
        from_topic = runner.table_digest()
        runner.rebuild()
        assert runner.table_digest() == from_topic, spec.name

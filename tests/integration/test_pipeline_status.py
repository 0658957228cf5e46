"""The pipeline's lags, on real PostgreSQL and the real broker: the relay's lag and each
partition's consumer lag are the exact counts of what is not published / not consumed, zero
after catch-up; `tollgate status` prints them (table and --json) and exits 2 when something is
stale; the relay's and the worker's /metrics carry the same figures and the billing lag."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client import generate_latest

from tests.integration import test_kafka_worker
from tests.integration.test_kafka_worker import _price, _requests
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import events, ledger_entries, upgrade
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer
from tollgate_llm.streams.kafka_worker import KafkaFoldWorker
from tollgate_llm.streams.metrics import ConsumerLagCollector, PipelineMetrics
from tollgate_llm.streams.relay import OutboxRelay
from tollgate_llm.streams.status import BrokerWatermarks, read_status
from tollgate_llm.streams.topics import group_for
from tollgate_llm.streams.worker import FoldWorker
from tollgate_llm.streams.worker_rows import write_status_row

pytestmark = [pytest.mark.postgres]
ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 3
# The development broker answers a partition's high watermark with the base offset of its last
# record batch plus one (streams/relay.py), so the relay of these tests sends one message per
# batch: each watermark is then the partition's true end, and the lags are exact.
ONE_PER_BATCH = {"batch.num.messages": 1, "linger.ms": 0}


engine = test_kafka_worker.engine  # the migrated PostgreSQL store's engine (a fixture)


def status_cli(url: str, *args: str, bootstrap: str | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env["PYTHONPATH"] = str(ROOT)
    if bootstrap:
        env["TOLLGATE_KAFKA_BOOTSTRAP"] = bootstrap
    done = subprocess.run(
        [sys.executable, "-m", "tollgate_llm.cli", "status", "--database-url", url, *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr
    return done.returncode, done.stdout


def metric(registry: object, line_start: str) -> float:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    values = [ln.split()[-1] for ln in text.splitlines() if ln.startswith(line_start)]
    assert len(values) == 1, (line_start, text)
    return float(values[0])


def publish_all(relay: OutboxRelay, timeout_s: float = 60.0) -> None:
    """Publish until nothing is left. Not until a step publishes nothing: the relay sees only
    transactions below the server's xmin, which any open transaction on the server (another
    test's) holds back for a while."""
    deadline = time.monotonic() + timeout_s
    while relay.lag() and time.monotonic() < deadline:
        if not relay.publish_once():
            time.sleep(0.05)
    assert relay.lag() == 0


def event_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(events)).scalar())


def ledger_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(ledger_entries)).scalar())


@pytest.mark.kafka
def test_relay_and_consumer_lags_are_exact_and_zero_after_catch_up(
    engine: sa.Engine, postgres_url: str, kafka_broker, kafka_topic: str
) -> None:
    store = SqlEventStore(engine)
    _price(store)
    _requests(store, 12, random.Random(1))
    stored = event_count(engine)  # the price and 12 requests' events
    boot, topic, group = kafka_broker.bootstrap, kafka_topic, group_for(kafka_topic)
    relay = OutboxRelay(engine, boot, topic, partitions=PARTITIONS, settings=ONE_PER_BATCH)
    relay_metrics = PipelineMetrics(billing=False)
    relay_metrics.add_relay(topic, relay.lag, lambda: relay.state.last_position)
    watermarks = BrokerWatermarks(boot)
    consumer = KafkaEventConsumer(engine, boot, topic, group)
    worker = KafkaFoldWorker(engine, consumer)
    worker.metrics.registry.register(
        ConsumerLagCollector(engine, group, topic, lambda: set(consumer.assigned), watermarks)
    )
    try:
        relay.check_topic()
        # Nothing published yet: the relay is every event behind, in PostgreSQL and on /metrics.
        now = datetime.now(UTC)
        before = read_status(engine, now, watermarks=watermarks)
        assert [(r.topic, r.lag_events, r.published_position) for r in before.relays] == [
            (topic, stored, 0)
        ]
        lag_line = f'tollgate_relay_lag_events{{topic="{topic}"}}'
        assert metric(relay_metrics.registry, lag_line) == stored

        publish_all(relay)
        assert relay.lag() == 0
        assert metric(relay_metrics.registry, "tollgate_relay_lag_events{") == 0
        head = before.head_position
        assert metric(relay_metrics.registry, "tollgate_relay_published_position{") == head
        # Published, not consumed: every message is consumer lag of the group (never committed).
        published = read_status(engine, datetime.now(UTC), watermarks=watermarks)
        assert published.relays[0].lag_events == 0
        assert {p.partition for p in published.partitions} == set(range(PARTITIONS))
        assert sum(p.lag_messages or 0 for p in published.partitions) == stored
        assert all(p.committed_offset == 0 for p in published.partitions)
        assert any("never committed" in s for s in published.stale)
        code, out = status_cli(postgres_url, "--json", bootstrap=boot)
        body = json.loads(out)
        assert code == 2 and body["mode"] == "kafka"
        lags = {
            p["partition"]: p["lag_messages"] for p in body["partitions"] if p["group"] == group
        }
        assert sum(lags.values()) == stored and len(lags) == PARTITIONS
        # Without the broker the table still tells the distributed mode, and what to give it.
        _, text = status_cli(postgres_url)
        assert text.startswith("mode: kafka-unprobed (give --kafka-bootstrap"), text
        _, out = status_cli(postgres_url, "--json")
        assert json.loads(out)["mode"] == "kafka-unprobed"

        # The worker folds everything, its bills go round through the relay: all lags zero.
        worker.start()
        for _ in range(200):
            relay.publish_once()
            worker.run_batch(timeout_s=0.5)
            caught_up = read_status(engine, datetime.now(UTC), watermarks=watermarks)
            if ledger_count(engine) == 12 and relay.lag() == 0 and not any(
                p.lag_messages for p in caught_up.partitions
            ):
                break
        assert ledger_count(engine) == 12
        worker.sweep()
        write_status_row(engine, worker.status())
        caught_up = read_status(engine, datetime.now(UTC), watermarks=watermarks)
        assert caught_up.relays[0].lag_events == 0
        assert [p.lag_messages for p in caught_up.partitions] == [0] * PARTITIONS
        assert sum(p.committed_offset for p in caught_up.partitions) == stored + 12  # and the bills
        assert caught_up.stale == ()
        assert [w.lag_events for w in caught_up.workers] == [0]
        assert consumer.assigned == set(range(PARTITIONS))
        for p in range(PARTITIONS):
            labels = f'{{group="{group}",partition="{p}",topic="{topic}"}}'
            assert metric(worker.metrics.registry, f"tollgate_consumer_lag_messages{labels}") == 0
        # One billing-lag observation per ledger row, each from the terminal event's instant.
        assert metric(worker.metrics.registry, "tollgate_billing_lag_seconds_count") == 12
        code, out = status_cli(postgres_url, bootstrap=boot)
        assert code == 0, out
        assert "nothing stale" in out and group in out and "RELAY TOPIC" in out

        # The worker stops; 5 requests more are published and wait on the topic.
        _requests(store, 5, random.Random(2))
        waiting = event_count(engine) - stored - 12
        publish_all(relay)
        stopped = read_status(engine, datetime.now(UTC), watermarks=watermarks, stale_s=3600)
        assert sum(p.lag_messages or 0 for p in stopped.partitions) == waiting
        assert stopped.stale == ()  # behind, but not for an hour: not stale
        assert sum(
            metric(worker.metrics.registry, f'tollgate_consumer_lag_messages{{group="{group}",'
                   f'partition="{p}",topic="{topic}"}}')
            for p in range(PARTITIONS)
        ) == waiting  # fmt: skip
        later = read_status(
            engine, datetime.now(UTC) + timedelta(seconds=60), watermarks=watermarks, stale_s=30
        )
        behind = [s for s in later.stale if s.startswith(f"consumer group {group}")]
        assert behind and all("message(s) behind, last commit" in s for s in behind)
        assert any(s.startswith("worker folds") for s in later.stale)  # its heartbeat is old
        # Without the broker (an edge's /readyz): the relay published after the group's last
        # commit, and the group has not committed since. The two instants are set here: a
        # publish within PUBLISH_COMMIT_MARGIN_S of the last commit may be what that commit
        # covered (the relay saves its place milliseconds after the acknowledgement).
        def commit_before_publish(seconds: float) -> None:
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE relay_state SET updated_at = now()"))
                conn.execute(
                    sa.text("UPDATE consumer_offsets SET updated_at = now() - :s * interval '1 s'"),
                    {"s": seconds},
                )

        commit_before_publish(0.5)
        unmoved = read_status(engine, datetime.now(UTC) + timedelta(seconds=60), stale_s=30)
        assert not any(s.startswith("consumer group") for s in unmoved.stale)
        commit_before_publish(5)
        edge_view = read_status(engine, datetime.now(UTC) + timedelta(seconds=60), stale_s=30)
        assert any(s.startswith(f"consumer group {group}: nothing committed") for s in
                   edge_view.stale)
    finally:
        consumer.close()
        watermarks.close()
        relay.close()


def test_embedded_status_shows_the_sql_tail_worker_behind_then_caught_up(
    engine: sa.Engine, postgres_url: str
) -> None:
    store = SqlEventStore(engine)
    _price(store)
    _requests(store, 4, random.Random(3))
    worker = FoldWorker(engine)
    worker.catch_up()
    worker.run_pass()
    worker.write_status(every_s=0)
    assert ledger_count(engine) == 4
    assert metric(worker.metrics.registry, "tollgate_billing_lag_seconds_count") == 4
    caught_up = read_status(engine, datetime.now(UTC))
    assert [(w.name, w.lag_events, w.position) for w in caught_up.workers] == [
        ("folds", 0, caught_up.head_position)
    ]
    assert caught_up.stale == () and caught_up.relays == () and caught_up.partitions == ()
    code, out = status_cli(postgres_url)
    assert code == 0 and "mode: embedded" in out and "nothing stale" in out

    _requests(store, 5, random.Random(4))  # the worker is not running: their events wait
    waiting = event_count(engine) - caught_up.head_position
    code, out = status_cli(postgres_url, "--json", "--stale-after", "3600")
    body = json.loads(out)
    assert code == 0 and body["mode"] == "embedded"
    assert [(w["name"], w["lag_events"]) for w in body["workers"]] == [("folds", waiting)]
    assert body["head_position"] == caught_up.head_position + waiting
    later = read_status(engine, datetime.now(UTC) + timedelta(seconds=60), stale_s=30)
    assert any(f"{waiting} event(s) after its position" in s for s in later.stale)
    code, out = status_cli(postgres_url, "--stale-after", "0")
    assert code == 2 and "STALE:" in out and "worker folds" in out

    for _ in range(3):
        worker.run_pass()
    worker.write_status(every_s=0)
    assert ledger_count(engine) == 9
    # Caught up: an old heartbeat is all that a minute later would be stale.
    stale = read_status(engine, datetime.now(UTC) + timedelta(seconds=60), stale_s=30).stale
    assert len(stale) == 1 and stale[0].startswith(f"worker folds (pid {os.getpid()} on ")
    assert read_status(engine, datetime.now(UTC)).workers[0].lag_events == 0


def test_status_runs_without_confluent_kafka_and_says_what_the_kafka_view_needs(
    sqlite_url: str,
) -> None:
    """The plain install (no `kafka` extra): the embedded view works, the Kafka view names the
    missing package instead of a traceback."""
    upgrade(sqlite_url)
    blocked = (
        "import sys; sys.modules['confluent_kafka'] = None; from tollgate_llm.cli import main; "
        "main(sys.argv[1:], prog_name='tollgate')"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env["PYTHONPATH"] = str(ROOT)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", blocked, "status", "--database-url", sqlite_url, *args],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    embedded = run("--json")
    assert embedded.returncode == 0, embedded.stderr
    assert json.loads(embedded.stdout)["mode"] == "embedded"
    engine = create_engine_from_url(sqlite_url)
    _requests(SqlEventStore(engine), 1, random.Random(5))  # events; no worker ever reported
    engine.dispose()
    unfolded = run()
    assert unfolded.returncode == 2, unfolded.stderr
    assert "no worker has reported (worker_status is empty)" in unfolded.stdout
    assert "STALE:" in unfolded.stdout and "no worker has reported, " in unfolded.stdout
    kafka = run("--kafka-bootstrap", "127.0.0.1:9")
    assert kafka.returncode == 1 and "Traceback" not in kafka.stderr
    assert "needs confluent-kafka: pip install 'tollgate-llm[kafka]'" in kafka.stderr

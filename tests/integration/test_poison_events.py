"""One event that a fold cannot apply never stops the others (DESIGN.md invariant 12).

A poison event already in the log (a NUL in a string field, which PostgreSQL's text refuses; a
fold that raises on one event) goes to the dead-letter table with its fold, position and reason,
and every fold moves on: every other tenant's request is billed and every read model goes past
it. A failure of the database (OperationalError) is never a dead letter: the batch is retried
and applied once the fault clears. With the isolation off (the safeguard-off twin), the same
poison stops billing, as it did (issue 26, finding 2).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from tests import builders as b
from tests.kafka_helpers import publish_all
from tollgate_llm.domain.control_plane.events import PriceSet
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.projections import REQUEST_LOG
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest, RouteRequest
from tollgate_llm.domain.requests.events import RequestRejected
from tollgate_llm.ledger import dead_letters, faults
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import dead_letters as dead_table
from tollgate_llm.ledger.schema import ledger_entries, request_log, upgrade
from tollgate_llm.ledger.store import NewEvent, SqlEventStore
from tollgate_llm.streams.dead_letter_replay import replay_dead_letters
from tollgate_llm.streams.status import dead_letter_problem, read_status, render_table
from tollgate_llm.streams.worker import FoldWorker

PRICED = "llama-3.1-8b-2026-05"
NUL_MODEL = "a\x00b"
# Small steps, so the events after the poison lie beyond the first read of a pinned window.
BATCH = 10


def _engine(url: str) -> Iterator[sa.Engine]:
    upgrade(url)
    engine = create_engine_from_url(url)
    yield engine
    engine.dispose()


def _price(store: SqlEventStore) -> None:
    at = datetime.now(UTC) - timedelta(days=1)
    new = NewEvent(
        str(uuid.uuid4()), f"prices-{PRICED}", "", at, PriceSet(PRICED, 150_000, 600_000, 0, at)
    )
    store.append(new.stream_id, 0, [new])


def _request(store: SqlEventStore, tenant: str = "acme") -> str:
    rid = "req_" + uuid.uuid4().hex
    at = datetime.now(UTC)
    events = b.decided(
        AdmitRequest(
            rid, tenant, "key-1", PRICED, "standard", "edge-1", Estimate(100, 50, 1_000, 40_000)
        ),
        RouteRequest("replica-1", 0, request_id=rid),
        CompleteRequest(100, 42, 0, "stop", 30, 20_000, request_id=rid),
        at=at,
    )
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, tenant, at, e) for e in events])
    return rid


def _poison(store: SqlEventStore) -> tuple[str, Recorded]:
    """What the edge recorded for `"model": "a\\u0000b"` before it refused NUL: a rejection
    naming the model, appended straight through the store (the edge is not in the way)."""
    rid = "req_" + uuid.uuid4().hex
    at = datetime.now(UTC)
    event = RequestRejected(rid, "mallory", "key-9", NUL_MODEL, "standard", "invalid", 0, "404")
    (stored,) = store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "mallory", at, event)])
    return rid, stored


def _billed(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(ledger_entries.c.request_id)).scalars())


def _bills(store: SqlEventStore) -> set[str]:
    return {r.stream_id for r in store.read_all(0, 100_000) if r.type == "UsageBilled"}


def _logged(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.select(request_log.c.request_id)).scalars())


def _letters(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.select(dead_table)).mappings()]


def _counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dead_letters.counts_by_fold(conn)


def _passes(worker: FoldWorker, n: int = 12) -> None:
    for _ in range(n):
        worker.run_pass(batch=BATCH)


def _raising_on(event_id: str) -> Callable[[Any, Recorded], Any]:
    def project(row: Any, recorded: Recorded) -> Any:
        if recorded.event_id == event_id:
            raise ValueError("request_log cannot fold this event")
        return REQUEST_LOG.project(row, recorded)

    return project


def _request_log_runner(worker: FoldWorker) -> Any:
    (runner,) = [r for r in worker.runners if r.name == REQUEST_LOG.name]
    return runner


@pytest.mark.postgres
def test_a_nul_in_a_recorded_string_is_dead_lettered_and_every_fold_goes_on(
    postgres_engine: sa.Engine,
) -> None:
    engine = postgres_engine
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    before = [_request(store) for _ in range(2)]
    poison_rid, poison = _poison(store)
    after = [_request(store, tenant) for tenant in ("acme", "globex") for _ in range(4)]

    _passes(worker)

    # Billing and the ledger went past it: every other tenant's request is billed.
    assert _bills(store) == _billed(engine) == set(before + after)
    # request_log too: every request but the poison has its row.
    assert _logged(engine) == set(before + after)
    (letter,) = _letters(engine)
    assert letter["fold"] == "request_log" and letter["event_id"] == poison.event_id
    assert letter["position"] == poison.position and letter["stream_id"] == poison_rid
    assert letter["event_type"] == "RequestRejected" and letter["tenant_id"] == "mallory"
    assert "NUL" in letter["reason"] and "\x00" not in letter["reason"]
    assert len(letter["reason"]) <= dead_letters.REASON_CHARS
    assert letter["replayed_at"] is None and letter["failures"] == 1
    assert _counts(engine) == {"request_log": 1}
    print(
        f"\npoison (SQL tail): {len(before + after)} requests around 1 NUL event: "
        f"{len(_bills(store) & set(after))}/{len(after)} after it billed, "
        f"{len(_logged(engine))} request_log rows, 1 dead letter ({letter['reason'][:60]})"
    )
    worker.write_status()
    # An alarm: `tollgate status` exits 2 on it and an edge's /readyz lists it.
    cluster = read_status(engine, datetime.now(UTC))
    assert cluster.dead_letters == {"request_log": 1}
    assert cluster.dead_letters == {"request_log": 1}
    assert dead_letter_problem("request_log", 1) in cluster.problems
    assert "request_log" in render_table(cluster)

    # A restart does not meet it again (its checkpoint is past it), and records nothing twice.
    again = FoldWorker(engine)
    again.catch_up()
    more = _request(store, "globex")
    _passes(again)
    assert more in _billed(engine) and more in _logged(engine)
    assert _counts(engine) == {"request_log": 1} and again.errors == {}

    # A replay still fails (the value cannot be stored): it stays, with its reason.
    outcome = replay_dead_letters(engine)
    assert outcome.replayed == () and len(outcome.failed) == 1
    (letter,) = _letters(engine)
    assert letter["replayed_at"] is None and letter["failures"] == 2 and "NUL" in letter["reason"]


@pytest.mark.postgres
def test_with_the_isolation_off_the_same_nul_stops_billing(postgres_engine: sa.Engine) -> None:
    """The safeguard-off twin: the read window pinned at the failing read model, as before."""
    engine = postgres_engine
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.isolate_poison = False
    worker.catch_up()
    before = [_request(store) for _ in range(2)]
    _poison(store)
    after = [_request(store, tenant) for tenant in ("acme", "globex") for _ in range(4)]

    _passes(worker)

    bills = _bills(store)
    print(
        f"\npoison, isolation off (SQL tail): {len(bills & set(after))}/{len(after)} requests "
        f"after the NUL billed, {len(_billed(engine))} ledger rows"
    )
    assert set(before) <= bills
    assert set(after) - bills  # billing stopped: these ended and were never billed
    assert not _billed(engine)  # and no ledger row at all: it shares the failing transaction
    assert "NUL" in worker.errors["projections"]
    assert _letters(engine) == []


def test_a_fold_that_raises_on_one_event_dead_letters_it_and_a_replay_applies_it(
    engine: sa.Engine,
) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    runner = _request_log_runner(worker)
    spec = runner._spec
    before = [_request(store) for _ in range(2)]
    victim = _request(store, "globex")
    (admitted,) = [r for r in store.read_stream(victim) if r.type == "RequestAdmitted"]
    runner._spec = replace(spec, project=_raising_on(admitted.event_id))
    after = [_request(store, tenant) for tenant in ("acme", "globex") for _ in range(4)]

    _passes(worker)

    everyone = set(before + [victim] + after)
    assert _billed(engine) == everyone  # the victim too: only request_log refused its event
    assert _logged(engine) == everyone - {victim}  # its row is opened by the event refused
    # The refused admission, and the victim's later events, which without the row it opens
    # break the row's constraints: each is dead-lettered, none of another request.
    letters = {letter["event_id"]: letter for letter in _letters(engine)}
    assert {(d["fold"], d["stream_id"]) for d in letters.values()} == {("request_log", victim)}
    first = letters[admitted.event_id]
    assert first["position"] == admitted.position and "cannot fold this" in first["reason"]
    assert _counts(engine) == {"request_log": len(letters)}

    # Still broken: the replay fails and the dead letters stay, with their new reasons.
    outcome = replay_dead_letters(engine, fold="request_log", runners=worker.runners)
    assert (len(outcome.replayed), len(outcome.failed)) == (0, len(letters))
    assert _counts(engine) == {"request_log": len(letters)}

    # Fixed: one command applies them through the same fold code, once.
    runner._spec = spec
    assert len(replay_dead_letters(engine, runners=worker.runners).replayed) == len(letters)
    assert _counts(engine) == {}
    assert all(d["replayed_at"] is not None and d["failures"] == 2 for d in _letters(engine))
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(request_log).where(request_log.c.request_id == victim)
        ).mappings().one()
    # Folded from its stream: the admission and what came after it, in their order.
    assert (row["model"], row["status"], row["completion_tokens"]) == (PRICED, "completed", 42)
    assert replay_dead_letters(engine).replayed == ()  # nothing left to replay
    worker.write_status()
    cleared = read_status(engine, datetime.now(UTC))
    assert cleared.dead_letters == {}
    assert not any("dead letters" in p for p in cleared.problems)


def test_a_database_failure_is_retried_never_dead_lettered(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    runner = _request_log_runner(worker)
    write_rows = runner._write_rows
    down = {"on": True, "refused": 0}

    def failing(conn: sa.Connection, prepared: Any) -> None:
        if down["on"]:
            down["refused"] += 1
            raise sa.exc.OperationalError(
                "INSERT INTO request_log", {}, Exception("server closed the connection")
            )
        write_rows(conn, prepared)

    runner._write_rows = failing
    first = [_request(store, tenant) for tenant in ("acme", "globex") for _ in range(3)]

    _passes(worker, 4)

    assert down["refused"] > 0 and _letters(engine) == []
    assert "OperationalError" in worker.errors["request_log"]  # reported, retried each pass
    assert not set(first) & _logged(engine)  # nothing of it applied, nothing skipped
    assert _billed(engine) == set(first)  # billing never waited on the read model

    down["on"] = False
    second = _request(store)
    _passes(worker, 4)
    assert _logged(engine) == set(first) | {second}  # the batch retried and applied
    assert _billed(engine) == set(first) | {second}
    assert _letters(engine) == [] and worker.errors == {}


def test_the_store_unavailable_without_a_cause_is_retried_never_dead_lettered(
    engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the fault matrix (distributed `before`, seed 8): the billing fold's appends
    refused with the store's own `StoreUnavailable`, raised with no database error under it (as
    the store does when it cannot connect at all), four times in a row while the database
    answered: the bill was taken for the event's fault and dead-lettered, its request never
    billed. A store that is away is the database's failure whatever its cause: retried."""
    store = SqlEventStore(engine)
    _price(store)
    worker = FoldWorker(engine)
    worker.catch_up()
    rids = [_request(store, tenant) for tenant in ("acme", "globex")]
    monkeypatch.setenv(faults.FAULTS_ENV, "")
    monkeypatch.setattr(
        SqlEventStore, "_append_many", faults.seam("store.append")(SqlEventStore._append_many)
    )
    faults.arm(";".join(f"store.append:before@{n}" for n in range(1, 5)))
    try:
        _passes(worker, 8)
    finally:
        faults.arm("")
    assert _letters(engine) == []
    assert _billed(engine) == set(rids) and _bills(store) == set(rids)


def test_a_bill_that_cannot_be_decided_is_kept_and_replayed_once_priced(
    engine: sa.Engine,
) -> None:
    """The billing fold's own dead letters (no price in force) are in the table too, and a
    replay after the price is set bills the request once."""
    store = SqlEventStore(engine)
    worker = FoldWorker(engine)
    worker.catch_up()
    unpriced = _request(store)  # no price set yet
    _passes(worker, 3)
    assert _counts(engine) == {"billing": 1} and unpriced not in _billed(engine)
    (letter,) = _letters(engine)
    assert letter["stream_id"] == unpriced and letter["event_type"] == "RequestCompleted"
    assert "no_price" in letter["reason"]

    _price(store)
    outcome = replay_dead_letters(engine, fold="billing")
    assert len(outcome.replayed) == 1 and _counts(engine) == {}
    assert replay_dead_letters(engine).replayed == ()
    _passes(worker, 3)
    assert unpriced in _billed(engine)
    bills = [r for r in store.read_stream(unpriced) if r.type == "UsageBilled"]
    assert len(bills) == 1


def _kafka_poisoned(
    engine: sa.Engine, bootstrap: str, topic: str, *, isolate: bool
) -> tuple[Any, dict[str, tuple[int, int, int]], Recorded, int]:
    """Requests of six tenants with the NUL rejection among them, published to `topic`; a
    Kafka worker (isolation as asked) folds the topic for a while. Returns the worker, the
    requests' engine counts, the poison and how many records were published."""
    import random
    import time

    from tests.integration.test_kafka_worker import PARTITIONS
    from tests.integration.test_kafka_worker import _price as price
    from tests.integration.test_kafka_worker import _requests as requests
    from tollgate_llm.streams.kafka_consumer import KafkaEventConsumer
    from tollgate_llm.streams.kafka_worker import KafkaFoldWorker
    from tollgate_llm.streams.relay import OutboxRelay
    from tollgate_llm.streams.topics import group_for

    store = SqlEventStore(engine)
    price(store)
    rng = random.Random(26)
    truth = requests(store, 20, rng)
    _, poison = _poison(store)
    truth |= requests(store, 20, rng)
    relay = OutboxRelay(engine, bootstrap, topic, partitions=PARTITIONS)
    relay.check_topic()
    published = publish_all(relay, engine)
    relay.close()
    consumer = KafkaEventConsumer(engine, bootstrap, topic, group_for(topic))
    worker = KafkaFoldWorker(engine, consumer)
    worker.isolate_poison = isolate
    deadline = time.monotonic() + 30
    tries = 0
    try:
        while worker.folded < published and time.monotonic() < deadline and tries < 5:
            try:
                worker.run_batch(5000, 0.5)
            except Exception:
                tries += 1  # the twin: the batch is rewound and fails again
    finally:
        consumer.close()
    return worker, truth, poison, published


@pytest.mark.postgres
@pytest.mark.kafka
def test_a_kafka_worker_dead_letters_a_nul_with_its_offset_and_commits_the_rest(
    postgres_url: str, kafka_broker: Any, kafka_topic: str
) -> None:
    engine = next(_engine(postgres_url))
    try:
        worker, truth, poison, published = _kafka_poisoned(
            engine, kafka_broker.bootstrap, kafka_topic, isolate=True
        )
        print(
            f"\npoison (Kafka): {published} records, {len(truth)} requests: "
            f"{len(_billed(engine) & set(truth))} ledger rows, {worker.folded} claimed"
        )
        assert worker.folded == published  # every record claimed, the offsets past the poison
        assert _billed(engine) == set(truth)  # every tenant's ledger row
        assert _logged(engine) == set(truth)
        (letter,) = _letters(engine)
        assert (letter["fold"], letter["event_id"]) == ("request_log", poison.event_id)
        assert letter["topic"] == kafka_topic and letter["position"] == poison.position
        assert letter["kafka_partition"] is not None and letter["kafka_offset"] is not None
        assert "NUL" in letter["reason"]
        assert _counts(engine) == {"request_log": 1}
    finally:
        engine.dispose()


@pytest.mark.postgres
@pytest.mark.kafka
def test_with_the_isolation_off_a_kafka_worker_repeats_the_poisoned_batch_forever(
    postgres_url: str, kafka_broker: Any, kafka_topic: str
) -> None:
    """The safeguard-off twin: the batch holding the poison is rewound and fails again, and
    the ledger rows of the requests that share it never commit."""
    engine = next(_engine(postgres_url))
    try:
        worker, truth, _, published = _kafka_poisoned(
            engine, kafka_broker.bootstrap, kafka_topic, isolate=False
        )
        print(
            f"\npoison, isolation off (Kafka): {published} records, {len(truth)} requests: "
            f"{len(_billed(engine) & set(truth))} ledger rows, {worker.folded} claimed"
        )
        assert worker.folded < published
        assert set(truth) - _billed(engine)  # ended, billed in the store, never in the ledger
        assert _letters(engine) == []
    finally:
        engine.dispose()


def _tollgate(*args: str, url: str) -> Any:
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "tollgate_llm.cli", *args, "--database-url", url],
        capture_output=True, text=True, timeout=120, env=dict(os.environ),
    )  # fmt: skip


def test_dead_letters_are_listed_alarmed_and_replayed_with_one_command(sqlite_url: str) -> None:
    import orjson

    engine = next(_engine(sqlite_url))
    try:
        store = SqlEventStore(engine)
        worker = FoldWorker(engine)
        worker.catch_up()
        unpriced = _request(store)  # no price in force: billing cannot bill it
        _passes(worker, 3)
        worker.write_status()

        listed = _tollgate("dead-letters", "list", "--json", url=sqlite_url)
        assert listed.returncode == 0, listed.stderr
        (row,) = orjson.loads(listed.stdout)
        assert (row["fold"], row["stream_id"]) == ("billing", unpriced)
        status = _tollgate("status", url=sqlite_url)
        assert status.returncode == 2 and "dead letters: billing" in status.stdout

        still = _tollgate("dead-letters", "replay", url=sqlite_url)
        assert still.returncode == 2 and "still failing 1" in still.stdout
        assert "no_price" in still.stdout

        _price(store)
        done = _tollgate("dead-letters", "replay", "--fold", "billing", url=sqlite_url)
        assert done.returncode == 0 and "replayed 1, still failing 0" in done.stdout
        listed = _tollgate("dead-letters", "list", url=sqlite_url)
        assert listed.stdout.strip() == "no dead letters"
        assert "dead letters" not in _tollgate("status", url=sqlite_url).stdout
        assert len([r for r in store.read_stream(unpriced) if r.type == "UsageBilled"]) == 1
    finally:
        engine.dispose()


def test_a_healthy_pass_reads_once_and_dead_letters_show_on_the_worker_metrics(
    sqlite_url: str,
) -> None:
    """The isolation costs nothing while every fold is in step: one read of the log per pass
    and no read of a fold's own; the worker's /metrics shows every fold's dead letters."""
    from prometheus_client import generate_latest

    from tollgate_llm.streams.metrics import DeadLettersCollector, PipelineMetrics

    engine = next(_engine(sqlite_url))
    try:
        store = SqlEventStore(engine)
        _price(store)
        worker = FoldWorker(engine)
        worker.catch_up()
        _passes(worker, 1)
        reads: list[str] = []
        tail_read, own_read = worker.tail.read, worker._catch_up_runner
        worker.tail.read = lambda *a, **k: reads.append("tail") or tail_read(*a, **k)  # type: ignore[method-assign]
        worker._catch_up_runner = lambda *a, **k: reads.append("own") or own_read(*a, **k)  # type: ignore[method-assign]
        rids = [_request(store) for _ in range(3)]
        worker.run_pass()
        assert reads == ["tail"] and worker.errors == {}
        assert set(rids) <= _bills(store)

        metrics = PipelineMetrics(billing=False)
        metrics.registry.register(DeadLettersCollector(engine))
        text = generate_latest(metrics.registry).decode()
        assert 'tollgate_dead_letters{fold="request_log"} 0.0' in text
        with engine.begin() as conn:
            dead_letters.record(
                conn,
                [dead_letters.DeadLetter.of("request_log", store.read_stream(rids[0])[0], "x")],
                datetime.now(UTC),
            )
        text = generate_latest(metrics.registry).decode()
        assert 'tollgate_dead_letters{fold="request_log"} 1.0' in text
        assert 'tollgate_dead_letters{fold="billing"} 0.0' in text
    finally:
        engine.dispose()


def test_an_event_is_not_blamed_while_the_database_does_not_answer(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure that repeats alone is the event's only while the database answers: with the
    database silent, nothing is dead-lettered and the fold stays where it was."""
    engine = next(_engine(sqlite_url))
    try:
        store = SqlEventStore(engine)
        _price(store)
        worker = FoldWorker(engine)
        worker.catch_up()
        runner = _request_log_runner(worker)
        spec = runner._spec
        victim = _request(store)
        (admitted,) = [r for r in store.read_stream(victim) if r.type == "RequestAdmitted"]
        runner._spec = replace(spec, project=_raising_on(admitted.event_id))
        monkeypatch.setattr(dead_letters, "database_answers", lambda engine: False)
        _passes(worker, 3)
        assert _letters(engine) == [] and victim not in _logged(engine)
        assert "cannot fold this" in worker.errors["request_log"]  # retried each pass
        assert victim in _bills(store)  # billing went on regardless

        monkeypatch.undo()
        _passes(worker, 3)
        assert [d["event_id"] for d in _letters(engine)][0] == admitted.event_id
    finally:
        engine.dispose()


def test_a_fold_failing_on_every_event_stops_dead_lettering_and_reports(sqlite_url: str) -> None:
    """A broken fold, not a poison event: after DEAD_LETTERS_IN_A_ROW dead letters without an
    event applied, it stops moving past them and reports (billing goes on)."""
    from tollgate_llm.streams.worker import DEAD_LETTERS_IN_A_ROW

    engine = next(_engine(sqlite_url))
    try:
        store = SqlEventStore(engine)
        _price(store)
        worker = FoldWorker(engine)
        worker.catch_up()
        runner = _request_log_runner(worker)

        def broken(row: Any, recorded: Recorded) -> Any:
            raise ValueError("request_log is broken")

        runner._spec = replace(runner._spec, project=broken)
        rids = [_request(store) for _ in range(10)]  # 50 events for request_log
        _passes(worker, 10)
        assert len(_letters(engine)) == DEAD_LETTERS_IN_A_ROW
        assert "looks broken" in worker.errors["request_log"]
        assert _logged(engine) == set() and set(rids) <= _bills(store)
    finally:
        engine.dispose()

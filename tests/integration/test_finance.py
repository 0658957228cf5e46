"""Finance queries and views over real databases: usage groupings, invoices with an
effective-dated price change, exact money, and a reconciliation that names what is missing."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from tollgate_llm.domain.control_plane.events import PriceSet, TenantRegistered
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Estimate, amount_micros
from tollgate_llm.domain.projections import PROJECTIONS
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    BillUsage,
    CancelRequest,
    CompleteRequest,
    RouteRequest,
    decide,
)
from tollgate_llm.domain.requests.evolve import evolve_event
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger.finance import FinanceQueries, month_bounds
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

MODEL = "llama-3.1-8b-2026-05"
T0 = datetime(2026, 10, 30, 22, 0, tzinfo=UTC)  # two months, a month boundary, a price change
PRICE_CHANGE = datetime(2026, 11, 10, tzinfo=UTC)


def _new(stream: str, tenant: str, at: datetime, event: object) -> NewEvent:
    return NewEvent(str(uuid.uuid4()), stream, tenant, at, event)  # type: ignore[arg-type]


@pytest.fixture
def db(engine: sa.Engine) -> tuple[sa.Engine, SqlEventStore]:
    return engine, SqlEventStore(engine)


def _seed(store: SqlEventStore) -> ControlView:
    view = ControlView()
    events = [
        _new(
            "tenant-acme",
            "acme",
            T0 - timedelta(days=1),
            TenantRegistered("acme", "acme", "standard", "salt-a"),
        ),
        _new(
            "tenant-beta",
            "beta",
            T0 - timedelta(days=1),
            TenantRegistered("beta", "beta", "free", "salt-b"),
        ),
    ]
    for e in events:
        for r in store.append(e.stream_id, None, [e]):
            view.apply(r)
    for effective, prices in (
        (T0 - timedelta(days=1), (150_000, 600_000, 75_000)),
        (PRICE_CHANGE, (300_000, 1_200_000, 150_000)),
    ):
        e = _new(
            f"prices-{MODEL}",
            "",
            T0 - timedelta(days=1),
            PriceSet(MODEL, *prices, effective_at=effective),
        )
        for r in store.append(e.stream_id, None, [e]):
            view.apply(r)
    return view


def _request(
    store: SqlEventStore,
    view: ControlView,
    tenant: str,
    at: datetime,
    prompt: int,
    completion: int,
    cached: int,
    key: str = "key-1",
    terminal: str = "complete",
) -> str:
    rid = "req_" + uuid.uuid4().hex
    state = RequestState()
    batch: list[NewEvent] = []

    def run(command: object, when: datetime) -> None:
        nonlocal state
        for event in decide(state, command):  # type: ignore[arg-type]
            batch.append(_new(rid, tenant, when, event))
            state = evolve_event(state, event, when)

    run(
        AdmitRequest(
            rid, tenant, key, MODEL, "standard", "edge-1", Estimate(prompt, 500, 1_000_000, 40_000)
        ),
        at,
    )
    run(RouteRequest("replica-1", 100_000, request_id=rid), at)
    end = at + timedelta(seconds=2)
    if terminal == "complete":
        run(CompleteRequest(prompt, completion, cached, "stop", 50, 20_000, request_id=rid), end)
    elif terminal == "cancel":
        run(CancelRequest(prompt, completion, cached, request_id=rid), end)
    if terminal != "none":
        run(BillUsage(view.price(MODEL, at), request_id=rid), end)
    store.append(rid, 0, batch)
    return rid


def _project(engine: sa.Engine, store: SqlEventStore) -> None:
    for spec in PROJECTIONS:
        ProjectionRunner(engine, store, spec).run_to_end()


def test_usage_invoices_and_views_agree(db) -> None:  # type: ignore[no-untyped-def]
    engine, store = db
    view = _seed(store)
    made = [
        ("acme", T0, 1000, 200, 0),  # October, old price
        ("acme", T0 + timedelta(minutes=30), 2000, 100, 512),  # October, same hour
        ("acme", T0 + timedelta(days=2), 700, 300, 0),  # November, old price
        ("acme", PRICE_CHANGE + timedelta(hours=5), 900, 50, 256),  # November, new price
        ("beta", T0 + timedelta(days=2), 123, 45, 0),
    ]
    for tenant, at, p, c, k in made:
        _request(store, view, tenant, at, p, c, k)
    _project(engine, store)
    q = FinanceQueries(engine)
    start, end = T0 - timedelta(days=1), T0 + timedelta(days=40)

    hourly = q.usage("acme", start, end, None, "hour")
    assert [r["requests"] for r in hourly] == [2, 1, 1]
    assert hourly[0]["prompt_tokens"] == 3000 and hourly[0]["cached_tokens"] == 512
    by_model = q.usage(None, start, end, "llama-3.1-8b", "model")  # a base name matches versions
    assert {(r["tenant"], r["requests"]) for r in by_model} == {("acme", 4), ("beta", 1)}
    by_key = q.usage("acme", start, end, None, "key")
    assert by_key[0]["key_id"] == "key-1" and by_key[0]["completion_tokens"] == 650
    by_day = q.usage("acme", start, end, None, "day")
    assert sum(r["requests"] for r in by_day) == 4

    old = view.price(MODEL, T0)
    new = view.price(MODEL, PRICE_CHANGE)
    assert old.prompt_micros_per_mtok != new.prompt_micros_per_mtok
    invoice = q.invoice("acme", "2026-11")
    assert len(invoice["lines"]) == 2  # one line per price in force: the change splits it
    expected = amount_micros(old, 700, 300, 0) + amount_micros(new, 900, 50, 256)
    assert invoice["amount_micros"] == expected
    october = q.invoice("acme", "2026-10")
    assert october["amount_micros"] == amount_micros(old, 1000, 200, 0) + amount_micros(
        old, 2000, 100, 512
    )

    with engine.connect() as conn:
        view_total = conn.execute(
            sa.text(
                "SELECT amount_micros FROM finance_invoices"
                " WHERE tenant = 'acme' AND period = '2026-11'"
            )
        ).scalar()
        usage_rows = conn.execute(
            sa.text("SELECT COUNT(*) FROM finance_usage_hourly WHERE tenant = 'acme'")
        ).scalar()
        entries = conn.execute(
            sa.text("SELECT COUNT(*), SUM(amount_micros) FROM finance_ledger_entries")
        ).one()
    assert int(view_total) == expected
    assert usage_rows == 3
    assert entries[0] == 5

    page1 = q.entries("acme", start, end, None, 2)
    page2 = q.entries("acme", start, end, None, 2, after=page1[-1]["request_id"])
    assert len(page1) == 2 and len(page2) == 2
    assert not {r["request_id"] for r in page1} & {r["request_id"] for r in page2}


def test_reconciliation_lists_each_mismatch(db) -> None:  # type: ignore[no-untyped-def]
    engine, store = db
    view = _seed(store)
    now = datetime.now(UTC)
    healthy = [
        _request(store, view, "acme", now - timedelta(hours=2), 100, 10, 0) for _ in range(3)
    ]
    cancelled = _request(store, view, "acme", now - timedelta(hours=2), 50, 5, 0, terminal="cancel")
    dangling = _request(store, view, "acme", now - timedelta(hours=1), 100, 0, 0, terminal="none")
    _project(engine, store)
    unprojected = _request(store, view, "beta", now - timedelta(minutes=30), 10, 1, 0)

    report = FinanceQueries(engine).reconciliation(
        SqlEventStore(engine), now - timedelta(days=1), now
    )
    problems = {(m["request_id"], m["problem"]) for m in report["mismatches"]}
    assert (dangling, "admitted without a terminal event") in problems
    assert any(rid == unprojected and "ledger entry" in p for rid, p in problems)
    assert not {rid for rid, _ in problems} & {*healthy, cancelled}
    assert report["totals"]["admitted"] == 6 and report["totals"]["terminal"] == 5
    assert not report["ok"]

    _project(engine, store)
    report = FinanceQueries(engine).reconciliation(
        SqlEventStore(engine), now - timedelta(days=1), now
    )
    assert [m["request_id"] for m in report["mismatches"]] == [dangling]


def test_month_bounds_rejects_bad_periods() -> None:
    assert month_bounds("2026-12")[1] == datetime(2027, 1, 1, tzinfo=UTC)
    for bad in ("2026-13", "2026", "26-01", "2026-1x"):
        with pytest.raises(ValueError):
            month_bounds(bad)

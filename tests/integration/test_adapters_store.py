"""LoRA adapters on each database (SQLite, then PostgreSQL): the commands recorded through the one
command handler and folded back by a fresh reader (its tenant's and projects' alone, revoked,
re-registered as a new version, its own price beside its base's), and the adapter carried from
the request's events into the request log, the ledger, usage by adapter, the invoice and the
finance view."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.integration.test_finance import MODEL, T0, _new, _project, _seed
from tests.vllm.tiny_adapter import build
from tollgate_llm.api.services import adapter_service as adapters
from tollgate_llm.api.services.control_service import ControlService
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.control_plane.adapters import price_key
from tollgate_llm.domain.cost import Estimate, Price
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.requests.decide import (
    AdmitRequest,
    BillUsage,
    CompleteRequest,
    RouteRequest,
    decide,
)
from tollgate_llm.domain.requests.evolve import evolve_event
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.finance import FinanceQueries
from tollgate_llm.ledger.store import SqlEventStore


def test_adapters_are_recorded_and_folded_back(engine: sa.Engine, tmp_path: Path) -> None:
    service = ControlService(SqlEventStore(engine), Actor("operator", "test"))
    tenant, other = (f"t-{uuid.uuid4().hex[:8]}" for _ in range(2))
    service.create_tenant(tenant, "standard")
    service.create_tenant(other, "standard")
    service.create_workspace(tenant, "ws")
    service.create_project(tenant, "p1", "ws")
    service.create_project(tenant, "p2", "ws")
    in_p1, _ = service.issue_key(tenant, "customer", project="p1")
    in_p2, _ = service.issue_key(tenant, "customer", project="p2")
    org_key, _ = service.issue_key(tenant, "customer")
    other_key, _ = service.issue_key(other, "customer")
    path = str(build(tmp_path / "support", rank=8))
    service.set_price(MODEL, 1_000_000, 2_000_000, 500_000, currency="USD")

    first = adapters.register(service, tenant, "support", MODEL, path)
    assert (first.rank, first.version, first.engine_name) == (8, 1, f"{tenant}/support@1")
    again = adapters.register(service, tenant, "support", MODEL, path)  # nothing new
    assert again.version == 1
    kept = adapters.register(service, tenant, "support", MODEL, path, projects=("p1",))
    assert kept.version == 2  # a new registration: the replicas load it afresh
    with pytest.raises(DomainError, match="no project 'nope'"):
        adapters.register(service, tenant, "other", MODEL, path, projects=("nope",))
    with pytest.raises(DomainError, match="is a model's name"):
        adapters.register(service, tenant, MODEL, MODEL, path)
    adapters.set_price(service, tenant, "support", 7_000_000, 9_000_000, 1_000_000,
                       currency="USD")  # fmt: skip

    fresh = ControlLog(SqlEventStore(engine)).view  # another process's reader
    assert fresh.adapter(tenant, in_p1, "support") == kept
    assert fresh.adapter(tenant, in_p2, "support") is None  # kept to p1
    assert fresh.adapter(tenant, org_key, "support") is None
    assert fresh.adapter(other, other_key, "support") is None  # another tenant's name
    now = kept.registered_at + timedelta(hours=1)
    own = fresh.price(MODEL, now, adapter=price_key(tenant, "support"))
    assert (own.prompt_micros_per_mtok, own.model) == (7_000_000, price_key(tenant, "support"))
    assert fresh.price(MODEL, now, adapter=price_key(other, "support")) == fresh.price(MODEL, now)

    assert adapters.revoke(service, tenant, "support")
    assert not adapters.revoke(service, tenant, "support")
    reread = ControlLog(SqlEventStore(engine)).view
    assert reread.adapter(tenant, in_p1, "support") is None
    assert [(a["name"], a["version"], a["revoked_at"] is not None, a["priced"]) for a in
            adapters.listing(service, tenant)] == [("support", 2, True, "own")]  # fmt: skip


def test_the_adapter_in_usage_the_invoice_and_the_finance_view(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    view = _seed(store)
    at = T0 + timedelta(hours=1)
    own = Price(price_key("acme", "support"), 7_000_000, 9_000_000, 1_000_000)
    for adapter, price in (("", view.price(MODEL, at)), ("support", own), ("support", own)):
        rid = "req_" + uuid.uuid4().hex
        state, batch = RequestState(), []  # type: ignore[var-annotated]
        for command in (
            AdmitRequest(rid, "acme", "key-1", MODEL, "standard", "edge-1",
                         Estimate(100, 500, 1_000_000, 40_000), adapter=adapter),
            RouteRequest("replica-1", 100_000, request_id=rid),
            CompleteRequest(100, 10, 0, "stop", 50, 20_000, request_id=rid),
            BillUsage(price, request_id=rid),
        ):  # fmt: skip
            for event in decide(state, command):  # type: ignore[arg-type]
                batch.append(_new(rid, "acme", at, event))
                state = evolve_event(state, event, at)
        store.append(rid, 0, batch)
    _project(engine, store)
    finance = FinanceQueries(engine)
    rows = finance.usage("acme", T0, T0 + timedelta(days=1), None, "adapter")
    assert {r["adapter"]: r["requests"] for r in rows} == {None: 1, "support": 2}
    # 100 prompt tokens at 7 and 10 completion tokens at 9 per million, twice.
    assert next(r for r in rows if r["adapter"])["amount_micros"] == 2 * (700 + 90)
    lines = finance.invoice("acme", "2026-10")["lines"]
    billed = {(line["adapter"], line["prompt_micros_per_mtok"], line["requests"]) for line in lines}
    assert ("support", 7_000_000, 2) in billed and len(billed) == 2
    with engine.connect() as conn:
        viewed = conn.execute(sa.text(
            "SELECT adapter, requests FROM finance_usage_by_adapter WHERE tenant = 'acme' "
            "AND period = '2026-10' ORDER BY adapter"
        )).all()  # fmt: skip
        logged = conn.execute(sa.text(
            "SELECT adapter, count(*) FROM request_log WHERE tenant_id = 'acme' GROUP BY adapter"
        )).all()  # fmt: skip
    assert [tuple(r) for r in viewed] == [("", 1), ("support", 2)]
    assert {tuple(r) for r in logged} == {(None, 1), ("support", 2)}

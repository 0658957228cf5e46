"""Residency and retention on each database (SQLite, then PostgreSQL): the commands recorded and
folded back by a fresh reader, a zero-retention replay record that keeps no body, a read-once
batch file handed out once, and usage by region in the finance API and view."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from tests.integration.test_finance import MODEL, T0, _new, _project, _request, _seed
from tollgate_llm.api.services import data_policy_service as policy
from tollgate_llm.api.services.control_service import ControlService
from tollgate_llm.api.services.idempotency_service import AsyncIdempotency
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.cost import Estimate
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
from tollgate_llm.ledger.batches import BatchStore, StoredFile
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.finance import FinanceQueries
from tollgate_llm.ledger.idempotency import IdempotencyStore
from tollgate_llm.ledger.schema import batch_files, idempotency_records
from tollgate_llm.ledger.store import SqlEventStore

CANARY = f"canary-{uuid.uuid4().hex}"


def test_residency_and_retention_are_recorded_and_folded_back(engine: sa.Engine) -> None:
    service = ControlService(SqlEventStore(engine), Actor("operator", "test"))
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    service.create_tenant(tenant, "standard")
    service.create_workspace(tenant, "ws")
    service.create_project(tenant, "p1", "ws")
    key_id, _ = service.issue_key(tenant, "customer", project="p1")
    assert policy.set_residency(service, tenant, "eu-west,eu-central")
    assert not policy.set_residency(service, tenant, "eu-central,eu-west")  # nothing new
    assert policy.set_residency(service, tenant, "eu-west", project="p1")
    assert policy.set_retention(service, tenant, "zero", project="p1")
    with pytest.raises(DomainError, match="outside the tenant's regions"):
        policy.set_residency(service, tenant, "us-east", project="p1")

    fresh = ControlLog(SqlEventStore(engine)).view  # another process's reader
    assert fresh.regions(tenant, key_id) == frozenset({"eu-west"})
    assert fresh.retention(tenant, key_id) == "zero"
    assert policy.clear_residency(service, tenant, project="p1")
    assert ControlLog(SqlEventStore(engine)).view.regions(tenant, key_id) == frozenset(
        {"eu-west", "eu-central"}
    )


def test_a_zero_retention_replay_record_keeps_the_status_and_id_never_the_body(
    engine: sa.Engine,
) -> None:
    idempotency = AsyncIdempotency(IdempotencyStore(engine))
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    body = f'{{"choices": [{{"message": {{"content": "{CANARY}"}}}}]}}'.encode()

    async def go() -> None:
        await idempotency.begin(tenant, "k-zero", "req-zero", "sha")
        await idempotency.complete(
            tenant, "k-zero", 200, body, "text/event-stream",
            {"X-Request-Id": "req-zero", "X-Tollgate-Retention": "zero"},
        )  # fmt: skip
        await idempotency.begin(tenant, "k-std", "req-std", "sha")
        await idempotency.complete(
            tenant, "k-std", 200, body, "application/json", {"X-Request-Id": "req-std"}
        )
        zero = await idempotency.lookup(tenant, "k-zero", "sha")
        assert zero is not None
        assert (zero.request_id, zero.status, zero.content_type) == (
            "req-zero", 200, "application/json",
        )  # fmt: skip
        assert CANARY.encode() not in zero.body and b'"retention":"zero"' in zero.body
        assert zero.headers["X-Tollgate-Retention"] == "zero"
        standard = await idempotency.lookup(tenant, "k-std", "sha")
        assert standard is not None and standard.body == body

    asyncio.run(go())
    t = idempotency_records
    with engine.connect() as conn:
        kept = dict(
            conn.execute(
                sa.select(t.c.request_id, t.c.response_body).where(t.c.tenant_id == tenant)
            ).all()
        )
    assert CANARY not in kept["req-zero"] and CANARY in kept["req-std"]


def test_a_read_once_file_is_handed_out_once(engine: sa.Engine) -> None:
    files = BatchStore(engine)
    now = datetime.now(UTC)
    tenant = f"t-{uuid.uuid4().hex[:8]}"

    def stored(file_id: str) -> StoredFile:
        return StoredFile(file_id, tenant, "batch_output", "out.jsonl", 3, now,
                          now + timedelta(days=1))  # fmt: skip

    once, kept = f"file-{uuid.uuid4().hex[:20]}", f"file-{uuid.uuid4().hex[:20]}"
    files.put_file(stored(once), b"abc", read_once=True)
    files.put_file(stored(kept), b"xyz")
    assert files.content(tenant, once, now) == b"abc"  # the runner's own reads leave it
    assert files.content("someone-else", once, now, consume=True) is None
    assert files.content(tenant, once, now, consume=True) == b"abc"
    assert files.content(tenant, once, now, consume=True) is None
    assert files.content(tenant, kept, now, consume=True) == b"xyz"
    assert files.content(tenant, kept, now, consume=True) == b"xyz"
    with engine.connect() as conn:
        left = conn.execute(
            sa.select(batch_files.c.file_id).where(batch_files.c.tenant_id == tenant)
        ).scalars()
        assert list(left) == [kept]


def test_usage_by_region_in_the_api_and_the_view(engine: sa.Engine) -> None:
    store = SqlEventStore(engine)
    view = _seed(store)
    at = T0 + timedelta(hours=1)
    plain = _request(store, view, "acme", at, 100, 10, 0)
    # Requests routed in regions: the same decide path, the region on the route.
    for region in ("eu-west", "eu-west", "us-east"):
        rid = "req_" + uuid.uuid4().hex
        state, batch = RequestState(), []  # type: ignore[var-annotated]
        for command, when in (
            (AdmitRequest(rid, "acme", "key-1", MODEL, "standard", "edge-1",
                          Estimate(100, 500, 1_000_000, 40_000)), at),
            (RouteRequest("replica-1", 100_000, request_id=rid, region=region), at),
            (CompleteRequest(100, 10, 0, "stop", 50, 20_000, request_id=rid), at),
            (BillUsage(view.price(MODEL, at), request_id=rid), at),
        ):  # fmt: skip
            for event in decide(state, command):  # type: ignore[arg-type]
                batch.append(_new(rid, "acme", when, event))
                state = evolve_event(state, event, when)
        store.append(rid, 0, batch)
    _project(engine, store)
    rows = FinanceQueries(engine).usage("acme", T0, T0 + timedelta(days=1), None, "region")
    by_region = {r["region"]: r["requests"] for r in rows}
    assert by_region == {"": 1, "eu-west": 2, "us-east": 1}, rows
    with engine.connect() as conn:
        viewed = conn.execute(
            sa.text(
                "SELECT region, requests FROM finance_usage_by_region WHERE tenant = 'acme' "
                "ORDER BY region"
            )
        ).all()
        logged = conn.execute(
            sa.text("SELECT region, retention FROM request_log WHERE request_id = :r"),
            {"r": plain},
        ).one()
    assert [tuple(r) for r in viewed] == [("", 1), ("eu-west", 2), ("us-east", 1)]
    assert tuple(logged) == ("", "standard")

"""Every gap alarms (DESIGN §4 invariant 14), end to end: `tollgate serve` bills a real request,
then billing is broken on purpose — a request is written to its store for a model no price was
ever set for, so the billing fold cannot bill it — and within seconds the edge's /readyz is 503
naming the request, /metrics carries the gap and `tollgate status` exits 2."""

from __future__ import annotations

import subprocess
import uuid
from datetime import UTC, datetime

import httpx
import pytest

from tests import builders as b
from tests.e2e.conftest import FAST, MODEL, REPO, TOLLGATE, auth, poll, running_server, short_body
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import AdmitRequest, CompleteRequest, RouteRequest
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

pytestmark = pytest.mark.e2e


def _unbillable_request(db_url: str) -> str:
    rid = "req_" + uuid.uuid4().hex
    at = datetime.now(UTC)
    events = b.decided(
        AdmitRequest(
            rid, "demo-standard", "key-1", "never-priced-2026-01", "standard", "edge-x",
            Estimate(100, 50, 1_000, 40_000),
        ),
        RouteRequest("replica-0", 0, request_id=rid),
        CompleteRequest(100, 42, 0, "stop", 30, 20_000, request_id=rid),
        at=at,
    )  # fmt: skip
    engine = create_engine_from_url(db_url)
    try:
        SqlEventStore(engine).append(
            rid, 0, [NewEvent(str(uuid.uuid4()), rid, "demo-standard", at, e) for e in events]
        )
    finally:
        engine.dispose()
    return rid


def test_billing_broken_on_purpose_alarms_on_readyz_metrics_and_status(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_UNBILLED_ALARM_S", "2")
    with running_server(tmp_path_factory, "alarms", [(MODEL, FAST)]) as server:
        key = server.keys["demo-standard"]
        ok = httpx.post(
            f"{server.base}/v1/chat/completions", json=short_body(), headers=auth(key), timeout=30
        )
        assert ok.status_code == 200

        def metric(name: str) -> float:
            text = httpx.get(f"{server.base}/metrics", timeout=10).text
            line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
            return float(line.split()[1])

        # Billed: the reconciliation has run and found nothing.
        last_run = "tollgate_reconciliation_last_run_timestamp_seconds"
        poll("a reconciliation", lambda: metric(last_run) > 0, timeout=30, every=0.5)
        # The request's bill may land a moment after the first reconciliation: then the next.
        poll("its bill reconciled", lambda: metric("tollgate_unbilled_terminals") == 0,
             timeout=30, every=0.5)  # fmt: skip
        assert httpx.get(f"{server.base}/readyz", timeout=10).status_code == 200

        rid = _unbillable_request(server.db_url)

        def alarmed() -> bool:
            r = httpx.get(f"{server.base}/readyz", timeout=10)
            return r.status_code == 503 and any(
                p.startswith("pipeline: billing:") and rid in p for p in r.json()["problems"]
            )

        poll("/readyz 503 naming the unbilled request", alarmed, timeout=30, every=0.5)
        assert metric("tollgate_unbilled_terminals") == 1
        assert metric("tollgate_unbilled_terminal_oldest_age_seconds") >= 2
        status = subprocess.run(
            [*TOLLGATE, "status", "--database-url", server.db_url, "--unbilled-alarm-after", "2"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 2, status.stdout + status.stderr
        assert "ALARMS:" in status.stdout and rid in status.stdout

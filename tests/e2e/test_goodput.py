"""Goodput live and replayed: the edge's counters on /metrics and `GET /v1/billing/goodput`
(the request log, a projection of the events) classify the same requests the same way."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, Server, auth, poll, short_body

pytestmark = pytest.mark.e2e


def live_counts(server: Server, tenant: str) -> dict[tuple[str, str], int]:
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    counts: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("tenant") != tenant or not sample.name.endswith("_total"):
                continue
            if sample.name == "tollgate_requests_attained_total":
                key = (sample.labels["model"], "attained")
            elif sample.name == "tollgate_requests_not_attained_total":
                key = (sample.labels["model"], sample.labels["outcome"])
            else:
                continue
            counts[key] = counts.get(key, 0) + int(sample.value)
    return counts


def test_live_counters_equal_the_replay_over_the_same_requests(server: Server) -> None:
    start = datetime.now(UTC) - timedelta(minutes=1)
    tenant = server.new_tenant("goodput", rpm=6)
    statuses = []
    for i in range(9):  # six admitted, three refused by the tenant's own quota
        body = short_body(stream=bool(i % 2))
        r = httpx.post(f"{server.base}/v1/chat/completions", headers=auth(tenant.secret),
                       json=body, timeout=30)
        statuses.append(r.status_code)
    unknown = httpx.post(f"{server.base}/v1/chat/completions", headers=auth(tenant.secret),
                         json=short_body(model="no-such-model"), timeout=30)
    assert sorted(statuses) == [200] * 6 + [429] * 3 and unknown.status_code == 404

    def logged() -> bool:
        rows = server.query(
            "SELECT count(*) AS n FROM request_log WHERE tenant_id = ? AND finished_at IS NOT NULL",
            (tenant.name,),
        )
        return rows[0]["n"] == 10

    poll("the ten requests in the request log", logged, timeout=30)
    replay = httpx.get(
        f"{server.base}/v1/billing/goodput",
        params={"tenant": tenant.name, "group_by": "tenant,tier,model",
                "from": start.isoformat(), "to": (datetime.now(UTC) + timedelta(minutes=1))
                .isoformat()},
        headers=auth(server.keys["finance"]), timeout=30,
    )
    assert replay.status_code == 200, replay.text
    replayed: dict[tuple[str, str], int] = {}
    for row in replay.json()["data"]:
        assert row["tenant"] == tenant.name and row["tier"] == "standard"
        for outcome in ("attained", "missed_ttft", "missed_tpot", "cancelled", "failed",
                        "lease_expired", "refused_capacity", "shed", "refused_quota", "invalid"):
            if row[outcome]:
                replayed[(row["model"], outcome)] = row[outcome]
    assert sum(replayed.values()) == 10
    assert replayed[(MODEL, "refused_quota")] == 3
    assert replayed[("no-such-model", "invalid")] == 1
    # Live, a model the fleet does not serve is labelled `other` (a client's name never becomes
    # a series); the replay keeps the name asked for.
    served = {model for model, _ in replayed if model != "no-such-model"}
    assert live_counts(server, tenant.name) == {
        (model if model in served else "other", outcome): n
        for (model, outcome), n in replayed.items()
    }

    csv = httpx.get(f"{server.base}/v1/billing/goodput",
                    params={"tenant": tenant.name, "group_by": "hour", "format": "csv"},
                    headers=auth(tenant.secret), timeout=30)
    assert csv.status_code == 200 and csv.text.startswith("hour,attained,")
    bad = httpx.get(f"{server.base}/v1/billing/goodput", params={"group_by": "planet"},
                    headers=auth(server.keys["finance"]), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"

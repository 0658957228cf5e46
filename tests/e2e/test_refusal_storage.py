"""Issue 27, item 3: quota refusals write the permanent log within a bound per key. Before: 5,000
requests from a free key over its requests/min added 5,185 events and 5,000 request_log rows
(909 B each) in 11 s. Now the first refusals of a key in each minute are recorded one by one and
the rest counted (`domain/refusals.py`), and every one of them stays countable: goodput's
`refused_quota` equals the 429s the client saw, from the closed window's count (recorded on the
edge's tick) and from the open one's (recorded when the edge stops)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server, short_body
from tollgate_llm.domain.refusals import MIN_FULL_REFUSALS_PER_WINDOW, REFUSAL_WINDOW_S

pytestmark = pytest.mark.e2e

FLOOD = 400


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "refusal-storage", [(MODEL, FAST)]) as s:
        yield s


def _flood(server: Server, secret: str) -> tuple[int, int, set[int]]:
    """FLOOD requests as fast as one connection sends them: (200s, quota 429s, windows hit)."""
    ok = refused = 0
    windows: set[int] = set()
    with httpx.Client(base_url=server.base, headers=auth(secret), timeout=30) as client:
        for _ in range(FLOOD):
            windows.add(int(time.time()) // REFUSAL_WINDOW_S)
            r = client.post("/v1/chat/completions", json=short_body())
            windows.add(int(time.time()) // REFUSAL_WINDOW_S)
            if r.status_code == 200:
                ok += 1
            else:
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
                refused += 1
    return ok, refused, windows


def _stored(server: Server, tenant: str) -> tuple[int, int, int, int]:
    """(RequestRejected events, counted refusals, request_log rows, bytes of all of them)."""
    events = server.query(
        "SELECT type, length(payload) AS n, payload FROM events WHERE tenant_id = ? AND type IN "
        "('RequestRejected', 'RefusalsCounted')", (tenant,),
    )  # fmt: skip
    rows = server.query(
        "SELECT count(*) AS n, coalesce(sum(refusals), 0) AS counted FROM request_log "
        "WHERE tenant_id = ? AND status = 'rejected'", (tenant,),
    )[0]  # fmt: skip
    rejected = sum(e["type"] == "RequestRejected" for e in events)
    counted = int(rows["counted"])
    return rejected, counted, int(rows["n"]), sum(e["n"] for e in events)


def _goodput_refused(server: Server, tenant: str) -> int:
    now = datetime.now(UTC)
    r = httpx.get(
        f"{server.base}/v1/billing/goodput",
        params={"tenant": tenant, "group_by": "tenant", "from": (now - timedelta(hours=1))
                .isoformat(), "to": (now + timedelta(hours=1)).isoformat()},  # fmt: skip
        headers=auth(server.keys["finance"]), timeout=30,
    )
    assert r.status_code == 200, r.text
    return sum(row["refused_quota"] for row in r.json()["data"])


def test_a_refusal_flood_stores_a_bounded_amount_and_every_refusal_is_counted(
    quiet: Server,
) -> None:
    rpm = 5
    tenant = quiet.new_tenant("flood", plan="free", rpm=rpm)
    ok, refused, windows = _flood(quiet, tenant.secret)
    assert ok >= rpm and refused >= FLOOD - 2 * rpm, (ok, refused)

    # The window(s) of the flood close; the edge records their counts on its next tick.
    def all_counted() -> bool:
        rejected, counted, _, _ = _stored(quiet, tenant.name)
        return rejected + counted == refused

    poll("the flood's refusals recorded or counted", all_counted,
         timeout=REFUSAL_WINDOW_S * (max(windows) + 1) - time.time() + 15)  # fmt: skip
    rejected, counted, rows, stored = _stored(quiet, tenant.name)
    bound = MIN_FULL_REFUSALS_PER_WINDOW * len(windows)
    assert rejected <= bound, f"{rejected} refusals recorded one by one, bound {bound}"
    assert rows <= bound + 4 * len(windows)  # plus a counted row per (model, tier, reason)
    assert _goodput_refused(quiet, tenant.name) == refused
    print(f"refusal flood: {FLOOD} requests from a {rpm} rpm key, {refused} refused (429) in "
          f"{len(windows)} window(s): {rejected} recorded one by one, {counted} counted in "
          f"{rows - rejected} row(s); {stored} B of events, {stored / refused:.0f} B per refusal")

    # The open window's count when the edge stops: recorded before its writer closes.
    ok2, refused2, _ = _flood(quiet, tenant.secret)
    quiet.stop()
    quiet.start()
    poll("the open window's refusals counted at the stop",
         lambda: sum(_stored(quiet, tenant.name)[:2]) == refused + refused2,
         timeout=30)  # fmt: skip
    assert _goodput_refused(quiet, tenant.name) == refused + refused2

"""The router end to end (issue 32): a tenant opts in with `tollgate routing allow`, sends
traffic and feedback over HTTP, and `auto` moves to the small model once the tenant's own scores
prove it meets the bar; the answer says where it went, the bill is the small model's, finance
sees the saving; without consent nothing is routed; every decision is in the replay."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, SLOW_MODEL, Server, auth, running_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "routing", [(MODEL, FAST), (SLOW_MODEL, FAST)]) as s:
        yield s


def ask(server: Server, secret: str, model: str = "auto") -> httpx.Response:
    body = {"model": model, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Summarise this for me please."}]}  # fmt: skip
    return httpx.post(f"{server.base}/v1/chat/completions", headers=auth(secret), json=body,
                      timeout=30)  # fmt: skip


def score(server: Server, secret: str, request_id: str, value: float) -> None:
    r = httpx.post(f"{server.base}/v1/feedback", headers=auth(secret),
                   json={"request_id": request_id, "score": value}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_tenant_that_opts_in_is_routed_to_the_small_model_its_feedback_proves(
    fleet: Server,
) -> None:
    server = fleet
    tenant = server.new_tenant("router")
    refused = ask(server, tenant.secret)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"

    out = server.cli(
        "routing",
        "allow",
        "--tenant",
        tenant.name,
        "--models",
        "llama-3.1-8b,llama-3.1-70b",
        "--quality-bar",
        "0.8",
        "--exploration",
        "0",
    )
    assert "allowed" in out

    def served_by_reference() -> httpx.Response:
        r = ask(server, tenant.secret)
        assert r.status_code in (200, 404), r.text
        return r

    first = served_by_reference()
    for _ in range(50):  # the running server follows the control plane within 0.2 s
        if first.status_code == 200:
            break
        first = served_by_reference()
    assert first.headers["x-tollgate-routed-to"] == SLOW_MODEL  # no evidence: the reference
    assert first.headers["x-tollgate-routing-reason"] == "below_bar"
    assert first.json()["model"] == SLOW_MODEL

    # The tenant's own traffic on the small model, scored well.
    for _ in range(40):
        r = ask(server, tenant.secret, MODEL)
        assert r.status_code == 200 and "x-tollgate-routed-to" not in r.headers
        score(server, tenant.secret, r.headers["x-request-id"], 0.95)

    routed = ask(server, tenant.secret)
    assert routed.status_code == 200, routed.text
    assert routed.headers["x-tollgate-routed-to"] == MODEL
    assert routed.headers["x-tollgate-routing-reason"] == "meets_bar"
    assert routed.json()["model"] == MODEL
    rid = routed.headers["x-request-id"]
    entry = server.wait_billed(rid)
    assert entry["model"] == MODEL  # billed at the serving model's price
    decision = next(p for kind, p in server.events(rid) if kind == "RequestModelRouted")
    assert decision["asked_model"] == "auto" and decision["reference_model"] == SLOW_MODEL
    assert decision["estimate_ppm"] >= decision["bar_ppm"] == 800_000
    assert len(decision["alternatives"]) == 2
    score(server, tenant.secret, rid, 0.9)

    replay = server.cli("replay", rid)
    assert f"routed: asked auto, served {MODEL} (meets_bar" in replay

    month = datetime.now(UTC).strftime("%Y-%m")
    server.wait_billed(first.headers["x-request-id"])
    lines = server.cli("routing", "savings", "--tenant", tenant.name, "--month", month)
    header, row = lines.strip().splitlines()
    values = dict(zip(header.split(","), row.split(","), strict=True))
    assert (values["routed_requests"], values["routed_away"]) == ("2", "1")
    assert int(values["saving_micros"]) > 0
    assert int(values["reference_micros"]) > int(values["billed_micros"])
    assert float(values["mean_score_routed_away"]) == 0.9

    # Consent revoked: `auto` is an unknown model again.
    server.cli("routing", "revoke", "--tenant", tenant.name)

    def revoked() -> bool:
        return ask(server, tenant.secret).status_code == 404

    assert any(revoked() for _ in range(50))


def test_another_tenant_s_feedback_never_routes_this_one(fleet: Server) -> None:
    server = fleet
    generous, cautious = server.new_tenant("generous"), server.new_tenant("cautious")
    for _ in range(30):
        r = ask(server, generous.secret, MODEL)
        score(server, generous.secret, r.headers["x-request-id"], 1.0)
    server.cli(
        "routing",
        "allow",
        "--tenant",
        cautious.name,
        "--models",
        "llama-3.1-8b,llama-3.1-70b",
        "--quality-bar",
        "0.8",
        "--exploration",
        "0",
    )
    answers = [ask(server, cautious.secret) for _ in range(50)]
    served = [a.headers.get("x-tollgate-routed-to") for a in answers if a.status_code == 200]
    assert served and set(served) == {SLOW_MODEL}


def test_the_reference_model_routed_by_policy_the_savings_over_http_and_the_counter(
    fleet: Server,
) -> None:
    server = fleet
    tenant, other = server.new_tenant("saver"), server.new_tenant("onlooker")
    server.cli(
        "routing", "allow", "--tenant", tenant.name, "--models", "llama-3.1-8b,llama-3.1-70b",
        "--quality-bar", "0.8", "--exploration", "0", "--route-reference",
    )  # fmt: skip
    for _ in range(40):
        r = ask(server, tenant.secret, MODEL)
        score(server, tenant.secret, r.headers["x-request-id"], 0.95)

    def routed() -> httpx.Response | None:
        r = ask(server, tenant.secret, SLOW_MODEL)  # the reference model, named
        assert r.status_code == 200, r.text
        return r if r.headers.get("x-tollgate-routed-to") == MODEL else None

    answer = next((r for r in (routed() for _ in range(50)) if r is not None), None)
    assert answer is not None and answer.json()["model"] == MODEL
    rid = answer.headers["x-request-id"]
    decision = next(p for kind, p in server.events(rid) if kind == "RequestModelRouted")
    assert (decision["asked_model"], decision["served_model"]) == (SLOW_MODEL, MODEL)
    server.wait_billed(rid)

    month = datetime.now(UTC).strftime("%Y-%m")
    url = f"{server.base}/v1/routing/savings"
    mine = httpx.get(url, params={"month": month}, headers=auth(tenant.secret), timeout=30)
    assert mine.status_code == 200, mine.text
    (row,) = mine.json()["data"]
    assert row["tenant"] == tenant.name and row["routed_away"] >= 1
    assert row["saving_micros"] == row["reference_micros"] - row["billed_micros"] > 0
    # A customer reads its own tenant only; finance reads any, as the other billing routes.
    theirs = httpx.get(url, params={"month": month, "tenant": tenant.name},
                       headers=auth(other.secret), timeout=30)  # fmt: skip
    assert theirs.status_code == 403 and theirs.json()["error"]["param"] == "tenant"
    assert httpx.get(url, params={"month": month}, headers=auth(other.secret),
                     timeout=30).json()["data"] == []  # fmt: skip
    finance = httpx.get(url, params={"month": month, "tenant": tenant.name},
                        headers=auth(server.keys["finance"]), timeout=30)  # fmt: skip
    assert finance.json()["data"] == [row]
    bad = httpx.get(url, params={"month": "2026-13"}, headers=auth(tenant.secret), timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "month"

    metrics = httpx.get(f"{server.base}/metrics", timeout=30).text
    counted = (f'tollgate_requests_routed_total{{asked="{SLOW_MODEL}",reason="meets_bar",'
               f'served="{MODEL}"}}')  # fmt: skip
    assert counted in metrics


def test_asking_the_same_again_on_the_large_model_scores_the_small_model_s_answer(
    fleet: Server,
) -> None:
    server = fleet
    tenant = server.new_tenant("reasker")
    server.cli(
        "routing", "allow", "--tenant", tenant.name, "--models", "llama-3.1-8b,llama-3.1-70b",
        "--quality-bar", "0.8", "--exploration", "0",
    )  # fmt: skip
    for _ in range(40):
        r = ask(server, tenant.secret, MODEL)
        score(server, tenant.secret, r.headers["x-request-id"], 0.95)
    first = next(
        r for r in (ask(server, tenant.secret) for _ in range(50))
        if r.status_code == 200 and r.headers["x-tollgate-routed-to"] == MODEL
    )  # fmt: skip
    again = ask(server, tenant.secret, SLOW_MODEL)  # the same messages, by name, at once
    assert again.status_code == 200 and "x-tollgate-routed-to" not in again.headers
    signal = server.wait_event(first.headers["x-request-id"], "FeedbackRecorded")
    assert (signal["source"], signal["score_ppm"], signal["model"]) == ("reasked", 0, MODEL)
    assert signal["routed_from"] == SLOW_MODEL

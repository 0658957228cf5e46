"""`POST /v1/feedback` over real HTTP (issue 32 item 1): a customer scores its own ended request,
once; the score is an event on the request's stream, in the replay; another tenant's id is
answered exactly like an unknown one; a client leaving a stream is an implicit signal."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.conftest import SLOW_MODEL, Server, auth, long_body, poll, short_body

pytestmark = pytest.mark.e2e


def chat(server: Server, secret: str) -> str:
    r = httpx.post(f"{server.base}/v1/chat/completions", headers=auth(secret),
                   json=short_body(), timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


def feedback(server: Server, secret: str, **body: object) -> httpx.Response:
    return httpx.post(f"{server.base}/v1/feedback", headers=auth(secret), json=body, timeout=30)


def test_a_customer_scores_its_own_request_once_and_support_sees_it(server: Server) -> None:
    tenant = server.new_tenant("fb")
    rid = chat(server, tenant.secret)
    r = feedback(server, tenant.secret, request_id=rid, score=0.75, label="good")
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "feedback", "request_id": rid, "score": 0.75, "label": "good",
                        "recorded": True}  # fmt: skip
    events = server.events(rid)
    recorded = [payload for kind, payload in events if kind == "FeedbackRecorded"]
    assert len(recorded) == 1
    assert recorded[0]["score_ppm"] == 750_000 and recorded[0]["source"] == "client"
    assert recorded[0]["model"] and recorded[0]["task_class"].startswith("p")

    # A retry answers what was recorded, and records nothing more.
    again = feedback(server, tenant.secret, request_id=rid, score=0.75, label="good")
    assert again.status_code == 200 and again.json()["recorded"] is False
    # Another score is a conflict naming the field.
    other = feedback(server, tenant.secret, request_id=rid, score=0.1, label="good")
    assert other.status_code == 409
    assert other.json()["error"]["param"] == "score"
    assert [kind for kind, _ in server.events(rid)].count("FeedbackRecorded") == 1

    # The customer's timeline and support's replay show it.
    timeline = httpx.get(f"{server.base}/v1/requests/{rid}/events",
                         headers=auth(tenant.secret), timeout=30).json()  # fmt: skip
    assert timeline["feedback"] == {"score": 0.75, "label": "good"}
    assert "FeedbackRecorded" in [step["type"] for step in timeline["events"]]
    assert "feedback: {'score': 0.75, 'label': 'good'}" in server.cli("replay", rid)


def test_another_tenant_s_request_is_answered_like_an_unknown_one(server: Server) -> None:
    owner, other = server.new_tenant("fb-own"), server.new_tenant("fb-other")
    rid = chat(server, owner.secret)
    theirs = feedback(server, other.secret, request_id=rid, score=0.0)
    unknown_id = "req_" + uuid.uuid4().hex
    unknown = feedback(server, other.secret, request_id=unknown_id, score=0.0)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == {
        **unknown.json(),
        "error": {**unknown.json()["error"],
                  "message": unknown.json()["error"]["message"].replace(unknown_id, rid)},
    }  # fmt: skip
    assert "FeedbackRecorded" not in [kind for kind, _ in server.events(rid)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"request_id": "req_" + "0" * 32, "score": 1.5}, "score"),
        ({"request_id": "req_" + "0" * 32, "score": -0.1}, "score"),
        ({"request_id": "req_" + "0" * 32, "score": 0.5, "label": "x" * 65}, "label"),
        ({"request_id": "nope", "score": 0.5}, "request_id"),
        ({"request_id": "req_" + "0" * 32}, "score"),
        ({"request_id": "req_" + "0" * 32, "score": 0.5, "comment": "hi"}, "comment"),
    ],
)
def test_a_malformed_feedback_is_a_400_naming_its_field(
    server: Server, body: dict[str, object], param: str
) -> None:
    r = feedback(server, server.keys["demo-standard"], **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_client_that_leaves_a_stream_it_was_reading_is_an_implicit_signal(
    server: Server,
) -> None:
    tenant = server.new_tenant("fb-cancel")
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            f"{server.base}/v1/chat/completions",
            headers=auth(tenant.secret),
            json=long_body(SLOW_MODEL, tokens=500, stream=True),
        ) as stream,
    ):
        assert stream.status_code == 200
        rid = stream.headers["x-request-id"]
        lines = stream.iter_lines()
        poll("a content chunk", lambda: "content" in next(lines))
    signal = server.wait_event(rid, "FeedbackRecorded")
    assert signal["source"] == "cancelled" and signal["score_ppm"] == 0
    # The customer's own score is still welcome afterwards.
    assert feedback(server, tenant.secret, request_id=rid, score=1.0).status_code == 200

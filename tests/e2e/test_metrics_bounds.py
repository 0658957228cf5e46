"""/metrics is bounded and can be closed (issue 27, item 6): model names a client chooses never
become label values (an unknown model is `other`), so 300 invented names add no series; with
`--metrics-token`, /metrics answers 401 without the token and the scrape with it."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, auth, running_server, short_body

pytestmark = pytest.mark.e2e


def _series(text: str) -> set[str]:
    return {line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_invented_model_names_add_no_series_and_the_token_closes_metrics(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    token = "scrape-secret-1"
    with running_server(
        tmp_path_factory, "metrics", [(MODEL, FAST)], ["--metrics-token", token]
    ) as server:
        base = server.base
        scrape = {"Authorization": f"Bearer {token}"}
        key = server.keys["demo-enterprise"]
        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.post("/v1/chat/completions", json=short_body(), headers=auth(key))
            before = _series(client.get("/metrics", headers=scrape).text)
            for i in range(300):
                r = client.post(
                    "/v1/chat/completions", json=short_body(model=f"invented-{i}"),
                    headers=auth(key),
                )  # fmt: skip
                assert r.status_code in (404, 429), r.text
            after_text = client.get("/metrics", headers=scrape).text
            after = _series(after_text)
            assert "invented-" not in after_text
            assert MODEL in after_text  # the known model is still named
            # What is new is a bounded set: the `other` series of the model-labelled metrics
            # and the events' and refusals' types (the first request's stream was still being
            # recorded at the first scrape), never one per name sent.
            new = after - before
            assert len(new) <= 60, sorted(new)

            missing = client.get("/metrics")
            assert missing.status_code == 401
            assert missing.json()["error"]["code"] == "invalid_metrics_token"
            wrong = client.get("/metrics", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401 and "invented" not in wrong.text

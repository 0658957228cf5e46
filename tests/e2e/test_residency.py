"""Issue 30, item 2, over real HTTP: replicas placed in a region (`--region`, as
`--replica MODEL=URL@REGION` does one by one), a tenant pinned there served and its
RequestRouted saying where, one pinned elsewhere refused 503 `region_unavailable` (nothing
routed), and the region in the replay, the request list and usage by region."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server, short_body

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def regional(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(
        tmp_path_factory, "residency", [(MODEL, FAST), (MODEL, FAST)],
        serve_args=["--region", "eu-west"],
    ) as s:  # fmt: skip
        yield s


def test_a_pinned_tenant_is_served_in_its_region_and_refused_outside_it(
    regional: Server,
) -> None:
    server = regional
    tenants = server.new_tenants({"eu": {}, "us": {}})
    server.cli(
        "residency", "set", "--tenant", tenants["eu"].name, "--regions", "eu-west,eu-central"
    )
    server.cli("residency", "set", "--tenant", tenants["us"].name, "--regions", "us-east")
    url = f"{server.base}/v1/chat/completions"

    def post(secret: str) -> httpx.Response:
        return httpx.post(url, json=short_body(), headers=auth(secret), timeout=30)

    refused = poll(
        "the server to apply the pin",
        lambda: (r := post(tenants["us"].secret)).status_code == 503 and r,
    )
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("region_unavailable", "capacity")
    assert "us-east" in error["message"] and "retry-after" in refused.headers
    rid = refused.headers["x-request-id"]
    rejected = server.wait_event(rid, "RequestRejected")
    assert rejected["reason"] == "capacity" and rejected["detail"].startswith("region_unavailable")
    assert "RequestRouted" not in server.event_types(rid)

    served = [post(tenants["eu"].secret) for _ in range(4)]
    assert [r.status_code for r in served] == [200] * 4
    for r in served:
        routed = server.wait_event(r.headers["x-request-id"], "RequestRouted")
        assert routed["region"] == "eu-west"
    server.wait_all_billed()

    first = served[0].headers["x-request-id"]
    timeline = json.loads(server.cli("replay", first, "--json"))
    assert (timeline["region"], timeline["retention"]) == ("eu-west", "standard")
    support = server.keys["support"]
    listed = httpx.get(
        f"{server.base}/v1/requests", params={"tenant": tenants["eu"].name},
        headers=auth(support), timeout=10,
    )  # fmt: skip
    assert listed.status_code == 200, listed.text
    assert {row["region"] for row in listed.json()["data"]} == {"eu-west"}
    usage = httpx.get(
        f"{server.base}/v1/billing/usage",
        params={"tenant": tenants["eu"].name, "group_by": "region"},
        headers=auth(server.keys["finance"]), timeout=10,
    ).json()  # fmt: skip
    assert [(row["region"], row["requests"]) for row in usage["data"]] == [("eu-west", 4)]

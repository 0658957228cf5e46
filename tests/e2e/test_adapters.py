"""Issue 30, item 1, over real HTTP: a tenant's LoRA adapter (`tollgate adapters register`)
served by simulated replicas started with LoRA on (`--enable-lora`, one slot each), asked for by
name by its tenant only (another tenant gets exactly what an unknown model gets), loaded on the
replica the router picks and kept there while it is used, billed at its base model's price
until it has its own, and named in the ledger, usage, invoice, request list and replay; revoked,
it is an unknown model again. Real vLLM: tests/e2e/test_real_vllm_adapters.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server, short_body
from tests.vllm.tiny_adapter import build

pytestmark = pytest.mark.e2e

LORA = {**FAST, "enable_lora": True, "max_loras": 1}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_server(tmp_path_factory, "adapters", [(MODEL, LORA), (MODEL, LORA)]) as s:
        yield s


def chat(server: Server, secret: str, model: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base}/v1/chat/completions", json=short_body(model, **extra),
        headers=auth(secret), timeout=30,
    )  # fmt: skip


def register(server: Server, tenant: str, name: str, path: Path, *flags: str) -> str:
    return server.cli(
        "adapters", "register", "--tenant", tenant, "--name", name, "--base", MODEL,
        "--path", str(path), *flags,
    )  # fmt: skip


def served_by(server: Server, response: httpx.Response) -> tuple[str, str]:
    """(replica id, the model the engine was asked for) of a served request."""
    rid = response.headers["x-request-id"]
    replica_id = server.wait_event(rid, "RequestRouted")["replica_id"]
    record = httpx.get(f"{server.replica(replica_id).url}/sim/requests/{rid}", timeout=5).json()
    return replica_id, record["adapter"]


def test_an_adapter_is_its_tenants_alone_and_billed_as_its_own(
    fleet: Server, tmp_path: Path
) -> None:
    server = fleet
    tenants = server.new_tenants({"acme": {}, "bolt": {}})
    acme, bolt = tenants["acme"], tenants["bolt"]
    out = register(server, acme.name, "support", build(tmp_path / "support", rank=8))
    assert "rank 8" in out  # read from the adapter's own adapter_config.json

    served = poll(
        "the edge to follow the registration",
        lambda: (r := chat(server, acme.secret, "support")).status_code == 200 and r,
    )
    assert served.json()["model"] == "support"
    rid = served.headers["x-request-id"]
    admitted = server.wait_event(rid, "RequestAdmitted")
    assert (admitted["model"], admitted["adapter"]) == (MODEL, "support")
    assert served_by(server, served)[1] == f"{acme.name}/support@1"
    base = chat(server, acme.secret, MODEL)
    assert base.status_code == 200

    # Another tenant: the answer a model that does not exist gets, word for word.
    theirs = chat(server, bolt.secret, "support")
    nobodys = chat(server, acme.secret, "support-nobody")
    assert theirs.status_code == nobodys.status_code == 404
    assert theirs.json() == json.loads(nobodys.text.replace("support-nobody", "support"))
    assert sorted(theirs.headers) == sorted(nobodys.headers)
    rejected = server.wait_event(theirs.headers["x-request-id"], "RequestRejected")
    assert (rejected["reason"], rejected["detail"]) == ("invalid", "unknown model")
    streamed = httpx.post(
        f"{server.base}/v1/chat/completions", json=short_body("support", stream=True),
        headers=auth(bolt.secret), timeout=30,
    )  # fmt: skip
    assert streamed.status_code == 404

    # Billed at the base model's price, then at its own once it has one.
    entry = server.wait_billed(rid)
    base_entry = server.wait_billed(base.headers["x-request-id"])
    assert entry["adapter"] == "support" and base_entry["adapter"] is None
    assert entry["prompt_micros_per_mtok"] == base_entry["prompt_micros_per_mtok"]
    server.cli("adapters", "price", "--tenant", acme.name, "--name", "support",
               "--prompt", "7", "--completion", "9", "--cached", "1")  # fmt: skip
    priced = poll(
        "the adapter's own price",
        lambda: (r := chat(server, acme.secret, "support")).status_code == 200
        and server.wait_billed(r.headers["x-request-id"])["prompt_micros_per_mtok"] == 7_000_000
        and r,
    )  # fmt: skip
    own = server.wait_billed(priced.headers["x-request-id"])
    assert (own["completion_micros_per_mtok"], own["cached_micros_per_mtok"]) == (
        9_000_000, 1_000_000,
    )  # fmt: skip
    server.wait_all_billed()

    finance = auth(server.keys["finance"])
    usage = httpx.get(
        f"{server.base}/v1/billing/usage", params={"tenant": acme.name, "group_by": "adapter"},
        headers=finance, timeout=10,
    ).json()["data"]  # fmt: skip
    by_adapter = {row["adapter"]: row["requests"] for row in usage}
    assert by_adapter[None] == 1 and by_adapter["support"] >= 2
    invoice = httpx.get(
        f"{server.base}/v1/billing/invoices/{acme.name}", headers=finance, timeout=10
    ).json()
    prices = {(line["adapter"], line["prompt_micros_per_mtok"]) for line in invoice["lines"]}
    assert ("support", 7_000_000) in prices
    assert (None, base_entry["prompt_micros_per_mtok"]) in prices
    listed = httpx.get(
        f"{server.base}/v1/requests", params={"tenant": acme.name},
        headers=auth(server.keys["support"]), timeout=10,
    ).json()["data"]  # fmt: skip
    assert {row["adapter"] for row in listed} == {"support", None}
    assert json.loads(server.cli("replay", rid, "--json"))["adapter"] == "support"

    # Revoked: an unknown model again, for its own tenant too.
    server.cli("adapters", "revoke", "--tenant", acme.name, "--name", "support")
    gone = poll(
        "the edge to follow the revocation",
        lambda: (r := chat(server, acme.secret, "support")).status_code == 404 and r,
    )
    assert gone.json()["error"]["code"] == "model_not_found"
    server.assert_lifecycle()


def test_routing_keeps_an_adapter_where_it_is_loaded_within_the_slots(
    fleet: Server, tmp_path: Path
) -> None:
    server = fleet
    tenant = server.new_tenant("slots")
    names = ("alpha", "beta", "gamma")
    for seed, name in enumerate(names):
        register(server, tenant.name, name, build(tmp_path / name, seed=seed))
    poll(
        "the edge to follow the registrations",
        lambda: chat(server, tenant.secret, names[-1]).status_code == 200,
    )
    for name in names:
        first = chat(server, tenant.secret, name)
        assert first.status_code == 200, first.text
        home = served_by(server, first)[0]
        # Held where it was loaded: the router sends it there again, not to load it elsewhere.
        again = [chat(server, tenant.secret, name) for _ in range(4)]
        assert [r.status_code for r in again] == [200] * 4
        assert {served_by(server, r)[0] for r in again} == {home}
    for replica in server.replicas:  # one slot each (--max-loras 1): never two held at once
        listed = httpx.get(f"{replica.url}/v1/models", timeout=5).json()["data"]
        assert len([c for c in listed if c["parent"] == MODEL]) <= 1, listed
    server.assert_lifecycle()


def test_the_model_list_shows_a_tenant_its_own_adapters_and_no_one_elses(
    fleet: Server, tmp_path: Path
) -> None:
    server = fleet
    tenants = server.new_tenants({"list-a": {}, "list-b": {}})
    a, b = tenants["list-a"], tenants["list-b"]
    # Given an adapter of each tenant, one of A's kept to a project its key is not in, and one
    # revoked (only A's first is asked for: the others' paths are never read)
    server.cli("workspaces", "create", "w", "--tenant", a.name)
    server.cli("projects", "create", "p", "--tenant", a.name, "--workspace", "w")
    for tenant, name, *flags in [
        (a.name, "a-support"), (a.name, "a-kept", "--project", "p"), (a.name, "a-gone"),
        (b.name, "b-support"),
    ]:  # fmt: skip
        path = build(tmp_path / name) if name == "a-support" else f"/srv/adapters/{name}"
        server.cli("adapters", "register", "--tenant", tenant, "--name", name, "--base", MODEL,
                   "--path", str(path), "--rank", "4", *flags)  # fmt: skip
    server.cli("adapters", "revoke", "--tenant", a.name, "--name", "a-gone")

    def listed(secret: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{server.base}/v1/models", headers=auth(secret), timeout=10)
        assert r.status_code == 200, r.text
        return list(r.json()["data"])

    def adapters_of(secret: str) -> dict[str, dict[str, Any]]:
        return {m["id"]: m for m in listed(secret) if m["owned_by"] != "tollgate"}

    # (the revoke is the last control event: until it is followed, A still lists a-gone)
    poll("the edge to follow the registrations and the revoke",
         lambda: set(adapters_of(b.secret)) == {"b-support"}
         and set(adapters_of(a.secret)) == {"a-support"})  # fmt: skip
    # Then each tenant sees the models on sale and its own adapters only, with their parent
    mine = adapters_of(a.secret)
    assert set(mine) == {"a-support"}
    assert mine["a-support"] == {
        **mine["a-support"],
        "object": "model",
        "owned_by": a.name,
        "parent": MODEL,
    }
    assert set(adapters_of(b.secret)) == {"b-support"}
    assert adapters_of(b.secret)["b-support"]["owned_by"] == b.name
    on_sale = [m for m in listed(a.secret) if m["owned_by"] == "tollgate"]
    assert [m["id"] for m in on_sale] == [MODEL] and "parent" not in on_sale[0]
    # A tenant with no adapter sees the models on sale alone, as before
    assert [m["id"] for m in listed(server.keys["demo-standard"])] == [MODEL]
    # And what is listed is what the tenant may ask for: its adapter is served, B's is not
    assert chat(server, a.secret, "a-support").status_code == 200
    assert chat(server, a.secret, "b-support").status_code == 404
    assert chat(server, a.secret, "a-kept").status_code == 404

"""Issue 30, items 4, 5 and 6 over real HTTP: the admin API (`/v1/admin/...`) does what the CLI
does to tenants, keys, limits (per end user too), budgets, prices and models, through the same
command handler (the same events, the same validation), with the calling admin key as the actor
of every change; the audit trail (`GET /v1/audit`, `tollgate audit`) names it, with each value's
old and new. On a SQLite `tollgate serve` and on one over PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import POSTGRES_URL
from tests.e2e.conftest import FAST, MODEL, Server, auth, poll, running_server, start_replica
from tests.e2e.test_budgets_postgres import PostgresServer

pytestmark = pytest.mark.e2e


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:  # fmt: skip
    if request.param == "sqlite":
        with running_server(tmp_path_factory, "admin", [(MODEL, FAST)]) as s:
            yield s
        return
    base = make_url(POSTGRES_URL)
    conninfo = base.set(drivername="postgresql").render_as_string(hide_password=False)
    schema = f"t_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(conninfo, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {POSTGRES_URL}: {exc}")
    url = base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        tmp = tmp_path_factory.mktemp("admin-pg")
        pg = PostgresServer(tmp, [start_replica(tmp, MODEL, seed=11, **FAST)],
                            serve_args=["--database-url", url], url=url)  # fmt: skip
        try:
            yield pg.start()
        finally:
            pg.stop()
            for r in pg.replicas:
                r.stop()
            admin.execute("SET lock_timeout = '10s'")
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def call(server: Server, method: str, path: str, key: str, body: Any = None,
         **params: Any) -> httpx.Response:  # fmt: skip
    return httpx.request(method, server.base + path, headers=auth(key), json=body,
                         params=params or None, timeout=30)  # fmt: skip


def ok(server: Server, method: str, path: str, key: str, body: Any = None,
       **params: Any) -> dict[str, Any]:  # fmt: skip
    r = call(server, method, path, key, body, **params)
    assert r.status_code == 200, (method, path, r.status_code, r.text)
    assert r.headers["x-request-id"]
    return dict(r.json())


def error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    detail = dict(r.json()["error"])
    assert detail["param"] == param, detail
    return detail


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def admin(server: Server) -> dict[str, str]:
    """An admin key issued through the admin API itself by the demo's: its id is the actor."""
    issued = ok(server, "POST", "/v1/admin/tenants/tollgate-ops/keys", server.keys["admin"],
                {"scope": "admin"})  # fmt: skip
    poll(
        "the new admin key to be known",
        lambda: call(server, "GET", "/v1/admin/tenants", issued["secret"]).status_code == 200,
    )
    return {"id": issued["id"], "secret": issued["secret"]}


def test_an_admin_key_runs_a_tenant_from_creation_to_revoked_key(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    tenant = name("adm")
    # Given a tenant created over HTTP
    created = ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant, "plan": "free"})
    assert created == {**created, "object": "tenant", "id": tenant, "plan": "free"}
    assert tenant in {t["id"] for t in ok(server, "GET", "/v1/admin/tenants", key)["data"]}
    assert ok(server, "POST", f"/v1/admin/tenants/{tenant}/plan", key,
              {"plan": "standard"})["plan"] == "standard"  # fmt: skip
    # When it gets a customer key, shown once
    issued = ok(server, "POST", f"/v1/admin/tenants/{tenant}/keys", key, {})
    secret = issued["secret"]
    assert issued["scope"] == "customer" and secret.startswith("tg_")
    # Then the key works, and only its hash is stored: the secret is in no event
    server.wait_key(secret)
    digest = hashlib.sha256(secret.encode()).hexdigest()
    stored = server.query("SELECT payload FROM events WHERE stream_id = ?", (f"tenant-{tenant}",))
    payloads = " ".join(r["payload"] for r in stored)
    assert digest in payloads and secret not in payloads
    # And its limits, hierarchy and budgets are set like the CLI sets them
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/limits", key, {"model": "*", "rpm": 7})
    shown = ok(server, "GET", f"/v1/admin/tenants/{tenant}/limits", key, model=MODEL)
    assert (shown["rpm"], shown["plan"]) == (7, "standard")
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/workspaces", key, {"name": "research"})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/projects", key,
       {"name": "bot", "workspace": "research"})  # fmt: skip
    moved = ok(server, "POST", f"/v1/admin/tenants/{tenant}/keys/{issued['id']}/project", key,
               {"project": "bot"})  # fmt: skip
    assert moved["project"] == "bot"
    recorded = ok(server, "POST", f"/v1/admin/tenants/{tenant}/limits", key,
                  {"model": "*", "project": "bot", "tpm": 1000})  # fmt: skip
    assert (recorded["level"], recorded["level_id"], recorded["recorded"]) == (
        "project",
        "bot",
        {"tpm": 1000},
    )
    budget = ok(server, "POST", f"/v1/admin/tenants/{tenant}/budgets", key,
                {"period": "month", "amount": "25.50", "project": "bot"})  # fmt: skip
    assert (budget["amount_micros"], budget["amount"], budget["changed"]) == (
        25_500_000, "25.5", True,
    )  # fmt: skip
    # `usd`, the field's deprecated old name, still sets the same budget
    again = ok(server, "POST", f"/v1/admin/tenants/{tenant}/budgets", key,
               {"period": "month", "usd": "25.5", "project": "bot"})  # fmt: skip
    assert (again["amount_micros"], again["changed"]) == (25_500_000, False)
    zone = ok(
        server, "POST", f"/v1/admin/tenants/{tenant}/time-zone", key, {"zone": "Europe/Paris"}
    )
    assert zone["changed"] is True
    # When the key is revoked, every edge refuses it
    revoked = ok(server, "POST", f"/v1/admin/tenants/{tenant}/keys/{issued['id']}/revoke", key)
    assert revoked["revoked"] is True
    server.wait_key(secret, valid=False)


def test_prices_and_models_over_http(server: Server, admin: dict[str, str]) -> None:
    key = admin["secret"]
    model = f"org/tiny-{uuid.uuid4().hex[:6]}-2026-05"  # a slash: the GET path holds it
    registered = ok(server, "POST", "/v1/admin/models", key, {
        "model": model, "layers": 2, "kv_heads": 2, "head_dim": 16, "dtype_bytes": 2,
        "max_model_len": 2048,
    })  # fmt: skip
    assert registered["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2
    assert ok(server, "GET", f"/v1/admin/models/{model}", key)["layers"] == 2
    prices = {"model": model, "prompt": "0.15", "completion": "0.6", "cached": "0.075"}
    price = ok(server, "POST", "/v1/admin/prices", key, prices)
    assert (price["prompt_micros_per_mtok"], price["currency"]) == (150_000, "USD")
    flex = ok(
        server, "POST", "/v1/admin/prices/flex-discount", key, {"model": model, "percent": 50}
    )
    assert flex["discount_ppm"] == 500_000
    # A profile without its dimensions is refused naming what lacks, as the CLI's is
    r = call(server, "POST", "/v1/admin/models", key, {"model": model, "layers": 2})
    assert r.status_code == 400 and "--kv-heads" in r.json()["error"]["message"]


def audited(server: Server, tenant: str) -> list[tuple[str, str, str]]:
    """The tenant stream's audit records: (command, actor kind, actor), oldest first."""
    read = ("SELECT payload FROM events WHERE stream_id = ? AND type = 'ChangeAudited' "
            "ORDER BY stream_version")
    rows = server.query(read, (f"tenant-{tenant}",))
    records = [json.loads(r["payload"]) for r in rows]
    return [(r["command"], r["actor_kind"], r["actor"]) for r in records]


def test_adapters_over_http(server: Server, admin: dict[str, str]) -> None:
    key = admin["secret"]
    tenant = name("lora")
    ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/workspaces", key, {"name": "w"})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/projects", key,
       {"name": "bot", "workspace": "w"})  # fmt: skip
    adapters = f"/v1/admin/tenants/{tenant}/adapters"
    # Given an adapter registered over HTTP
    spec = {"name": "support", "base": MODEL, "path": "/srv/adapters/support", "rank": 8}
    registered = ok(server, "POST", adapters, key, {**spec, "projects": ["bot"]})
    assert registered == {
        **registered, "object": "adapter", "tenant": tenant, "name": "support", "base": MODEL,
        "rank": 8, "projects": ["bot"], "version": 1, "revoked_at": None, "priced": "base",
    }  # fmt: skip
    # Then it is listed and shown, as the CLI lists it
    listed = ok(server, "GET", adapters, key)
    assert [a["name"] for a in listed["data"]] == ["support"]
    assert ok(server, "GET", f"{adapters}/support", key)["engine_name"] == registered[
        "engine_name"
    ]
    cli_listed = json.loads(server.cli("adapters", "list", "--tenant", tenant))
    assert [a["name"] for a in cli_listed] == ["support"]
    # And re-registered with new weights, it is a new version; the same again changes nothing
    again = ok(server, "POST", adapters, key, {**spec, "path": "/srv/adapters/support-2"})
    assert (again["version"], again["projects"]) == (2, [])
    assert ok(server, "POST", adapters, key, {**spec, "path": "/srv/adapters/support-2"})[
        "version"
    ] == 2
    price = ok(server, "POST", f"{adapters}/support/price", key,
               {"prompt": "7", "completion": "9", "cached": "1"})  # fmt: skip
    assert (price["adapter"], price["prompt_micros_per_mtok"], price["currency"]) == (
        "support", 7_000_000, "USD",
    )  # fmt: skip
    assert ok(server, "GET", f"{adapters}/support", key)["priced"] == "own"
    revoked = ok(server, "POST", f"{adapters}/support/revoke", key)
    assert revoked["revoked_at"] is not None and revoked["changed"] is True
    assert ok(server, "POST", f"{adapters}/support/revoke", key)["changed"] is False
    # Every change is the CLI's event, audited with the key as its actor
    rows = server.query("SELECT type FROM events WHERE stream_id = ? ORDER BY stream_version",
                        (f"tenant-{tenant}",))  # fmt: skip
    types = [r["type"] for r in rows]
    assert types.count("AdapterRegistered") == 2 and types.count("AdapterRevoked") == 1
    trail = audited(server, tenant)
    assert [c for c, _, _ in trail if "Adapter" in c] == [
        "RegisterAdapter", "RegisterAdapter", "RevokeAdapter",
    ]  # fmt: skip
    assert {(kind, actor) for _, kind, actor in trail} == {("key", admin["id"])}
    # The adapter's price is a change of the price book, audited with the same actor
    prices = ok(server, "GET", "/v1/audit", key, actor=admin["id"], limit=500)["data"]
    priced = [r for r in prices if r["command"] == "SetPrice"
              and any(f"{tenant}/support" in c["subject"] for c in r["changes"])]  # fmt: skip
    assert len(priced) == 1 and priced[0]["actor_kind"] == "key"

    # Refusals name their field; the path's tenant or adapter unknown is a 404
    before = len(types)
    error(call(server, "POST", adapters, key, {**spec, "path": "srv/relative"}), 400, "path")
    error(call(server, "POST", adapters, key, {**spec, "name": "Bad Name"}), 400, "name")
    error(call(server, "POST", adapters, key, {**spec, "rank": 0}), 400, "rank")
    error(call(server, "POST", adapters, key, {**spec, "rank": "8"}), 400, "rank")
    error(call(server, "POST", adapters, key, {**spec, "projects": ["nope"]}), 400, "projects")
    error(call(server, "POST", adapters, key, {**spec, "base": "no-such-model"}), 400, "base")
    error(call(server, "POST", adapters, key, {**spec, "extra": 1}), 400, "extra")
    error(call(server, "POST", "/v1/admin/tenants/nobody-here/adapters", key, spec), 404, "tenant")
    error(call(server, "GET", "/v1/admin/tenants/nobody-here/adapters", key), 404, "tenant")
    error(call(server, "GET", f"{adapters}/nope", key), 404, "adapter")
    error(call(server, "POST", f"{adapters}/nope/revoke", key), 404, "adapter")
    error(call(server, "POST", f"{adapters}/nope/price", key,
               {"prompt": "1", "completion": "1", "cached": "1"}), 404, "adapter")  # fmt: skip
    error(call(server, "POST", f"{adapters}/support/price", key,
               {"prompt": "-1", "completion": "1", "cached": "1"}), 400, "prompt")  # fmt: skip
    rows = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                        (f"tenant-{tenant}",))  # fmt: skip
    assert rows[0]["n"] == before


def test_residency_and_retention_over_http(server: Server, admin: dict[str, str]) -> None:
    key = admin["secret"]
    tenant = name("pin")
    ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/workspaces", key, {"name": "w"})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/projects", key,
       {"name": "bot", "workspace": "w"})  # fmt: skip
    base = f"/v1/admin/tenants/{tenant}"
    # Given a tenant pinned to two regions and a project to one of them
    pinned = ok(server, "POST", f"{base}/residency", key, {"regions": ["eu-west", "eu-central"]})
    assert (pinned["regions"], pinned["project"], pinned["changed"]) == (
        ["eu-central", "eu-west"], None, True,
    )  # fmt: skip
    assert ok(server, "POST", f"{base}/residency", key,
              {"regions": ["eu-central", "eu-west"]})["changed"] is False  # fmt: skip
    ok(server, "POST", f"{base}/residency", key, {"regions": ["eu-west"], "project": "bot"})
    zero = ok(server, "POST", f"{base}/retention", key, {"tier": "zero", "project": "bot"})
    assert (zero["tier"], zero["changed"]) == ("zero", True)
    # Then the data policy shows it, over HTTP as on the CLI
    policy = ok(server, "GET", f"{base}/data-policy", key)
    assert policy == json.loads(server.cli("data-policy", "--tenant", tenant)) | {
        "object": "data_policy"
    }
    assert policy["projects"] == [{
        "project": "bot", "regions": ["eu-west"], "retention": "zero",
        "regions_in_force": ["eu-west"], "retention_in_force": "zero",
    }]  # fmt: skip
    # Refusals name their field and record nothing
    before = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                          (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    error(call(server, "POST", f"{base}/residency", key,
               {"regions": ["us-east"], "project": "bot"}), 400, "regions")  # fmt: skip
    error(call(server, "POST", f"{base}/residency", key, {"regions": []}), 400, "regions")
    error(call(server, "POST", f"{base}/residency", key, {"regions": "eu-west"}), 400, "regions")
    error(call(server, "POST", f"{base}/residency", key, {"regions": ["EU West"]}),
          400, "regions.0")  # fmt: skip
    error(call(server, "POST", f"{base}/residency", key, {"regions": ["eu-west"],
                                                          "project": "nope"}), 400, "project")
    error(call(server, "POST", f"{base}/retention", key, {"tier": "none"}), 400, "tier")
    error(call(server, "POST", f"{base}/retention", key, {}), 400, "tier")
    for path, body in [("residency", {"regions": ["eu-west"]}), ("residency/clear", {}),
                       ("retention", {"tier": "zero"})]:  # fmt: skip
        error(call(server, "POST", f"/v1/admin/tenants/nobody-here/{path}", key, body),
              404, "tenant")  # fmt: skip
    error(call(server, "GET", "/v1/admin/tenants/nobody-here/data-policy", key), 404, "tenant")
    after = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                         (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    assert after == before
    # Cleared, and back to standard; each change audited with the key as its actor
    cleared = ok(server, "POST", f"{base}/residency/clear", key, {"project": "bot"})
    assert (cleared["regions"], cleared["changed"]) == (None, True)
    assert ok(server, "POST", f"{base}/residency/clear", key)["changed"] is True
    assert ok(server, "POST", f"{base}/residency/clear", key)["changed"] is False
    ok(server, "POST", f"{base}/retention", key, {"tier": "standard", "project": "bot"})
    assert ok(server, "GET", f"{base}/data-policy", key)["projects"][0]["retention"] == "standard"
    trail = audited(server, tenant)
    assert [c for c, _, _ in trail if "Resid" in c or "Retention" in c] == [
        "SetResidency", "SetResidency", "SetRetention", "ClearResidency", "ClearResidency",
        "SetRetention",
    ]  # fmt: skip
    assert {(kind, actor) for _, kind, actor in trail} == {("key", admin["id"])}


def test_the_cli_and_the_api_record_the_same_data_policy_and_adapter_events(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    by_cli, by_api = name("cli"), name("api")
    server.cli("tenants", "create", by_cli, "--actor", "alice")
    server.cli("residency", "set", "--tenant", by_cli, "--regions", "eu-west,eu-central",
               "--actor", "alice")  # fmt: skip
    server.cli("retention", "set", "--tenant", by_cli, "--zero", "--actor", "alice")
    server.cli("adapters", "register", "--tenant", by_cli, "--name", "a", "--base", MODEL,
               "--path", "/srv/a", "--rank", "4", "--actor", "alice")  # fmt: skip
    server.cli("adapters", "revoke", "--tenant", by_cli, "--name", "a", "--actor", "alice")
    server.cli("residency", "clear", "--tenant", by_cli, "--actor", "alice")
    ok(server, "POST", "/v1/admin/tenants", key, {"name": by_api})
    base = f"/v1/admin/tenants/{by_api}"
    ok(server, "POST", f"{base}/residency", key, {"regions": ["eu-west", "eu-central"]})
    ok(server, "POST", f"{base}/retention", key, {"tier": "zero"})
    ok(server, "POST", f"{base}/adapters", key,
       {"name": "a", "base": MODEL, "path": "/srv/a", "rank": 4})  # fmt: skip
    ok(server, "POST", f"{base}/adapters/a/revoke", key)
    ok(server, "POST", f"{base}/residency/clear", key)
    read = "SELECT type, payload FROM events WHERE stream_id = ? ORDER BY stream_version"
    cli_rows = server.query(read, (f"tenant-{by_cli}",))
    api_rows = server.query(read, (f"tenant-{by_api}",))
    assert _shape(cli_rows, by_cli) == _shape(api_rows, by_api)
    assert [r["type"] for r in api_rows if r["type"] != "ChangeAudited"] == [
        "TenantRegistered", "ResidencySet", "RetentionSet", "AdapterRegistered",
        "AdapterRevoked", "ResidencyCleared",
    ]  # fmt: skip


def test_other_keys_and_no_key_are_refused(server: Server) -> None:
    tenant = "demo-standard"  # exists: the refusal is the key's, not a missing tenant's
    writes = [
        ("/v1/admin/tenants", {"name": name("no")}),
        (f"/v1/admin/tenants/{tenant}/adapters",
         {"name": "x", "base": MODEL, "path": "/srv/x", "rank": 8}),
        (f"/v1/admin/tenants/{tenant}/adapters/x/revoke", None),
        (f"/v1/admin/tenants/{tenant}/adapters/x/price",
         {"prompt": "1", "completion": "1", "cached": "1"}),
        (f"/v1/admin/tenants/{tenant}/residency", {"regions": ["eu-west"]}),
        (f"/v1/admin/tenants/{tenant}/residency/clear", {}),
        (f"/v1/admin/tenants/{tenant}/retention", {"tier": "zero"}),
    ]  # fmt: skip
    reads = ["/v1/audit", f"/v1/admin/tenants/{tenant}/adapters",
             f"/v1/admin/tenants/{tenant}/adapters/x", f"/v1/admin/tenants/{tenant}/data-policy"]
    before = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                          (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    for who in ("finance", "support", "demo-standard"):
        for path, body in writes:
            r = call(server, "POST", path, server.keys[who], body)
            assert r.status_code == 403, (who, path, r.text)
            assert r.json()["error"]["code"] == "insufficient_scope", (who, path)
        for path in reads:
            assert call(server, "GET", path, server.keys[who]).status_code == 403, (who, path)
    after = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                         (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    assert after == before
    assert httpx.get(server.base + "/v1/admin/tenants", timeout=10).status_code == 401


def test_bad_requests_name_their_field_and_record_nothing(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    tenant = name("bad")
    ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/workspaces", key, {"name": "w"})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/projects", key,
       {"name": "bot", "workspace": "w"})  # fmt: skip
    before = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                          (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    limits = f"/v1/admin/tenants/{tenant}/limits"
    # Per end user: a project's alone, a rate only (the CLI's rules, from the same handler)
    each = {"model": "*", "per_end_user": True, "rpm": 1}
    error(call(server, "POST", limits, key, each), 400, "project")
    error(call(server, "POST", limits, key, each | {"project": "bot", "key": "k"}), 400, "key")
    error(call(server, "POST", limits, key, each | {"project": "bot", "workspace": "w"}),
          400, "workspace")  # fmt: skip
    error(call(server, "POST", limits, key, each | {"project": "nope"}), 400, "project")
    for field in ("max_context", "max_output", "kv_gib_seconds", "reserved_kv_gib_seconds"):
        error(call(server, "POST", limits, key, each | {"project": "bot", field: 5}), 400, field)
    error(call(server, "POST", limits, key, each | {"project": "bot", "per_end_user": 1}),
          400, "per_end_user")  # fmt: skip
    monthly = {"period": "month", "amount": "1", "project": "bot", "per_end_user": True}
    detail = error(call(server, "POST", f"/v1/admin/tenants/{tenant}/budgets", key, monthly),
                   400, "period")  # fmt: skip
    assert "daily" in detail["message"]
    error(call(server, "POST", f"/v1/admin/tenants/{tenant}/budgets", key,
               {"period": "day", "amount": "1", "per_end_user": True}), 400, "project")  # fmt: skip
    error(call(server, "POST", limits, key, {"model": "*", "rpm": -1}), 400, "rpm")
    error(call(server, "POST", limits, key, {"model": "*", "rpm": "7"}), 400, "rpm")
    error(call(server, "POST", limits, key, {"model": "*", "rpms": 7}), 400, "rpms")
    error(call(server, "POST", limits, key, {"model": "*"}), 400, None)  # sets nothing
    error(call(server, "POST", limits, key, {"model": "*", "project": "p", "key": "k", "rpm": 1}),
          400, "key")  # fmt: skip
    # The path's tenant exists: the body's project is the fault
    error(call(server, "POST", limits, key, {"model": "*", "project": "nope", "rpm": 1}),
          400, "project")  # fmt: skip
    budgets = f"/v1/admin/tenants/{tenant}/budgets"
    error(call(server, "POST", budgets, key, {"period": "week", "amount": "1"}), 400, "period")
    detail = error(call(server, "POST", budgets, key, {"period": "day", "amount": "2000000000"}),
                   400, "amount")  # fmt: skip
    assert "over 1,000,000,000 dollars" in detail["message"]
    error(call(server, "POST", budgets, key, {"period": "day", "usd": "2000000000"}), 400, "usd")
    error(call(server, "POST", budgets, key, {"period": "day"}), 400, "amount")
    error(call(server, "POST", budgets, key, {"period": "day", "amount": "1", "usd": "1"}),
          400, "usd")  # fmt: skip
    error(call(server, "POST", f"/v1/admin/tenants/{tenant}/time-zone", key, {"zone": "Mars/Base"}),
          400, "zone")  # fmt: skip
    error(call(server, "POST", "/v1/admin/tenants", key, {"name": tenant}), 409, "name")
    error(call(server, "POST", "/v1/admin/tenants", key, {"name": "Not A Name"}), 400, "name")
    error(call(server, "POST", "/v1/admin/tenants/nobody-here/plan", key, {"plan": "free"}),
          404, "tenant")  # fmt: skip
    error(call(server, "POST", f"/v1/admin/tenants/{tenant}/keys/key_nope/revoke", key),
          404, "key_id")  # fmt: skip
    error(call(server, "POST", "/v1/admin/prices", key,
               {"model": MODEL, "prompt": "1", "completion": "1", "cached": "1",
                "effective_at": "2020-01-01T00:00:00Z"}), 400, "effective_at")  # fmt: skip
    error(call(server, "POST", "/v1/admin/prices", key,
               {"model": MODEL, "prompt": "1", "completion": "1", "cached": "1",
                "effective_at": "2030-01-01"}), 400, "effective_at")  # fmt: skip
    after = server.query("SELECT count(*) AS n FROM events WHERE stream_id = ?",
                         (f"tenant-{tenant}",))[0]["n"]  # fmt: skip
    assert after == before
    # The CLI refuses the same amount with the same words
    done = server_cli_error(server, "budgets", "set", "--tenant", tenant, "--period", "day",
                            "--usd", "2000000000")  # fmt: skip
    assert "over 1,000,000,000 dollars" in done


def server_cli_error(server: Server, *args: str) -> str:
    import subprocess

    from tests.e2e.conftest import REPO, TOLLGATE

    done = subprocess.run([*TOLLGATE, *args, "--database-url", server.db_url], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode != 0, done.stdout
    return done.stderr


def _shape(rows: list[Any], tenant: str) -> list[tuple[str, dict[str, Any]]]:
    """A stream's events with what differs between two tenants' (ids, instants, salts, hashes,
    the actor and the seal) blanked."""
    out = []
    for row in rows:
        payload = json.loads(row["payload"])
        for field in ("cache_salt", "key_hash", "key_id", "seal", "actor", "actor_kind"):
            payload.pop(field, None)
        text = json.dumps(payload, sort_keys=True).replace(tenant, "T")
        out.append((row["type"], json.loads(text)))
    return out


def test_the_cli_and_the_api_record_the_same_events(server: Server, admin: dict[str, str]) -> None:
    key = admin["secret"]
    by_cli, by_api = name("cli"), name("api")
    server.cli("tenants", "create", by_cli, "--plan", "free", "--actor", "alice")
    server.cli("limits", "set", "--tenant", by_cli, "--model", "*", "--rpm", "9", "--tpm", "900",
               "--actor", "alice")  # fmt: skip
    server.cli("budgets", "set", "--tenant", by_cli, "--period", "day", "--usd", "3",
               "--actor", "alice")  # fmt: skip
    ok(server, "POST", "/v1/admin/tenants", key, {"name": by_api, "plan": "free"})
    ok(server, "POST", f"/v1/admin/tenants/{by_api}/limits", key,
       {"model": "*", "rpm": 9, "tpm": 900})  # fmt: skip
    ok(server, "POST", f"/v1/admin/tenants/{by_api}/budgets", key, {"period": "day", "amount": "3"})
    read = "SELECT type, payload FROM events WHERE stream_id = ? ORDER BY stream_version"
    cli_rows = server.query(read, (f"tenant-{by_cli}",))
    api_rows = server.query(read, (f"tenant-{by_api}",))
    assert _shape(cli_rows, by_cli) == _shape(api_rows, by_api)
    assert [r["type"] for r in api_rows] == [
        "TenantRegistered", "ChangeAudited", "LimitsSet", "ChangeAudited", "BudgetSet",
        "ChangeAudited",
    ]  # fmt: skip
    actors = {json.loads(r["payload"])["actor"] for r in api_rows if r["type"] == "ChangeAudited"}
    assert actors == {admin["id"]}


def test_per_end_user_limits_over_http_refuse_that_end_user_only(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    tenant = name("eu")
    base = f"/v1/admin/tenants/{tenant}"
    # Given a tenant with a project and a key in it, all over HTTP
    ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant, "plan": "enterprise"})
    ok(server, "POST", f"{base}/workspaces", key, {"name": "w"})
    ok(server, "POST", f"{base}/projects", key, {"name": "bot", "workspace": "w"})
    secret = ok(server, "POST", f"{base}/keys", key, {"project": "bot"})["secret"]
    server.wait_key(secret)
    # When each end user of the project gets 1 request a minute and a daily budget
    limits = ok(server, "POST", f"{base}/limits", key,
                {"model": "*", "project": "bot", "per_end_user": True, "rpm": 1})  # fmt: skip
    assert (limits["level"], limits["level_id"], limits["recorded"]) == (
        "end_user", "bot", {"rpm": 1},
    )  # fmt: skip
    budget = ok(server, "POST", f"{base}/budgets", key, {"period": "day", "amount": "5",
                "project": "bot", "per_end_user": True})  # fmt: skip
    assert (budget["level"], budget["level_id"], budget["period"], budget["changed"]) == (
        "end_user", "bot", "day", True,
    )  # fmt: skip

    def chat(**kw: Any) -> httpx.Response:
        return httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            **kw.pop("body", {})}, headers={**auth(secret), **kw})  # fmt: skip

    # Then once the edge follows the change (within a poll), a second request of one end user
    # in the minute is refused with the end user's own code
    refused = poll("the per-end-user rpm to refuse bob",
                   lambda: (r if (r := chat(body={"user": "bob"})).status_code == 429 else None))
    detail = refused.json()["error"]
    assert (detail["code"], detail["param"]) == ("end_user_limit_exceeded", "user"), detail
    assert "bob" not in refused.text
    # While another end user of the same key (named by the header) is admitted, once a minute
    first = chat(**{"X-Tollgate-End-User": "carol"})
    assert first.status_code == 200, first.text
    second = chat(**{"X-Tollgate-End-User": "carol"})
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "end_user_limit_exceeded"
    # And both changes are audited with the admin key as their actor
    trail = audited(server, tenant)
    assert [c for c, _, _ in trail][-2:] == ["SetLevelLimits", "SetBudget"]
    assert {(kind, actor) for _, kind, actor in trail} == {("key", admin["id"])}


def test_the_cli_and_the_api_record_the_same_per_end_user_events(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    by_cli, by_api = name("cli"), name("api")
    server.cli("tenants", "create", by_cli, "--actor", "alice")
    server.cli("workspaces", "create", "w", "--tenant", by_cli, "--actor", "alice")
    server.cli("projects", "create", "bot", "--tenant", by_cli, "--workspace", "w",
               "--actor", "alice")  # fmt: skip
    out = server.cli("limits", "set", "--tenant", by_cli, "--project", "bot", "--per-end-user",
                     "--rpm", "2", "--tpm", "500", "--amount-per-day", "1.50", "--actor",
                     "alice")  # fmt: skip
    assert "rpm 2, tpm 500, 1.50 USD a day" in out
    base = f"/v1/admin/tenants/{by_api}"
    ok(server, "POST", "/v1/admin/tenants", key, {"name": by_api})
    ok(server, "POST", f"{base}/workspaces", key, {"name": "w"})
    ok(server, "POST", f"{base}/projects", key, {"name": "bot", "workspace": "w"})
    ok(server, "POST", f"{base}/limits", key,
       {"model": "*", "project": "bot", "per_end_user": True, "rpm": 2, "tpm": 500})  # fmt: skip
    ok(server, "POST", f"{base}/budgets", key, {"period": "day", "amount": "1.50",
       "project": "bot", "per_end_user": True})  # fmt: skip
    read = "SELECT type, payload FROM events WHERE stream_id = ? ORDER BY stream_version"
    cli_rows = server.query(read, (f"tenant-{by_cli}",))
    api_rows = server.query(read, (f"tenant-{by_api}",))
    assert _shape(cli_rows, by_cli) == _shape(api_rows, by_api)
    shaped = dict(_shape(api_rows, by_api)[-4:])  # the last two events and their audits
    assert shaped["LevelLimitsSet"] == shaped["LevelLimitsSet"] | {
        "level": "end_user", "level_id": "bot", "model": "*", "rpm": 2, "tpm": 500,
    }  # fmt: skip
    assert shaped["BudgetSet"] == shaped["BudgetSet"] | {
        "level": "end_user", "level_id": "bot", "period": "day", "amount_micros": 1_500_000,
        "currency": "USD",
    }  # fmt: skip


def test_the_audit_trail_names_the_actor_and_each_old_and_new_value(
    server: Server, admin: dict[str, str]
) -> None:
    key = admin["secret"]
    tenant = name("aud")
    ok(server, "POST", "/v1/admin/tenants", key, {"name": tenant})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/limits", key, {"model": "*", "rpm": 100})
    ok(server, "POST", f"/v1/admin/tenants/{tenant}/limits", key, {"model": "*", "rpm": 50})
    server.cli("tenants", "plan", tenant, "--plan", "enterprise", "--actor", "bob")
    # The API's view: newest first, the key's id as the actor
    page = ok(server, "GET", "/v1/audit", key, tenant=tenant)
    records = page["data"]
    assert [r["command"] for r in records] == [
        "ChangePlan",
        "SetLimits",
        "SetLimits",
        "RegisterTenant",
    ]
    assert [(r["actor_kind"], r["actor"]) for r in records] == [
        ("operator", "bob"),
        *[("key", admin["id"])] * 3,
    ]
    assert records[0]["changes"] == [
        {"subject": "tenant", "field": "plan", "old": "standard", "new": "enterprise"}
    ]
    assert records[1]["changes"] == [
        {"subject": "limits model=*", "field": "rpm", "old": "100", "new": "50"}
    ]
    assert {r["tenant"] for r in records} == {tenant}
    # Filters: by actor, by instant, and pages
    by_bob = ok(server, "GET", "/v1/audit", key, tenant=tenant, actor="bob")["data"]
    assert [r["command"] for r in by_bob] == ["ChangePlan"]
    later = ok(server, "GET", "/v1/audit", key, tenant=tenant, since=records[1]["at"])["data"]
    assert [r["command"] for r in later] == ["ChangePlan", "SetLimits"]
    first = ok(server, "GET", "/v1/audit", key, tenant=tenant, limit=3)
    assert first["has_more"] and len(first["data"]) == 3
    rest = ok(server, "GET", "/v1/audit", key, tenant=tenant, after=first["last_id"])
    assert [r["command"] for r in rest["data"]] == ["RegisterTenant"] and not rest["has_more"]
    # The CLI's view is the same trail
    out = server.cli("audit", "--tenant", tenant, "--actor", admin["id"], "--format", "json")
    assert [r["id"] for r in json.loads(out)["data"]] == [r["id"] for r in records[1:]]
    # And the chain holds
    report = ok(server, "GET", "/v1/audit/verify", key)
    assert report["ok"] and report["problems"] == []
    assert f"tenant-{tenant}" in {h["stream"] for h in report["heads"]}


def test_openapi_describes_the_admin_routes(server: Server) -> None:
    document = httpx.get(server.base + "/openapi.json", timeout=10).json()
    paths = document["paths"]
    assert {"/v1/admin/tenants", "/v1/admin/tenants/{tenant}/keys", "/v1/admin/prices",
            "/v1/admin/models", "/v1/audit", "/v1/audit/verify"} <= set(paths)  # fmt: skip
    issue = paths["/v1/admin/tenants/{tenant}/keys"]["post"]
    assert issue["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/IssuedKey"
    )
    audit = {p["name"] for p in paths["/v1/audit"]["get"]["parameters"]}
    assert {"tenant", "since", "actor", "limit", "after"} <= audit
    limits = document["components"]["schemas"]["LimitsSet"]
    assert limits["additionalProperties"] is False and "rpm" in limits["properties"]
    for path, method, schema in [
        ("/v1/admin/tenants/{tenant}/adapters", "post", "AdminAdapter"),
        ("/v1/admin/tenants/{tenant}/adapters", "get", "AdminAdapterList"),
        ("/v1/admin/tenants/{tenant}/adapters/{adapter}", "get", "AdminAdapter"),
        ("/v1/admin/tenants/{tenant}/adapters/{adapter}/revoke", "post", "AdminAdapter"),
        ("/v1/admin/tenants/{tenant}/adapters/{adapter}/price", "post", "AdminAdapterPrice"),
        ("/v1/admin/tenants/{tenant}/residency", "post", "AdminResidency"),
        ("/v1/admin/tenants/{tenant}/residency/clear", "post", "AdminResidency"),
        ("/v1/admin/tenants/{tenant}/retention", "post", "AdminRetention"),
        ("/v1/admin/tenants/{tenant}/data-policy", "get", "AdminDataPolicy"),
    ]:
        operation = paths[path][method]
        answer = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert answer["$ref"].endswith(f"/{schema}"), (path, method)
        assert operation["security"] == [{"bearer": []}] and "404" in operation["responses"]
    schemas = document["components"]["schemas"]
    assert schemas["RetentionSet"]["properties"]["tier"]["enum"] == ["standard", "zero"]
    assert schemas["AdapterRegister"]["required"] == ["name", "base", "path"]
    budget = schemas["BudgetSet"]["properties"]
    for body in ("LimitsSet", "BudgetSet"):
        flag = schemas[body]["properties"]["per_end_user"]
        assert (flag["type"], flag["default"]) == ("boolean", False), flag
    for answer in ("LimitsRecorded", "AdminBudget"):
        assert "end_user" in schemas[answer]["properties"]["level"]["enum"]
    assert "amount" in budget and budget["usd"]["deprecated"] is True
    assert "deprecated" in budget["usd"]["description"]

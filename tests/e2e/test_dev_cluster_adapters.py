"""A tenant's LoRA adapters under `tollgate dev-cluster` (issue 30): registered with `tollgate
adapters register` against the cluster's PostgreSQL, served through both edges by the simulated
replicas (LoRA on, `--simulated-max-loras` slots each) and billed once each with the adapter on
the ledger and in the usage; another tenant asking for it gets what an unknown model gets; more
adapters than the replica has slots are all served, loaded and unloaded in turn; revoked, every
edge refuses it once it has followed the control plane. The single server's test:
tests/e2e/test_adapters.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import MODEL, auth, dev_cluster, poll, short_body
from tests.vllm.tiny_adapter import build
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
SLOTS = 2
CYCLE = ("xray", "yankee", "zulu")  # with `support`: twice the replica's slots


def test_a_tenants_adapter_is_served_through_both_edges_of_the_dev_cluster(
    postgres_url: str, tmp_path: Path
) -> None:
    with dev_cluster(postgres_url, tmp_path, "--simulated-replicas", "1",
                     "--simulated-max-loras", str(SLOTS)) as cluster:  # fmt: skip
        port, cli = cluster.port, cluster.cli
        (replica,) = re.findall(r"^  replica-\S+\s+(http://\S+)", cluster.banner, re.M)
        finance = json.loads((tmp_path / "data" / "demo-keys.json").read_text())["finance"]
        secrets = {}
        for tenant in ("acme", "bolt"):
            cli("tenants", "create", tenant)
            secrets[tenant] = cli("keys", "issue", "--tenant", tenant).split()[-1]
        edges = [f"http://127.0.0.1:{p}" for p in (port + 1, port + 2)]
        front = f"http://127.0.0.1:{port}"

        def register(name: str, seed: int) -> None:
            path = build(tmp_path / "adapters" / name, rank=8, seed=seed)
            said = cli("adapters", "register", "--tenant", "acme", "--name", name,
                       "--base", MODEL, "--path", str(path))  # fmt: skip
            assert "rank 8" in said

        def chat(address: str, tenant: str, model: str) -> httpx.Response:
            return httpx.post(f"{address}/v1/chat/completions", json=short_body(model),
                              headers=auth(secrets[tenant]), timeout=30)  # fmt: skip

        def engine_asked(response: httpx.Response) -> str:
            """The model the replica was asked for: the adapter's engine name."""
            rid = response.headers["x-request-id"]
            record = httpx.get(f"{replica}/sim/requests/{rid}", timeout=5).json()
            return str(record["adapter"])

        def held() -> set[str]:
            cards = httpx.get(f"{replica}/v1/models", timeout=5).json()["data"]
            return {c["id"] for c in cards if c.get("parent") == MODEL}

        # Registered once against the database; each edge follows the control plane.
        register("support", seed=1)
        served = []
        for edge in edges:
            r = poll(f"{edge} to follow the registration",
                     lambda edge=edge: (r := chat(edge, "acme", "support")).status_code == 200
                     and r, timeout=30)  # fmt: skip
            assert r.json()["model"] == "support"
            assert engine_asked(r) == "acme/support@1"
            served.append(r.headers["x-request-id"])
        assert held() == {"acme/support@1"}  # loaded once, though both edges asked for it

        # Another tenant: on every edge, word for word what a model that does not exist gets.
        for edge in edges:
            theirs = chat(edge, "bolt", "support")
            nobodys = chat(edge, "acme", "support-nobody")
            assert theirs.status_code == nobodys.status_code == 404
            assert theirs.json()["error"]["code"] == "model_not_found"
            assert theirs.json() == json.loads(nobodys.text.replace("support-nobody", "support"))

        # Billed once each, with the adapter on the ledger and in the usage.
        engine = create_engine_from_url(postgres_url)
        try:

            def ledger(ids: list[str]) -> list[tuple[str, str | None]] | None:
                with engine.connect() as conn:
                    rows = conn.execute(sa.text(
                        "SELECT request_id, adapter FROM ledger_entries "
                        "WHERE request_id = ANY(:ids)"
                    ), {"ids": ids}).all()  # fmt: skip
                return [tuple(r) for r in rows] if len(rows) >= len(ids) else None

            rows = poll("both requests billed", lambda: ledger(served), timeout=60, every=0.5)
            assert sorted(rows) == sorted((rid, "support") for rid in served)
            with engine.connect() as conn:
                bills = conn.execute(sa.text(
                    "SELECT stream_id, count(*) FROM events WHERE type = 'UsageBilled' "
                    "AND stream_id = ANY(:ids) GROUP BY stream_id"
                ), {"ids": served}).all()  # fmt: skip
                edges_seen = conn.execute(sa.text(
                    "SELECT count(DISTINCT payload::json->>'edge_id') FROM events "
                    "WHERE type = 'RequestAdmitted' AND stream_id = ANY(:ids)"
                ), {"ids": served}).scalar()  # fmt: skip
            assert sorted(n for _, n in bills) == [1, 1]
            assert edges_seen == 2

            def usage() -> dict[str | None, int]:
                data = httpx.get(
                    f"{front}/v1/billing/usage", params={"tenant": "acme", "group_by": "adapter"},
                    headers=auth(finance), timeout=10,
                ).json()["data"]  # fmt: skip
                return {row["adapter"]: row["requests"] for row in data}

            billed = poll("the usage", lambda: (u := usage()).get("support") == 2 and u,
                          timeout=30)  # fmt: skip
            assert billed == {"support": 2}

            # More adapters than the replica has slots: each served in turn (through one edge,
            # whose view of the slots is then the replica's), the least recently used idle one
            # unloaded to load the next, never more than the slots held at once.
            for seed, name in enumerate(CYCLE, start=2):
                register(name, seed)
            poll("edge-1 to follow the registrations",
                 lambda: chat(edges[0], "acme", CYCLE[-1]).status_code == 200,
                 timeout=30)  # fmt: skip
            cycled, listings = [], []
            for name in (*CYCLE, "support", *CYCLE):
                r = chat(edges[0], "acme", name)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name
                assert engine_asked(r) == f"acme/{name}@1"
                cycled.append((r.headers["x-request-id"], name))
                listings.append(held())
                assert f"acme/{name}@1" in listings[-1], listings
            assert all(len(x) <= SLOTS for x in listings), listings
            assert len(set().union(*listings)) == len(CYCLE) + 1  # every one loaded at a time
            metrics = httpx.get(f"{replica}/metrics", timeout=5).text
            assert f'max_lora="{SLOTS}"' in metrics

            ids = [rid for rid, _ in cycled]
            rows = poll("the cycle billed", lambda: ledger(ids), timeout=60, every=0.5)
            assert sorted(rows) == sorted(cycled)
        finally:
            engine.dispose()

        # Revoked: refused on every edge (and the front address) once each has followed it.
        cli("adapters", "revoke", "--tenant", "acme", "--name", "support")
        for address in (*edges, front):
            gone = poll(f"{address} to follow the revocation",
                        lambda a=address: (r := chat(a, "acme", "support")).status_code == 404
                        and r, timeout=30)  # fmt: skip
            assert gone.json()["error"]["code"] == "model_not_found"
        for edge in edges:  # and stays refused
            assert chat(edge, "acme", "support").status_code == 404
            assert chat(edge, "acme", "xray").status_code == 200

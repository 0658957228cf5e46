"""Data residency under `tollgate dev-cluster` (issue 30): each model's replicas spread over two
regions (`--simulated-region eu-west,us-east`), a tenant pinned to one region is served, through
both edges and the front address, only by the replica there (its RequestRouted in PostgreSQL
say so), and a tenant pinned to a region without a replica is refused 503 region_unavailable."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import auth, dev_cluster, poll, short_body
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
REQUESTS = 12


def test_a_pinned_tenant_stays_in_its_region_across_the_dev_cluster(
    postgres_url: str, tmp_path: Path
) -> None:
    with dev_cluster(postgres_url, tmp_path, "--simulated-replicas", "2",
                     "--simulated-region", "eu-west,us-east") as cluster:  # fmt: skip
        port, cli = cluster.port, cluster.cli
        secrets = {}
        for name, region in (("eu", "eu-west"), ("ap", "ap-south")):
            cli("tenants", "create", f"pinned-{name}")
            cli("residency", "set", "--tenant", f"pinned-{name}", "--regions", region)
            secrets[name] = cli("keys", "issue", "--tenant", f"pinned-{name}").split()[-1]
        addresses = [f"http://127.0.0.1:{p}" for p in (port, port + 1, port + 2)]

        def ask(secret: str, i: int) -> httpx.Response:
            return httpx.post(f"{addresses[i % 3]}/v1/chat/completions", json=short_body(),
                              headers=auth(secret), timeout=30)  # fmt: skip

        # Both edges follow the control plane: wait until each answers the pinned tenants.
        for i in range(3):
            poll(f"edge {i} to know the pin",
                 lambda i=i: ask(secrets["ap"], i).status_code == 503, timeout=30)  # fmt: skip
        refused = ask(secrets["ap"], 0).json()["error"]
        assert refused["code"] == "region_unavailable"
        served = [ask(secrets["eu"], i) for i in range(REQUESTS)]
        assert [r.status_code for r in served] == [200] * REQUESTS
        ids = {r.headers["x-request-id"] for r in served}
        replicas = dict(re.findall(r"^  (replica-\S+)\s+(http://\S+)", cluster.banner, re.M))
        assert len(replicas) == 2

        engine = create_engine_from_url(postgres_url)
        try:

            def routed() -> list[tuple[str, str, str]] | None:
                with engine.connect() as conn:
                    rows = conn.execute(sa.text(
                        "SELECT stream_id, payload::json->>'region', "
                        "payload::json->>'replica_id' FROM events WHERE type = 'RequestRouted'"
                    )).all()  # fmt: skip
                mine = [tuple(r) for r in rows if r[0] in ids]
                return mine if len(mine) == REQUESTS else None

            rows = poll("every request routed and recorded", routed, timeout=60)
        finally:
            engine.dispose()
        assert {region for _, region, _ in rows} == {"eu-west"}
        assert len({replica for _, _, replica in rows}) == 1  # the one replica there

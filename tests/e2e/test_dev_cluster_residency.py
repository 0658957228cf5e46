"""Data residency under `tollgate dev-cluster` (issue 30): each model's replicas spread over two
regions (`--simulated-region eu-west,us-east`), a tenant pinned to one region is served, through
both edges and the front address, only by the replica there (its RequestRouted in PostgreSQL
say so), and a tenant pinned to a region without a replica is refused 503 region_unavailable."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import MODEL, REPO, TOLLGATE, _stop_process, auth, poll, short_body, spawn
from tests.e2e.test_dev_cluster import _three_free_ports
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]
REQUESTS = 12


def test_a_pinned_tenant_stays_in_its_region_across_the_dev_cluster(
    postgres_url: str, tmp_path: Path
) -> None:
    port = _three_free_ports()
    out = tmp_path / "dev-cluster.out"
    env = {"TOLLGATE_DATA_DIR": str(tmp_path / "data")}
    proc = spawn(
        [*TOLLGATE, "dev-cluster", "--database-url", postgres_url, "--port", str(port),
         "--kafka-port", "0", "--model", MODEL, "--simulated-replicas", "2",
         "--simulated-region", "eu-west,us-east", "--sim-speed", "20",
         "--log-dir", str(tmp_path / "logs")],
        out, env=env,
    )  # fmt: skip

    def cli(*args: str) -> str:
        done = subprocess.run(
            [*TOLLGATE, *args, "--database-url", postgres_url], cwd=REPO, capture_output=True,
            text=True, timeout=60, env={**os.environ, **env},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    try:
        poll("the dev cluster's banner",
             lambda: "Ctrl-C" in out.read_text() or proc.poll() is not None, timeout=180,
             every=0.5)  # fmt: skip
        assert proc.poll() is None, out.read_text()
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
        replicas = dict(re.findall(r"^  (replica-\S+)\s+(http://\S+)", out.read_text(), re.M))
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
    finally:
        _stop_process(proc, grace=30)

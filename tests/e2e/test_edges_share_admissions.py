"""Several edges over one PostgreSQL store share a tenant's quota: each edge folds the log into
its admission view (api/runtime.py `_follow_log`), so what one edge admits counts at the
others, with no call on the admission path. Before that, each edge knew only its own
admissions and a tenant got its requests per minute once per edge."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    short_body,
    spawn,
    wait_http,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]
RPM = 6
TENANT = "demo-standard"


def _cli(url: str, *args: str) -> str:
    done = subprocess.run(
        [*TOLLGATE, *args, "--database-url", url], cwd=REPO, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture
def edges(postgres_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two `tollgate api` edges over one PostgreSQL store; the demo tenants seeded."""
    env = {"TOLLGATE_DATA_DIR": str(tmp_path / "data")}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        bases = []
        for i in range(2):  # the first seeds the demo tenants; both serve them
            port = free_port()
            args = [*TOLLGATE, "api", "--port", str(port), "--database-url", postgres_url,
                    "--simulated-replicas", "1", "--sim-speed", "20"]  # fmt: skip
            log = tmp_path / f"edge-{i}.log"
            processes.append(spawn([*args, *(["--no-demo"] if i else [])], log, env=env))
            bases.append(f"http://127.0.0.1:{port}")
            wait_http(f"{bases[-1]}/healthz", processes[-1], log, timeout=60)
        yield bases[0], bases[1]
    finally:
        for proc in processes:
            _stop_process(proc)


def _half_at_each_then_refused(
    first: str, second: str, key: str, limit: int
) -> list[httpx.Response]:
    """`limit` calls, the first half at one edge and the rest at the other (each edge's log
    follower reads every 50 ms), all answered; then one more at each edge, which must both
    refuse: each knows of the other's half. Returns the two refusals."""
    with httpx.Client(timeout=30) as client:

        def call(base: str) -> httpx.Response:
            return client.post(f"{base}/v1/chat/completions", json=short_body(MODEL),
                               headers=auth(key))  # fmt: skip

        half = limit // 2
        answers = [call(first) for _ in range(half)]
        time.sleep(1.0)
        answers += [call(second) for _ in range(limit - half)]
        assert [r.status_code for r in answers] == [200] * limit, answers[-1].text
        time.sleep(1.0)
        refusals = [call(base) for base in (first, second)]
    for base, refused in zip((first, second), refusals, strict=True):
        assert refused.status_code == 429, (base, refused.text)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
    return [answers[0], *refusals]


def test_what_one_edge_admits_counts_at_the_other(
    edges: tuple[str, str], postgres_url: str, tmp_path: Path
) -> None:
    key = json.loads((tmp_path / "data" / "demo-keys.json").read_text())[TENANT]
    _cli(postgres_url, "limits", "set", "--tenant", TENANT, "--model", "*",
         "--rpm", str(RPM), "--tpm", "1000000")  # fmt: skip
    time.sleep(1.5)  # the control-plane followers take the new limit within 0.2 s
    first, *_ = _half_at_each_then_refused(*edges, key, RPM)
    assert first.headers["x-ratelimit-limit-requests"] == str(RPM)


def test_a_projects_requests_per_minute_are_shared_by_the_edges(
    edges: tuple[str, str], postgres_url: str
) -> None:
    # The edges fold each other's admissions into the project's own bucket too (before, a
    # level below the organization was charged only by the edge that decided: twice its rate).
    _cli(postgres_url, "workspaces", "create", "research", "--tenant", TENANT)
    _cli(postgres_url, "projects", "create", "search-bot", "--tenant", TENANT,
         "--workspace", "research")  # fmt: skip
    key = _cli(postgres_url, "keys", "issue", "--tenant", TENANT, "--project", "search-bot")
    _cli(postgres_url, "limits", "set", "--tenant", TENANT, "--project", "search-bot",
         "--model", "*", "--rpm", "4")  # fmt: skip
    time.sleep(1.5)
    _, *refusals = _half_at_each_then_refused(*edges, key.split()[-1], 4)
    for refused in refusals:
        assert 'project "search-bot"' in refused.json()["error"]["message"]

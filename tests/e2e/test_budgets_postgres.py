"""The budget concurrency tests of test_budgets.py on PostgreSQL: `tollgate serve` and its fold
worker on a fresh schema, 200 concurrent requests from four processes against a project budget,
a run's max cost and max calls, and an end user's daily budget under concurrency, and a
per-end-user rpm (test_end_users.py). PostgreSQL is never optional here."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from sqlalchemy.engine import make_url

from tests.conftest import POSTGRES_URL
from tests.e2e import test_budgets as cases
from tests.e2e import test_end_users as end_users
from tests.e2e.conftest import FAST, MODEL, Server, start_replica

pytestmark = pytest.mark.e2e


@dataclass
class PostgresServer(Server):
    """The same server on a PostgreSQL schema: the CLI and the checks read that database."""

    url: str = ""

    @property
    def db_url(self) -> str:
        return self.url

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[Any]:
        conninfo = make_url(self.url).set(drivername="postgresql")
        options = conninfo.query.get("options")
        dsn = conninfo.set(query={}).render_as_string(hide_password=False)
        with psycopg.connect(dsn, options=str(options or ""), row_factory=dict_row) as conn:
            # The e2e helpers write SQLite's dialect: `?` placeholders, booleans that sum.
            sql = sql.replace("%", "%%").replace("?", "%s")
            for name in ("RequestAdmitted", "UsageBilled", "QuotaRefunded"):
                sql = sql.replace(f"sum(type = '{name}')", f"sum((type = '{name}')::int)")
            sql = sql.replace(" sum(type IN (", " sum((type IN (").replace(
                "'RequestPreempted'))", "'RequestPreempted'))::int)"
            )
            return list(conn.execute(sql, tuple(params)).fetchall())

    def events(self, request_id: str) -> list[tuple[str, dict[str, Any]]]:
        rows = self.query(
            "SELECT type, payload FROM events WHERE stream_id = ? ORDER BY stream_version",
            (request_id,),
        )
        return [(r["type"], json.loads(r["payload"])) for r in rows]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
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
        tmp = tmp_path_factory.mktemp("budgets-pg")
        replicas = [start_replica(tmp, MODEL, seed=11 + i, **FAST) for i in range(2)]
        pg = PostgresServer(tmp, replicas, serve_args=["--database-url", url], url=url)
        try:
            pg.start()
            pg.cli("prices", "set", "--model", MODEL, "--prompt", "10", "--completion", "30",
                   "--cached", "5")  # fmt: skip
            yield pg
        finally:
            pg.stop()
            for r in pg.replicas:
                r.stop()
            admin.execute("SET lock_timeout = '10s'")
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')


def test_200_concurrent_requests_never_pass_a_project_budget_on_postgres(server: Server) -> None:
    cases.test_200_concurrent_requests_never_pass_a_project_budget(server)


def test_a_runs_max_cost_and_max_calls_hold_under_concurrency_on_postgres(server: Server) -> None:
    cases.test_concurrent_calls_of_a_run_never_pass_its_max_cost_or_max_calls(server)


def test_an_end_users_daily_budget_holds_under_concurrency_on_postgres(server: Server) -> None:
    end_users.test_concurrent_requests_never_pass_an_end_users_daily_budget(server)


def test_a_per_end_user_rpm_refuses_that_end_user_only_on_postgres(server: Server) -> None:
    end_users.test_a_per_end_user_rpm_refuses_that_end_user_only(server)

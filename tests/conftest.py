"""Shared fixtures: an empty SQLite file and an empty PostgreSQL schema per test.

PostgreSQL is never optional: if it is unreachable, tests that ask for it fail, they do not skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

POSTGRES_URL = os.environ.get(
    "TOLLGATE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'tollgate.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A URL whose connections see only a fresh, uniquely named schema (via search_path), so
    tests can run migrations and write freely; the schema is dropped afterwards."""
    base = make_url(POSTGRES_URL)
    conninfo = base.set(drivername="postgresql").render_as_string(hide_password=False)
    schema = f"t_{os.getpid()}_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(conninfo, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is required and unreachable at {POSTGRES_URL}: {exc}")
    with admin:
        admin.execute(f'CREATE SCHEMA "{schema}"')
        try:
            yield base.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
                hide_password=False
            )
        finally:
            # A test that left a connection open in a transaction would make DROP wait forever.
            admin.execute("SET lock_timeout = '10s'")
            admin.execute(f'DROP SCHEMA "{schema}" CASCADE')

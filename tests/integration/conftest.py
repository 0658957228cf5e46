"""The databases the integration tests run on, each kind in turn: `url` an empty one (a SQLite
file, then a PostgreSQL schema), `engine` the same migrated, `store` the event store on it, and
`postgres_engine` for what only PostgreSQL has (xid8 outbox tails, Kafka offsets). A module
that needs something else defines its own fixture of the same name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade
from tollgate_llm.ledger.store import SqlEventStore


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


def _migrated(url: str) -> Iterator[sa.Engine]:
    upgrade(url)
    engine = create_engine_from_url(url)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def engine(url: str) -> Iterator[sa.Engine]:
    yield from _migrated(url)


@pytest.fixture
def postgres_engine(postgres_url: str) -> Iterator[sa.Engine]:
    yield from _migrated(postgres_url)


@pytest.fixture
def store(engine: sa.Engine) -> SqlEventStore:
    return SqlEventStore(engine)

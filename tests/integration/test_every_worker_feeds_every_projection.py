"""Both fold workers run a projection runner for every read model of domain's one list
(`domain.projections.PROJECTIONS`): a view added there and left out of a worker fails here
(and the Kafka worker, which feeds each by name, refuses to start)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from domain.projections import PROJECTIONS_BY_NAME
from ledger.engine import create_engine_from_url
from ledger.projections import ProjectionRunner
from ledger.schema import upgrade
from streams.kafka_worker import KafkaFoldWorker
from streams.worker import FoldWorker


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    url = f"sqlite:///{tmp_path / 'tollgate.db'}"
    upgrade(url)
    engine = create_engine_from_url(url)
    yield engine
    engine.dispose()


def _runners(worker: object) -> list[ProjectionRunner]:
    found: list[ProjectionRunner] = []
    for value in vars(worker).values():
        values = value if isinstance(value, list) else [value]
        found += [v for v in values if isinstance(v, ProjectionRunner)]
    return found


def test_the_sql_tail_worker_runs_every_read_model(engine: sa.Engine) -> None:
    names = [r.name for r in _runners(FoldWorker(engine))]
    assert sorted(names) == sorted(PROJECTIONS_BY_NAME)


def test_the_kafka_worker_runs_every_read_model(engine: sa.Engine) -> None:
    names = [r.name for r in _runners(KafkaFoldWorker(engine, consumer=None))]  # type: ignore[arg-type]
    assert sorted(names) == sorted(PROJECTIONS_BY_NAME)


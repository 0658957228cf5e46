"""Both fold workers run a projection runner for every read model of domain's one list
(`domain.projections.PROJECTIONS`): a view added there and left out of a worker fails here
(and the Kafka worker, which feeds each by name, refuses to start)."""

from __future__ import annotations

import sqlalchemy as sa

from tollgate_llm.domain.projections import PROJECTIONS_BY_NAME
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.streams.kafka_worker import KafkaFoldWorker
from tollgate_llm.streams.worker import FoldWorker


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


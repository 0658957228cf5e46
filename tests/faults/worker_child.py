"""`tollgate` whose Kafka workers do not owe a rewind after a failed poll or batch (issue 26,
finding 1: "a consumer never moves past a record whose effect did not commit"), for the fault
matrix's safeguard-off twin, which must find the bills this loses."""

from __future__ import annotations

from typing import Any

from tollgate_llm.cli import main
from tollgate_llm.streams import kafka_worker

_init = kafka_worker.KafkaFoldWorker.__init__


def _unsafe_init(self: kafka_worker.KafkaFoldWorker, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    self.rewinds_owed_first = False


if __name__ == "__main__":
    kafka_worker.KafkaFoldWorker.__init__ = _unsafe_init  # type: ignore[method-assign]
    main()

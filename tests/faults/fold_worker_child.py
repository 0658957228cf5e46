"""The fold worker as the consumer-kill test runs it, in a process of its own: `FoldWorker` as
`tollgate worker` runs it, or with `--checkpoint-first` a variant with its safeguard removed (the
billing checkpoint saved before the bills it covers are appended), which the test must catch
losing bills. Crash points come from TOLLGATE_FAULT_POINTS (ledger/faults.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.streams.worker import FoldWorker


class CheckpointFirst(FoldWorker):
    """The unsafe order: checkpoint, then the write. A crash between them skips the bills."""

    def _bill(self, records: list[Recorded]) -> None:
        fresh = [r for r in records if r.position > self.billing.position]
        if fresh:
            self.checkpoints.set(self.billing.name, fresh[-1].position)
            faults.point("billing.after_checkpoint", position=fresh[-1].position)
        super()._bill(records)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--checkpoint-first", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = create_engine_from_url(args.database_url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = (CheckpointFirst if args.checkpoint_first else FoldWorker)(engine)
    worker.catch_up()
    worker.run(stop, interval_s=0.05)


if __name__ == "__main__":
    main()

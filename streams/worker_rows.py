"""Each worker process's own `worker_status` row (a fold worker, each member of a consumer group,
the batch runner): written at each report, deleted at a clean stop. `streams.status` reads them.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from ledger import faults
from ledger.engine import WRITE
from ledger.schema import worker_status
from streams.status import FORGET_AFTER_S

log = logging.getLogger("tollgate.worker")


def member_id() -> str:
    """This process's key among its name's rows in `worker_status`: its host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_row(name: str) -> dict[str, Any]:
    """The identity and heartbeat of this process's `worker_status` row, as of now."""
    return {
        "name": name,
        "member": member_id(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "heartbeat_at": datetime.now(UTC),
    }


@faults.seam("db.status")
def write_status_row(engine: sa.Engine, row: dict[str, Any]) -> None:
    """Upsert one process's `worker_status` row (keyed by `row["name"]` and `row["member"]`).
    The row is created at the process's first report, in the transaction that deletes the rows
    of its name forgotten since (a process killed without a clean stop leaves its row: it shows
    as dead until then)."""
    key = (worker_status.c.name == row["name"]) & (worker_status.c.member == row["member"])
    with engine.connect() as conn:
        conn.execution_options(**{WRITE: True})
        with conn.begin():
            updated = conn.execute(worker_status.update().where(key).values(**row)).rowcount
            if not updated:
                forgotten = row["heartbeat_at"] - timedelta(seconds=FORGET_AFTER_S)
                conn.execute(
                    worker_status.delete().where(
                        (worker_status.c.name == row["name"])
                        & (worker_status.c.heartbeat_at < forgotten)
                    )
                )
                conn.execute(worker_status.insert().values(**row))


def delete_status_row(engine: sa.Engine, name: str) -> None:
    """A clean stop: this process's row goes, so a process that is gone by intent is not
    reported dead. Best effort (the database may be what stopped it)."""
    try:
        with engine.connect() as conn:
            conn.execution_options(**{WRITE: True})
            with conn.begin():
                conn.execute(
                    worker_status.delete().where(
                        (worker_status.c.name == name) & (worker_status.c.member == member_id())
                    )
                )
    except Exception:
        log.warning("could not delete this process's worker status row", exc_info=True)

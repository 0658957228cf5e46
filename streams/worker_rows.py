"""Each worker process's own `worker_status` row (a fold worker, each member of a consumer group,
the batch runner): written at each report, deleted at a clean stop. `streams.status` reads them,
and an edge reads the folds' (`read_fold_status`, `last_heartbeat`) for /readyz and /metrics.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import sqlalchemy as sa

from tollgate_llm.ledger import faults
from tollgate_llm.ledger.engine import WRITE
from tollgate_llm.ledger.schema import worker_status
from tollgate_llm.streams.status import DEFAULT_STALE_S, FORGET_AFTER_S

log = logging.getLogger("tollgate.worker")

# The fold worker's name in `worker_status` (every member of a Kafka group's too).
WORKER_NAME = "folds"
# An edge calls the folds dead when the heartbeat is older than this (by default: the edge's
# TOLLGATE_PIPELINE_STALE_S sets it).
HEARTBEAT_STALE_S = DEFAULT_STALE_S


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


def last_heartbeat(engine: sa.Engine, name: str) -> datetime | None:
    """The freshest heartbeat of the processes named `name`; None if none reported."""
    with engine.connect() as conn:
        found = conn.execute(
            sa.select(sa.func.max(worker_status.c.heartbeat_at)).where(
                worker_status.c.name == name
            )
        ).scalar()
    return found  # max() keeps the column's type: a UTC instant on either backend


@dataclass(frozen=True, slots=True)
class FoldStatus:
    """What an edge knows of the folds, from `worker_status`."""

    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    billing_lag: int
    dead_letters: int


def read_fold_status(
    engine: sa.Engine, now: datetime, name: str = WORKER_NAME,
    stale_s: float = HEARTBEAT_STALE_S,
) -> FoldStatus:
    """The folds are alive while one of their processes reported within `stale_s` (the members
    of a consumer group take over a dead one's partitions); their problems are the live ones'.
    A dead member among live ones is `tollgate status`'s to show, not a reason to turn this
    edge's traffic away."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(worker_status)
            .where(worker_status.c.name == name)
            .order_by(worker_status.c.heartbeat_at.desc())
        ).mappings().all()
    if not rows:
        return FoldStatus(("folds: no fold worker has reported yet",), (), 0, 0)
    problems: list[str] = []
    warnings: list[str] = []
    live = [r for r in rows if (now - r["heartbeat_at"]).total_seconds() <= stale_s]
    if not live:
        age = (now - rows[0]["heartbeat_at"]).total_seconds()
        problems.append(
            f"folds: the fold worker (pid {rows[0]['pid']}) last reported {age:.0f} s ago"
        )
        live = list(rows[:1])
    problems += [f"folds: {r['error']}" for r in live if r["error"]]
    dead = sum(r["dead_letters"] for r in live)
    if dead:
        sample: dict[str, Any] = {}
        for r in live:
            sample.update(orjson.loads(r["dead_letter_sample"] or "{}"))
        warnings.append(
            f"billing: {dead} request(s) could not be billed, e.g. "
            + "; ".join(f"{k} ({v})" for k, v in list(sample.items())[:3])
        )
    return FoldStatus(
        tuple(problems), tuple(warnings), max(r["billing_lag"] for r in live), dead
    )

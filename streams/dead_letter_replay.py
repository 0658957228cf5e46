"""`tollgate dead-letters replay`: the dead letters the folds moved past (`ledger/dead_letters.py`,
written by the fold worker, streams/worker.py) applied again, each through its own fold's code,
and marked replayed in the same transaction; one that still fails stays, with its new reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Recorded
from tollgate_llm.domain.projections import PROJECTIONS
from tollgate_llm.ledger import dead_letters
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.engine import WRITE
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.store import SqlEventStore
from tollgate_llm.streams.billing import BillingFold

__all__ = ["ReplayOutcome", "replay_dead_letters"]


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What `replay_dead_letters` did: the dead letters applied now, and those still failing
    (each with its new reason)."""

    replayed: tuple[dict[str, Any], ...]
    failed: tuple[dict[str, Any], ...]


def replay_dead_letters(
    engine: sa.Engine, *, fold: str | None = None,
    runners: Sequence[ProjectionRunner] | None = None,
) -> ReplayOutcome:  # fmt: skip
    """`tollgate dead-letters replay`: apply every unreplayed dead letter (of `fold`, or all)
    again through its fold's own code: a read model writes the event's rows on top of the
    current ones (`ProjectionRunner.replay`, in the transaction that marks it replayed), billing
    bills the request from its stored stream (`BillingFold.replay`; its deterministic bill id
    makes a second replay a no-op). One that still fails stays, with its new reason.
    `runners`: the read models' runners to replay through (a worker's; default: new ones)."""
    store = SqlEventStore(engine)
    by_name = {
        r.name: r
        for r in runners or [
            ProjectionRunner(engine, store, spec)
            for spec in PROJECTIONS
        ]
    }
    billing: BillingFold | None = None
    with engine.connect() as conn:
        letters = dead_letters.listing(conn, fold=fold)
    replayed: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for letter in letters:
        name, event_id = letter["fold"], letter["event_id"]
        try:
            record = _dead_record(store, letter)
            if name == BillingFold.name:
                if billing is None:  # prices as recorded now: the fix may have been a price
                    control = ControlView()
                    ControlLog(store, control)
                    billing = BillingFold(store, Checkpoints(engine), control, engine=engine)
                billing.replay(record)
                with _write(engine) as conn:
                    dead_letters.mark_replayed(conn, name, event_id, datetime.now(UTC))
            elif name in by_name:
                with _write(engine) as conn:
                    by_name[name].replay(conn, record)
                    dead_letters.mark_replayed(conn, name, event_id, datetime.now(UTC))
            else:
                raise LookupError(f"no fold named {name!r}")
        except Exception as exc:
            if dead_letters.is_transient(exc):
                raise  # the database's failure, not the event's: nothing is marked
            reason = dead_letters.reason_of(exc)
            with _write(engine) as conn:
                dead_letters.failed_again(conn, name, event_id, reason, datetime.now(UTC))
            failed.append({**letter, "reason": reason})
        else:
            replayed.append(letter)
    return ReplayOutcome(tuple(replayed), tuple(failed))


def _dead_record(store: SqlEventStore, letter: dict[str, Any]) -> Recorded:
    """The stored event a dead letter names (by its position; the id is checked)."""
    position = letter["position"]
    found = store.read_all(position - 1, 1) if position else []
    if not found or dead_letters.storable(found[0].event_id, 64) != letter["event_id"]:
        raise LookupError(f"event {letter['event_id']} is not at position {position}")
    return found[0]


@contextmanager
def _write(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A write transaction on a connection of its own (WRITE: SQLite's immediate one)."""
    with engine.connect() as conn:
        conn.execution_options(**{WRITE: True})
        with conn.begin():
            yield conn

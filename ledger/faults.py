"""Named crash points for the fault-injection tests (RELIABILITY.md): with
`TOLLGATE_FAULT_POINTS="billing.after_append@3,projections.before_commit"` the process kills
itself with SIGKILL the 3rd time it reaches `billing.after_append` (the 1st, without `@n`).
Unset — always, outside those tests — `point` costs one truth test of an empty dict.

A point is named for where it sits between an effect and the checkpoint that covers it, so that a
test can crash a consumer exactly there, not only at random; the names are listed here, and an
unknown one refuses to start rather than never firing.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Final

ENV: Final = "TOLLGATE_FAULT_POINTS"

POINTS: Final[dict[str, str]] = {
    "fold.after_read": "the fold worker read a batch of events and applied none of it",
    "billing.after_append": "bills committed, the billing checkpoint not yet saved",
    "projections.before_commit": "read-model rows and checkpoints written, not yet committed",
    "projections.after_commit": "read-model rows and checkpoints committed, positions not moved",
    "sweeper.after_expire": "a lease expired and refunded, the sweeper's own book not updated",
    "kafka.after_bills": "a Kafka worker's bills committed, its rows and offsets not yet",
    "kafka.before_commit": "a Kafka worker's rows and offsets written, not yet committed",
    # Only the test's unsafe consumer (its checkpoint moved before the write) reaches this one.
    "billing.after_checkpoint": "the billing checkpoint saved before its bills were appended",
}


def parse(spec: str) -> dict[str, int]:
    """`name@n,...` → {name: n}; raises ValueError naming an unknown point or a bad count."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("@")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r} (known: {', '.join(POINTS)})")
        if count and (not count.isdigit() or int(count) < 1):
            raise ValueError(f"{ENV}: {item!r}: the count after @ must be a positive integer")
        armed[name] = int(count or 1)
    return armed


_armed: dict[str, int] = parse(os.environ.get(ENV, ""))
_hits: dict[str, int] = {}


def point(name: str, **context: object) -> None:
    """Reach crash point `name`: SIGKILL this process if it is armed and this is its n-th hit.
    `context` is written to stderr first (the test reads, e.g., the position it died at)."""
    if not _armed:
        return
    wanted = _armed.get(name)
    if wanted is None:
        return
    hits = _hits[name] = _hits.get(name, 0) + 1
    if hits < wanted:
        return
    details = " ".join(f"{k}={v}" for k, v in context.items())
    sys.stderr.write(f"fault point {name} hit {hits}: SIGKILL pid {os.getpid()} {details}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)

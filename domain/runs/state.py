"""A run as its stream defines it, and the limits a project's run policy sets. The runs are
folded by `Hierarchy` and decided by `domain.governance.decide` (a run's limits are its
project's policy, in the tenant stream); their consumption by `domain.governance.budgets`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Final

RUN_LIMIT_FIELDS: Final = (
    "max_calls", "max_tool_calls", "max_wall_ms", "max_cost_micros", "max_in_flight",
)  # fmt: skip


RUN_ID: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def run_stream(tenant_id: str, run_id: str) -> str:
    return f"run-{tenant_id}-{run_id}"


@dataclass(frozen=True, slots=True)
class RunLimits:
    """None: unbounded. `currency` (ISO 4217) is the unit of `max_cost_micros`; a run is billed
    in one currency (`domain.governance.path_admission`), so it goes with the cost limit
    wherever that comes from."""

    max_calls: int | None = None
    max_tool_calls: int | None = None
    max_wall_ms: int | None = None
    max_cost_micros: int | None = None
    max_in_flight: int | None = None
    currency: str = "USD"


@dataclass(frozen=True, slots=True)
class Run:
    """A run as its stream defines it (its consumption is folded by `domain.governance.budgets`)."""

    tenant_id: str
    run_id: str
    project_id: str | None
    limits: RunLimits
    started_at: datetime
    implicit: bool = False
    ended_at: datetime | None = None

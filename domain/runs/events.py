"""An agent run's facts (stream "run-<tenant_id>-<run_id>")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tollgate_llm.domain.envelope import Event


@dataclass(frozen=True, slots=True)
class RunStarted(Event):
    EVENT_TYPE: ClassVar[str] = "RunStarted"
    tenant_id: str
    run_id: str
    project_id: str | None
    max_calls: int | None = None
    max_tool_calls: int | None = None
    max_wall_ms: int | None = None
    max_cost_micros: int | None = None
    max_in_flight: int | None = None
    implicit: bool = False  # started by its first call's X-Tollgate-Run-Id, not POST /v1/runs
    currency: str = "USD"  # ISO 4217 of max_cost_micros (USD before currencies were recorded)


@dataclass(frozen=True, slots=True)
class RunBudgetExhausted(Event):
    """The first refusal of a run's call for one dimension (calls, tool_calls, wall_clock,
    cost, in_flight, ended, currency)."""

    EVENT_TYPE: ClassVar[str] = "RunBudgetExhausted"
    tenant_id: str
    run_id: str
    dimension: str
    refused_request_id: str  # the call refused (not a request-stream event)


@dataclass(frozen=True, slots=True)
class RunEnded(Event):
    EVENT_TYPE: ClassVar[str] = "RunEnded"
    tenant_id: str
    run_id: str

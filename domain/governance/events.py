"""The hierarchy under a tenant and its budgets (tenant stream): organization (the tenant) ->
workspace -> project -> API key. Every level lives in its tenant's stream, so one
optimistic-concurrency check covers the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tollgate_llm.domain.envelope import Event


@dataclass(frozen=True, slots=True)
class WorkspaceCreated(Event):
    EVENT_TYPE: ClassVar[str] = "WorkspaceCreated"
    tenant_id: str
    workspace_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ProjectCreated(Event):
    EVENT_TYPE: ClassVar[str] = "ProjectCreated"
    tenant_id: str
    project_id: str
    name: str
    workspace_id: str


@dataclass(frozen=True, slots=True)
class ProjectMoved(Event):
    EVENT_TYPE: ClassVar[str] = "ProjectMoved"
    tenant_id: str
    project_id: str
    workspace_id: str  # the workspace it belongs to from now on


@dataclass(frozen=True, slots=True)
class KeyAssigned(Event):
    """An API key's project (recorded with its ApiKeyIssued, or later to move it). A key with
    none belongs to the organization directly."""

    EVENT_TYPE: ClassVar[str] = "KeyAssigned"
    tenant_id: str
    key_id: str
    project_id: str


@dataclass(frozen=True, slots=True)
class LevelLimitsSet(Event):
    """Limits at a level below the organization (the organization's are `LimitsSet`). None
    leaves the earlier value; a level with no value for a limit is bounded by its ancestors."""

    EVENT_TYPE: ClassVar[str] = "LevelLimitsSet"
    tenant_id: str
    level: str  # workspace | project | key
    level_id: str
    model: str  # a model name or version, or "*"
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class BudgetSet(Event):
    """A spend budget per calendar period at one level; `amount_micros` None removes it."""

    EVENT_TYPE: ClassVar[str] = "BudgetSet"
    tenant_id: str
    level: str  # org | workspace | project | key
    level_id: str
    period: str  # day | month
    amount_micros: int | None
    # ISO 4217 of the amount: the budget counts only spend priced in it. A default, so that a
    # BudgetSet recorded before currencies were reads as USD (the only one there was).
    currency: str = "USD"


@dataclass(frozen=True, slots=True)
class TimeZoneSet(Event):
    """The organization's time zone (an IANA name): where its budget days and months begin."""

    EVENT_TYPE: ClassVar[str] = "TimeZoneSet"
    tenant_id: str
    time_zone: str


@dataclass(frozen=True, slots=True)
class RunPolicySet(Event):
    """The run budget a project's runs get unless their creator gave one. None: unbounded."""

    EVENT_TYPE: ClassVar[str] = "RunPolicySet"
    tenant_id: str
    project_id: str
    max_calls: int | None = None
    max_tool_calls: int | None = None
    max_wall_ms: int | None = None
    max_cost_micros: int | None = None
    max_in_flight: int | None = None
    currency: str = "USD"  # ISO 4217 of max_cost_micros (USD before currencies were recorded)

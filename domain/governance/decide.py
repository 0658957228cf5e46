"""The hierarchy's commands (levels, limits, budgets, time zone, run policies, and a run's start
and end) and its `decide`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from tollgate_llm.domain.cost import CURRENCY_CODE
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import MAX_AMOUNT_MICROS, DomainError, check_quantity
from tollgate_llm.domain.governance.end_users import END_USER, END_USER_LIMIT_FIELDS
from tollgate_llm.domain.governance.events import (
    BudgetSet,
    KeyAssigned,
    LevelLimitsSet,
    ProjectCreated,
    ProjectMoved,
    RunPolicySet,
    TimeZoneSet,
    WorkspaceCreated,
)
from tollgate_llm.domain.governance.state import (
    BUDGET_PERIODS,
    LEVEL_LIMIT_FIELDS,
    LEVEL_NAME,
    LEVELS,
    Hierarchy,
    _Node,
    _Tenant,
    time_zone,
)
from tollgate_llm.domain.runs.events import RunEnded, RunStarted
from tollgate_llm.domain.runs.state import RUN_ID, RUN_LIMIT_FIELDS, RunLimits


@dataclass(frozen=True, slots=True)
class CreateWorkspace:
    tenant_id: str
    name: str  # becomes the workspace id, unique in its tenant


@dataclass(frozen=True, slots=True)
class CreateProject:
    tenant_id: str
    name: str  # becomes the project id, unique in its tenant
    workspace_id: str


@dataclass(frozen=True, slots=True)
class MoveProject:
    tenant_id: str
    project_id: str
    workspace_id: str


@dataclass(frozen=True, slots=True)
class AssignKey:
    tenant_id: str
    key_id: str
    project_id: str


@dataclass(frozen=True, slots=True)
class SetLevelLimits:
    tenant_id: str
    level: str  # workspace | project | key
    level_id: str
    model: str
    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class SetBudget:
    tenant_id: str
    level: str  # org | workspace | project | key
    level_id: str  # the tenant id for org
    period: str  # day | month
    amount_micros: int | None  # None: remove it
    currency: str = "USD"  # ISO 4217 of the amount: the deployment's setting unless given


@dataclass(frozen=True, slots=True)
class SetTimeZone:
    tenant_id: str
    time_zone: str


@dataclass(frozen=True, slots=True)
class SetRunPolicy:
    tenant_id: str
    project_id: str
    limits: RunLimits


@dataclass(frozen=True, slots=True)
class StartRun:
    """Stream `run_stream(tenant_id, run_id)`. Limits not given come from the project's run
    policy (`SetRunPolicy`)."""

    tenant_id: str
    run_id: str
    project_id: str | None
    limits: RunLimits
    implicit: bool = False


@dataclass(frozen=True, slots=True)
class EndRun:
    tenant_id: str
    run_id: str


HierarchyCommand = (
    CreateWorkspace | CreateProject | MoveProject | AssignKey | SetLevelLimits | SetBudget
    | SetTimeZone | SetRunPolicy | StartRun | EndRun
)  # fmt: skip
HIERARCHY_COMMANDS: Final = (
    CreateWorkspace, CreateProject, MoveProject, AssignKey, SetLevelLimits, SetBudget,
    SetTimeZone, SetRunPolicy, StartRun, EndRun,
)  # fmt: skip


def decide(
    h: Hierarchy, command: HierarchyCommand, *, key_tenant: str | None = None
) -> tuple[Event, ...]:
    """The events of a hierarchy command, or a DomainError naming the field. The tenant is
    known to exist (`domain.control_plane.decide.decide_control` checks it); `key_tenant` is
    the tenant of the key the command names, if it names one. A repeat that changes nothing
    answers ()."""
    t = h._tenant(command.tenant_id)
    tenant = command.tenant_id
    match command:
        case CreateWorkspace():
            _check_name(command.name)
            if command.name in t.workspaces:
                raise DomainError(
                    "duplicate_workspace", f"workspace {command.name!r} exists", field="name"
                )
            return (WorkspaceCreated(tenant, command.name, command.name),)
        case CreateProject():
            _check_name(command.name)
            _require(t.workspaces, command.workspace_id, "workspace")
            if command.name in t.projects:
                raise DomainError(
                    "duplicate_project", f"project {command.name!r} exists", field="name"
                )
            return (ProjectCreated(tenant, command.name, command.name, command.workspace_id),)
        case MoveProject():
            node = _require(t.projects, command.project_id, "project")
            _require(t.workspaces, command.workspace_id, "workspace")
            if node.parent == command.workspace_id:
                return ()
            return (ProjectMoved(tenant, command.project_id, command.workspace_id),)
        case AssignKey():
            _require_key(key_tenant, tenant, command.key_id)
            _require(t.projects, command.project_id, "project")
            if t.key_projects.get(command.key_id) == command.project_id:
                return ()
            return (KeyAssigned(tenant, command.key_id, command.project_id),)
        case SetLevelLimits():
            return _set_level_limits(t, command, key_tenant)
        case SetBudget():
            return _decide_budget(t, command, key_tenant)
        case SetTimeZone():
            time_zone(command.time_zone)
            if t.zone_name == command.time_zone:
                return ()
            return (TimeZoneSet(tenant, command.time_zone),)
        case SetRunPolicy():
            _require(t.projects, command.project_id, "project")
            _check_run_limits(command.limits)
            return (RunPolicySet(tenant, command.project_id, **_run_fields(command.limits)),)
        case StartRun():
            return _decide_start_run(h, t, command)
        case EndRun():
            run = t.runs.get(command.run_id)
            if run is None:
                raise DomainError("unknown_run", f"no run {command.run_id!r}", field="run_id")
            if run.ended_at is not None:
                return ()
            return (RunEnded(tenant, command.run_id),)
    raise DomainError("unknown_command", f"unknown command {type(command).__name__}")


def _set_level_limits(
    t: _Tenant, command: SetLevelLimits, key_tenant: str | None
) -> tuple[Event, ...]:
    tenant = command.tenant_id
    _require_level(t, command.level, command.level_id, key_tenant, tenant, org=False)
    if not command.model or command.model.strip() != command.model:
        raise DomainError("bad_model", f"model {command.model!r}", field="model")
    values = {name: getattr(command, name) for name in LEVEL_LIMIT_FIELDS}
    for name, value in values.items():
        check_quantity(name, value)
        if command.level == END_USER and value is not None and name not in END_USER_LIMIT_FIELDS:
            raise DomainError(
                "bad_limit", f"a per-end-user limit is rpm or tpm, not {name}", field=name
            )
    if all(value is None for value in values.values()):
        raise DomainError("empty_limits", "no limit given")
    return (LevelLimitsSet(tenant, command.level, command.level_id, command.model, **values),)


def _decide_budget(t: _Tenant, command: SetBudget, key_tenant: str | None) -> tuple[Event, ...]:
    """A budget set, changed (its amount or its currency) or removed; () if it already is."""
    _require_level(t, command.level, command.level_id, key_tenant, command.tenant_id, org=True)
    if command.period not in BUDGET_PERIODS:
        raise DomainError(
            "bad_period",
            f"period {command.period!r} is not one of {BUDGET_PERIODS}",
            field="period",
        )
    if command.level == END_USER and command.period != "day":
        # End users are tracked per budget day (domain/governance/end_users.py).
        raise DomainError("bad_period", "a per-end-user budget is daily", field="period")
    amount = command.amount_micros
    check_quantity("the budget in micro-units", amount, negative="negative_budget",
                   field="amount", most=MAX_AMOUNT_MICROS)  # fmt: skip
    check_currency(command.currency)
    current = t.budgets.get((command.level, command.level_id), {}).get(command.period)
    if (current is None and amount is None) or (
        current is not None and (current.amount_micros, current.currency)
        == (amount, command.currency)
    ):  # fmt: skip
        return ()
    return (
        BudgetSet(
            command.tenant_id, command.level, command.level_id, command.period, amount,
            command.currency,
        ),
    )  # fmt: skip


def _decide_start_run(h: Hierarchy, t: _Tenant, command: StartRun) -> tuple[Event, ...]:
    """A run's start with its limits: those given, the rest (a cost limit with its currency)
    its project's policy."""
    if not RUN_ID.fullmatch(command.run_id):
        raise DomainError("bad_run_id", f"run id must match {RUN_ID.pattern}", field="run_id")
    if command.project_id is not None:
        _require(t.projects, command.project_id, "project")
    _check_run_limits(command.limits)
    if command.run_id in t.runs:
        raise DomainError("duplicate_run", f"run {command.run_id!r} exists", field="run_id")
    policy = h.run_policy(command.tenant_id, command.project_id)
    given = command.limits
    merged: dict[str, Any] = {
        name: getattr(given, name) if getattr(given, name) is not None
        else getattr(policy, name)
        for name in RUN_LIMIT_FIELDS
    }  # fmt: skip
    # The currency goes with the cost limit it is the unit of.
    if given.max_cost_micros is None and policy.max_cost_micros is not None:
        merged["currency"] = policy.currency
    else:
        merged["currency"] = given.currency
    return (
        RunStarted(
            command.tenant_id, command.run_id, command.project_id, **merged,
            implicit=command.implicit,
        ),
    )  # fmt: skip


def _run_fields(limits: RunLimits) -> dict[str, Any]:
    return {name: getattr(limits, name) for name in RUN_LIMIT_FIELDS} | {
        "currency": limits.currency
    }


def _check_run_limits(limits: RunLimits) -> None:
    for name in RUN_LIMIT_FIELDS:
        value = getattr(limits, name)
        check_quantity(name, value)
    check_currency(limits.currency)


def check_currency(code: str) -> None:
    """An amount's unit is an ISO 4217 code (three capitals), as a price's is."""
    if not isinstance(code, str) or not CURRENCY_CODE.fullmatch(code):
        raise DomainError(
            "bad_currency", f"currency {code!r} is not an ISO 4217 code ({CURRENCY_CODE.pattern})",
            field="currency",
        )  # fmt: skip


def _check_name(name: str) -> None:
    if not LEVEL_NAME.fullmatch(name):
        raise DomainError(
            "bad_name", f"name {name!r} must match {LEVEL_NAME.pattern}", field="name"
        )


def _require(nodes: dict[str, _Node], level_id: str, kind: str) -> _Node:
    node = nodes.get(level_id)
    if node is None:
        raise DomainError(f"unknown_{kind}", f"no {kind} {level_id!r}", field=kind)
    return node


def _require_key(key_tenant: str | None, tenant: str, key_id: str) -> None:
    if key_tenant != tenant:
        raise DomainError("unknown_key", f"no key {key_id!r}", field="key")


def _require_level(
    t: _Tenant, level: str, level_id: str, key_tenant: str | None, tenant: str, *, org: bool
) -> None:
    if level == "org" and org:
        if level_id != tenant:
            raise DomainError("bad_level", "an organization's level id is its tenant id")
    elif level == "workspace":
        _require(t.workspaces, level_id, "workspace")
    elif level == "project":
        _require(t.projects, level_id, "project")
    elif level == "key":
        _require_key(key_tenant, tenant, level_id)
    elif level == END_USER:  # per-end-user limits and budgets are set per project
        _require(t.projects, level_id, "project")
    else:
        raise DomainError("bad_level", f"level {level!r} is not one of {LEVELS}", field="level")

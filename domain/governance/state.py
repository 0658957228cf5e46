"""The tree under a tenant — organization → workspace → project → API key — with the limits,
spend budgets and run policies set at each level, folded from the tenant stream's control
events (`Hierarchy.apply`), and the path a key's requests are decided over (`Hierarchy.path`).

A level's limit that is not set leaves the level bounded by its ancestors only; the
organization's own limits are the plan's (`domain.control_plane.state.ControlView.limits`). Budget
periods are calendar days and months in the organization's time zone (UTC unless it set one): a
period is named by its local date, so a new one begins by the clock and nothing has to reset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Final, Literal, NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from tollgate_llm.domain.cost import base_model
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
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
from tollgate_llm.domain.runs.events import RunBudgetExhausted, RunEnded, RunStarted
from tollgate_llm.domain.runs.state import RUN_LIMIT_FIELDS, Run, RunLimits

# "end_user": a project's end user (domain/governance/end_users.py), below the key; its limits
# and budget are set once per project, at level id = the project.
LevelKind = Literal["org", "workspace", "project", "key", "end_user"]
LEVELS: Final[tuple[LevelKind, ...]] = ("org", "workspace", "project", "key")
BUDGET_PERIODS: Final = ("day", "month")
LEVEL_LIMIT_FIELDS: Final = ("rpm", "tpm", "max_context", "max_output", "kv_gib_seconds")


# Both matched whole (`fullmatch`): with `match`, `$` also matches before a final newline.
LEVEL_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


# RunBudgetExhausted changes nothing here, but the control view must count it in its run's
# stream version, or a later RunEnded would be decided at a stale one.
HIERARCHY_EVENTS: Final[tuple[type[Event], ...]] = (
    WorkspaceCreated, ProjectCreated, ProjectMoved, KeyAssigned, LevelLimitsSet, BudgetSet,
    TimeZoneSet, RunPolicySet, RunStarted, RunBudgetExhausted, RunEnded,
)  # fmt: skip


def time_zone(name: str) -> tzinfo:
    """The zone of an IANA name, or a DomainError naming the field (the zone database is the
    standard library's, read-only)."""
    try:
        return _ZONES[name]
    except KeyError:
        pass
    try:
        zone = ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a name too long
        raise DomainError(
            "bad_time_zone", f"unknown time zone {name!r}", field="time_zone"
        ) from exc
    _ZONES[name] = zone
    return zone


_ZONES: dict[str, tzinfo] = {}


def period_keys(now: datetime, zone: tzinfo) -> tuple[str, str]:
    """(day, month) of an instant in a zone: "2026-12-02", "2026-12". Days and months are the
    calendar's, not 24 h or 30 d windows."""
    local = now.astimezone(zone)
    day = local.date().isoformat()
    return day, day[:7]


def month_start(now: datetime, zone_name: str) -> datetime:
    """The first instant of the calendar month holding `now` in a zone (as a UTC instant)."""
    local = now.astimezone(time_zone(zone_name))
    return datetime(local.year, local.month, 1, tzinfo=local.tzinfo).astimezone(UTC)


class PathPlan:
    """The checks of one path, worked out once per (tenant, key, model) rather than per
    decision: for each level that limits or budgets anything (org first), its rule, its own
    requests/min, tokens/min and KV·s limits (None: not set) and its budgets, each with
    whether it is daily. Levels with nothing set are left out: checking them is a no-op.

    Hashed by identity, on purpose: `domain.governance.budgets.PathView` keeps its per-path
    state (the buckets and spend entries the checks read) under it, and an identity hash costs
    nothing
    where a tuple of rules would hash every field of every level at every decision."""

    __slots__ = ("checks",)

    def __init__(self, rules: tuple[LevelRule, ...]) -> None:
        checks = []
        for rule in rules:
            own = rule.limits
            rpm = tpm = kv = None
            if own is not None:
                rpm, tpm, kv = own.rpm, own.tpm, own.kv_gib_seconds
            budgets = tuple((budget, budget.period == "day") for budget in rule.budgets)
            if rpm is not None or tpm is not None or kv is not None or budgets:
                checks.append((rule, rpm, tpm, kv, budgets))
        self.checks: tuple[
            tuple[LevelRule, int | None, int | None, int | None, tuple[tuple[Budget, bool], ...]],
            ...,
        ] = tuple(checks)


def _static_path(rules: tuple[LevelRule, ...]) -> tuple[Any, ...]:
    """What a path's policy keeps between decisions: its rules, their keys, the keys with a
    KV·s limit, its workspace and project, its tightest max_context / max_output, and its
    plan."""

    def tightest(name: str) -> int | None:
        values = [getattr(r.limits, name) for r in rules if r.limits is not None]
        found = [v for v in values if v is not None]
        return min(found) if found else None

    ids = {rule.level.kind: rule.level.level_id for rule in rules}
    return (
        rules,
        tuple(rule.key for rule in rules),
        tuple(
            rule.key for rule in rules
            if rule.limits is not None and rule.limits.kv_gib_seconds is not None
        ),
        ids.get("workspace"),
        ids.get("project"),
        tightest("max_context"),
        tightest("max_output"),
        PathPlan(rules),
    )  # fmt: skip


def _run_limits(event: RunPolicySet | RunStarted) -> RunLimits:
    limits: dict[str, Any] = {name: getattr(event, name) for name in RUN_LIMIT_FIELDS}
    return RunLimits(**limits, currency=event.currency)


def _day_window(now: datetime, zone: tzinfo) -> tuple[float, float, str, str]:
    """The local day holding `now` as [first instant, next day's first instant) in epoch
    seconds, with its day and month names."""
    day, month = period_keys(now, zone)
    local = now.astimezone(zone)
    start = datetime(local.year, local.month, local.day, tzinfo=zone)
    following = start.date() + timedelta(days=1)
    end = datetime(following.year, following.month, following.day, tzinfo=zone)
    return (start.timestamp(), end.timestamp(), day, month)


@dataclass(frozen=True, slots=True)
class Level:
    """One node of a request's path. `name` is shown to the tenant that owns it only."""

    kind: LevelKind
    level_id: str
    name: str

    @property
    def label(self) -> str:
        if self.kind == "end_user":
            return f'end user "{self.name}"'
        return "organization" if self.kind == "org" else f'{self.kind} "{self.name}"'


@dataclass(frozen=True, slots=True)
class LevelLimits:
    """A level's own limits for one model; None: bounded by its ancestors only."""

    rpm: int | None = None
    tpm: int | None = None
    max_context: int | None = None
    max_output: int | None = None
    kv_gib_seconds: int | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in LEVEL_LIMIT_FIELDS)


@dataclass(frozen=True, slots=True)
class Budget:
    period: str  # day | month
    amount_micros: int
    currency: str = "USD"  # ISO 4217: it counts only spend priced in this currency


@dataclass(frozen=True, slots=True)
class LevelRule:
    """What bounds one level of a path: its own rate limits (the organization's are decided by
    `domain.admission.decide`, so None there) and budgets. `key` is the level's key in
    `domain.governance.budgets.PathView`: (tenant, kind, level id)."""

    level: Level
    limits: LevelLimits | None
    budgets: tuple[Budget, ...]
    key: tuple[str, str, str]


class PathPolicy(NamedTuple):
    """Everything one admission decides over below the organization's limits: each level of
    the key's path (org first) with its rules, the budget periods of the instant, and the run.
    A named tuple: one is built per governed request (a frozen dataclass costs several times
    more to build)."""

    tenant_id: str
    key_id: str
    levels: tuple[LevelRule, ...]
    day: str
    month: str
    run: Run | None = None
    zone_name: str = "UTC"
    # The levels' keys in `domain.governance.budgets.PathView`, and those with a KV·s limit.
    level_keys: tuple[tuple[str, str, str], ...] = ()
    kv_keys: tuple[tuple[str, str, str], ...] = ()
    workspace_id: str | None = None
    project_id: str | None = None
    # The tightest level's (below the organization), None where no level sets one.
    max_context: int | None = None
    max_output: int | None = None
    # The checks of `levels`, precomputed (None: `domain.governance.path_admission.reserve`
    # works them out).
    plan: PathPlan | None = None
    # The end-user level it ends with (domain/governance/end_users.py): the end user's keyed
    # hash or "overflow"; None when it has none.
    end_user: str | None = None

    def level(self, kind: str) -> Level | None:
        for rule in self.levels:
            if rule.level.kind == kind:
                return rule.level
        return None


@dataclass(slots=True)
class _Node:
    level_id: str
    name: str
    parent: str | None  # a project's workspace
    created_at: datetime


@dataclass(slots=True)
class _Tenant:
    workspaces: dict[str, _Node] = field(default_factory=dict)
    projects: dict[str, _Node] = field(default_factory=dict)
    key_projects: dict[str, str] = field(default_factory=dict)
    # (level, level_id, model scope) -> merged values, latest last
    limits: dict[tuple[str, str, str], dict[str, int]] = field(default_factory=dict)
    budgets: dict[tuple[str, str], dict[str, Budget]] = field(default_factory=dict)
    # project -> its run policies in the order set, each with the instant it was set
    run_policies: dict[str, list[tuple[datetime, RunLimits]]] = field(default_factory=dict)
    zone_name: str = "UTC"
    runs: dict[str, Run] = field(default_factory=dict)


class Hierarchy:
    """Folded by `ControlView.apply` (which dedupes by event id) from `HIERARCHY_EVENTS`."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        self._paths: dict[tuple[str, str, str], tuple[tuple[Level, LevelLimits | None], ...]] = {}
        # (tenant, key, model) -> the path's rules: rebuilt after any hierarchy event only.
        self._rules: dict[tuple[str, str, str], tuple[Any, ...]] = {}
        # zone -> (day's first instant, next day's first instant (epoch s), day, month): the
        # periods of an instant, computed once a day per zone rather than per decision.
        self._days: dict[str, tuple[float, float, str, str]] = {}
        # (tenant, key, model) -> the policy of the current day outside a run: a call outside a
        # run gets the same (immutable) policy all day, so it is built once a day, not per call.
        self._policies: dict[tuple[str, str, str], PathPolicy] = {}
        # ... and the policy of the last run a call of the key belonged to (one per key, so
        # a tenant's many runs do not pile up): the next call of the same run reuses it.
        self._run_policies: dict[tuple[str, str, str], PathPolicy] = {}
        # (tenant, kind, level id, model) -> the level's (requests/min, tokens/min): what sizes
        # its buckets when another edge's admission there is folded (`level_rates`).
        self._rates: dict[tuple[str, str, str, str], tuple[int | None, int | None]] = {}
        # Tenants with anything set below or beside their plan: only their requests are
        # decided over a path (the others pay nothing for this feature).
        self._governed: set[str] = set()

    # --- folding ------------------------------------------------------------------------------

    def apply(self, event: Event, at: datetime) -> None:
        tenant_id = getattr(event, "tenant_id", "")
        t = self._tenants.setdefault(tenant_id, _Tenant())
        match event:
            case WorkspaceCreated():
                t.workspaces[event.workspace_id] = _Node(event.workspace_id, event.name, None, at)
                self._governed.add(tenant_id)
            case ProjectCreated():
                t.projects[event.project_id] = _Node(
                    event.project_id, event.name, event.workspace_id, at
                )
                self._governed.add(tenant_id)
            case ProjectMoved():
                node = t.projects.get(event.project_id)
                if node is not None:
                    node.parent = event.workspace_id
            case KeyAssigned():
                t.key_projects[event.key_id] = event.project_id
                self._governed.add(tenant_id)
            case LevelLimitsSet():
                values = t.limits.setdefault((event.level, event.level_id, event.model), {})
                for name in LEVEL_LIMIT_FIELDS:
                    value = getattr(event, name)
                    if value is not None:
                        values[name] = value
                self._governed.add(tenant_id)
            case BudgetSet():
                budgets = t.budgets.setdefault((event.level, event.level_id), {})
                if event.amount_micros is None:
                    budgets.pop(event.period, None)
                else:
                    budgets[event.period] = Budget(
                        event.period, event.amount_micros, event.currency
                    )
                self._governed.add(tenant_id)
            case TimeZoneSet():
                t.zone_name = event.time_zone
            case RunPolicySet():
                t.run_policies.setdefault(event.project_id, []).append((at, _run_limits(event)))
            case RunStarted():
                if event.run_id not in t.runs:
                    limits = _run_limits(event)
                    t.runs[event.run_id] = Run(
                        tenant_id, event.run_id, event.project_id, limits, at, event.implicit
                    )
            case RunEnded():
                run = t.runs.get(event.run_id)
                if run is not None and run.ended_at is None:
                    t.runs[event.run_id] = Run(
                        run.tenant_id, run.run_id, run.project_id, run.limits, run.started_at,
                        run.implicit, at,
                    )  # fmt: skip
            case _:
                return
        self._paths.clear()
        self._rules.clear()
        self._policies.clear()
        self._run_policies.clear()
        self._rates.clear()

    # --- questions ----------------------------------------------------------------------------

    def workspace(self, tenant_id: str, workspace_id: str) -> Level | None:
        node = self._tenant(tenant_id).workspaces.get(workspace_id)
        return None if node is None else Level("workspace", node.level_id, node.name)

    def project(self, tenant_id: str, project_id: str) -> Level | None:
        node = self._tenant(tenant_id).projects.get(project_id)
        return None if node is None else Level("project", node.level_id, node.name)

    def project_of_key(self, tenant_id: str, key_id: str) -> str | None:
        return self._tenant(tenant_id).key_projects.get(key_id)

    def workspaces(self, tenant_id: str) -> list[Level]:
        nodes = self._tenant(tenant_id).workspaces.values()
        return [Level("workspace", n.level_id, n.name) for n in nodes]

    def projects(self, tenant_id: str) -> list[tuple[Level, str | None]]:
        """Each project with its workspace id."""
        return [
            (Level("project", n.level_id, n.name), n.parent)
            for n in self._tenant(tenant_id).projects.values()
        ]

    def time_zone_name(self, tenant_id: str) -> str:
        return self._tenant(tenant_id).zone_name

    def budgets(self, tenant_id: str, level: str, level_id: str) -> dict[str, int]:
        """period -> amount_micros set at one level (each in its budget's currency:
        `level_budgets`)."""
        found = self.level_budgets(tenant_id, level, level_id)
        return {period: budget.amount_micros for period, budget in found.items()}

    def level_budgets(self, tenant_id: str, level: str, level_id: str) -> dict[str, Budget]:
        """period -> the budget set at one level, with its currency."""
        return dict(self._tenant(tenant_id).budgets.get((level, level_id), {}))

    def level_limits(self, tenant_id: str, level: str, level_id: str, model: str) -> LevelLimits:
        """A level's own limits for a model: the "*" entry, then the base name, then the exact
        version, each replacing only the fields it set."""
        t = self._tenant(tenant_id)
        base = base_model(model)
        scopes = ("*", base) if base == model else ("*", base, model)
        values: dict[str, int] = {}
        for scope in scopes:
            values.update(t.limits.get((level, level_id, scope), {}))
        return LevelLimits(**values)

    def level_rates(
        self, tenant_id: str, level: str, level_id: str, model: str
    ) -> tuple[int | None, int | None]:
        """A level's own (requests/min, tokens/min) for a model (None: not limited there),
        kept until the next hierarchy event: asked for every other edge's admission folded."""
        cache_key = (tenant_id, level, level_id, model)
        found = self._rates.get(cache_key)
        if found is None:
            # An end user's limits are its project's per-end-user ones ("<project>/<hash>").
            set_at = level_id.split("/", 1)[0] if level == "end_user" else level_id
            limits = self.level_limits(tenant_id, level, set_at, model)
            found = self._rates[cache_key] = (limits.rpm, limits.tpm)
        return found

    def run_policy(
        self, tenant_id: str, project_id: str | None, at: datetime | None = None
    ) -> RunLimits:
        """The project's run policy: the latest set, or the one in force at instant `at`."""
        if project_id is None:
            return RunLimits()
        for set_at, limits in reversed(self._tenant(tenant_id).run_policies.get(project_id, ())):
            if at is None or set_at <= at:
                return limits
        return RunLimits()

    def in_force(self, run: Run) -> Run:
        """A run with the limits that bind it. A run a call started (implicit) has no budget of
        its own: it takes its project's run policy in force at its start instant, whenever this
        view learns of it. So a policy set just before an agent's first call binds the run
        even if the edge that started it had not heard of the policy yet; the calls admitted
        meanwhile (within one propagation delay) count against it. An explicit run keeps the
        limits it was created with."""
        if not run.implicit:
            return run
        limits = self.run_policy(run.tenant_id, run.project_id, run.started_at)
        return run if limits == run.limits else replace(run, limits=limits)

    def run(self, tenant_id: str, run_id: str) -> Run | None:
        found = self._tenant(tenant_id).runs.get(run_id)
        return None if found is None else self.in_force(found)

    def runs(self, tenant_id: str) -> list[Run]:
        return [self.in_force(run) for run in self._tenant(tenant_id).runs.values()]

    def path(self, tenant_id: str, key_id: str) -> tuple[Level, ...]:
        """The levels a key's requests pass, organization first, key last."""
        return tuple(level for level, _ in self._resolved(tenant_id, key_id, "*"))

    def policy(
        self, tenant_id: str, key_id: str, model: str, now: datetime, run: Run | None = None
    ) -> PathPolicy | None:
        """What an admission of this key's request decides over below the organization's
        limits, or None when nothing is set for the tenant (and the run is None)."""
        if tenant_id not in self._governed and run is None:
            return None
        cache_key = (tenant_id, key_id, model)
        now_s = now.timestamp()
        cached = (self._policies if run is None else self._run_policies).get(cache_key)
        # Reused while it is the same run (the same Run: a run that ended, or whose policy
        # came into force, is another object) and still the day it was built for (the same
        # day window object: the same day and month).
        if cached is not None and cached.run is run:
            day_of = self._days.get(cached.zone_name)
            if day_of is not None and day_of[0] <= now_s < day_of[1] and cached.day is day_of[2]:
                return cached
        t = self._tenant(tenant_id)
        found = self._rules.get(cache_key)
        if found is None:
            built = []
            for level, limits in self._resolved(tenant_id, key_id, model):
                set_here = t.budgets.get((level.kind, level.level_id)) or {}
                budgets = tuple(budget for _, budget in sorted(set_here.items()))
                built.append(
                    LevelRule(level, limits, budgets, (tenant_id, level.kind, level.level_id))
                )
            found = self._rules[cache_key] = _static_path(tuple(built))
        zone = t.zone_name
        day_of = self._days.get(zone)
        if day_of is None or not day_of[0] <= now_s < day_of[1]:
            day_of = self._days[zone] = _day_window(now, time_zone(zone))
        rules, level_keys, kv_keys, workspace_id, project_id, context, output, plan = found
        policy = PathPolicy(
            tenant_id, key_id, rules, day_of[2], day_of[3], run, zone, level_keys, kv_keys,
            workspace_id, project_id, context, output, plan,
        )  # fmt: skip
        (self._policies if run is None else self._run_policies)[cache_key] = policy
        return policy

    def _resolved(
        self, tenant_id: str, key_id: str, model: str
    ) -> tuple[tuple[Level, LevelLimits | None], ...]:
        cache_key = (tenant_id, key_id, model)
        found = self._paths.get(cache_key)
        if found is not None:
            return found
        t = self._tenant(tenant_id)
        levels = [Level("org", tenant_id, tenant_id)]
        project_id = t.key_projects.get(key_id)
        project = t.projects.get(project_id) if project_id else None
        if project is not None:
            workspace = t.workspaces.get(project.parent) if project.parent else None
            if workspace is not None:
                levels.append(Level("workspace", workspace.level_id, workspace.name))
            levels.append(Level("project", project.level_id, project.name))
        levels.append(Level("key", key_id, key_id))
        resolved = []
        for level in levels:
            limits = None
            if level.kind != "org":
                own = self.level_limits(tenant_id, level.kind, level.level_id, model)
                limits = None if own.empty else own
            resolved.append((level, limits))
        found = self._paths[cache_key] = tuple(resolved)
        return found

    def _tenant(self, tenant_id: str) -> _Tenant:
        return self._tenants.get(tenant_id) or _EMPTY


_EMPTY: Final = _Tenant()

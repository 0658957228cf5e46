"""Where a tenant's requests may run and what of their content is kept: residency (the regions
a tenant or one of its projects is pinned to) and retention (`standard`, or `zero`: no response
kept for a replay, batch files deleted once used). Facts on the tenant's stream, decided here
and folded by `DataPolicy` (`ControlView.data_policy`).

A project narrows its tenant, never widens it: its regions must lie within the tenant's pin,
the regions in force are the intersection of both, and zero retention at either level wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Final

from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError

REGION: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
# A pin is a short list an operator types; the bound keeps the event (and every edge's view of
# it) small whatever is sent.
MAX_REGIONS: Final = 16
RETENTION_TIERS: Final = ("standard", "zero")
ZERO: Final = "zero"
STANDARD: Final = "standard"


# --- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResidencySet(Event):
    """The tenant (`project_id` "") or one of its projects may be served only by replicas in
    these regions (sorted, comma-separated: a string, so the payload round-trips exactly)."""

    EVENT_TYPE: ClassVar[str] = "ResidencySet"
    tenant_id: str
    project_id: str
    regions: str


@dataclass(frozen=True, slots=True)
class ResidencyCleared(Event):
    EVENT_TYPE: ClassVar[str] = "ResidencyCleared"
    tenant_id: str
    project_id: str


@dataclass(frozen=True, slots=True)
class RetentionSet(Event):
    EVENT_TYPE: ClassVar[str] = "RetentionSet"
    tenant_id: str
    project_id: str
    tier: str  # standard | zero


DATA_POLICY_EVENTS: Final = (ResidencySet, ResidencyCleared, RetentionSet)


# --- commands ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetResidency:
    tenant_id: str
    regions: tuple[str, ...]
    project_id: str | None = None  # None: the tenant itself


@dataclass(frozen=True, slots=True)
class ClearResidency:
    tenant_id: str
    project_id: str | None = None


@dataclass(frozen=True, slots=True)
class SetRetention:
    tenant_id: str
    tier: str  # standard | zero
    project_id: str | None = None


DataPolicyCommand = SetResidency | ClearResidency | SetRetention
DATA_POLICY_COMMANDS: Final = (SetResidency, ClearResidency, SetRetention)


# --- the fold ----------------------------------------------------------------------------------


class DataPolicy:
    """Residency pins and retention tiers by (tenant, project "" for the tenant)."""

    def __init__(self) -> None:
        self._regions: dict[tuple[str, str], frozenset[str]] = {}
        self._zero: set[tuple[str, str]] = set()

    def apply(self, event: Event) -> None:
        match event:
            case ResidencySet():
                regions = frozenset(r for r in event.regions.split(",") if r)
                self._regions[(event.tenant_id, event.project_id)] = regions
            case ResidencyCleared():
                self._regions.pop((event.tenant_id, event.project_id), None)
            case RetentionSet():
                if event.tier == ZERO:
                    self._zero.add((event.tenant_id, event.project_id))
                else:
                    self._zero.discard((event.tenant_id, event.project_id))

    def pinned(self, tenant_id: str, project_id: str | None = None) -> frozenset[str] | None:
        """The regions set at exactly this level (None: none set there)."""
        return self._regions.get((tenant_id, project_id or ""))

    def regions(self, tenant_id: str, project_id: str | None = None) -> frozenset[str] | None:
        """The regions a request of this tenant (and project) may run in: None when neither
        level is pinned, else the intersection of the pins (possibly empty: nowhere)."""
        tenant = self._regions.get((tenant_id, ""))
        project = self._regions.get((tenant_id, project_id)) if project_id else None
        if tenant is None:
            return project
        return tenant if project is None else tenant & project

    def tier_at(self, tenant_id: str, project_id: str | None = None) -> str:
        """The tier set at exactly this level."""
        return ZERO if (tenant_id, project_id or "") in self._zero else STANDARD

    def retention(self, tenant_id: str, project_id: str | None = None) -> str:
        """The tier in force for a request: zero when the tenant or its project says so."""
        if (tenant_id, "") in self._zero:
            return ZERO
        if project_id and (tenant_id, project_id) in self._zero:
            return ZERO
        return STANDARD


# --- decide ------------------------------------------------------------------------------------


def parse_regions(text: str) -> tuple[str, ...]:
    """`eu-west,eu-central` as region names, in order, duplicates dropped (not yet checked)."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def check_region(region: str, field: str = "regions") -> str:
    if not REGION.fullmatch(region):
        raise DomainError(
            "bad_region", f"region {region[:40]!r} must match {REGION.pattern}", field=field
        )
    return region


def decide_data_policy(
    policy: DataPolicy, command: DataPolicyCommand, *, project_exists: bool
) -> tuple[Event, ...]:
    """The events of a residency or retention command (the caller has checked the tenant;
    `project_exists`: the named project is the tenant's). A repeat that changes nothing: ()."""
    project = command.project_id or ""
    if command.project_id is not None and not project_exists:
        raise DomainError(
            "unknown_project", f"no project {command.project_id!r} in tenant "
            f"{command.tenant_id!r}", field="project",
        )  # fmt: skip
    match command:
        case SetResidency():
            regions = tuple(dict.fromkeys(command.regions))
            if not regions:
                raise DomainError(
                    "no_regions",
                    "a residency names at least one region (clear it instead)",
                    field="regions",
                )
            if len(regions) > MAX_REGIONS:
                raise DomainError(
                    "too_many_regions", f"at most {MAX_REGIONS} regions", field="regions"
                )
            for region in regions:
                check_region(region)
            wanted = frozenset(regions)
            tenant_pin = policy.pinned(command.tenant_id)
            if project and tenant_pin is not None and not wanted <= tenant_pin:
                outside = ", ".join(sorted(wanted - tenant_pin))
                raise DomainError(
                    "region_outside_tenant",
                    f"{outside}: outside the tenant's regions ({', '.join(sorted(tenant_pin))})",
                    field="regions",
                )
            if policy.pinned(command.tenant_id, project) == wanted:
                return ()
            return (ResidencySet(command.tenant_id, project, ",".join(sorted(wanted))),)
        case ClearResidency():
            if policy.pinned(command.tenant_id, project) is None:
                return ()
            return (ResidencyCleared(command.tenant_id, project),)
        case SetRetention():
            if command.tier not in RETENTION_TIERS:
                raise DomainError(
                    "bad_retention", f"retention {command.tier!r} is not one of "
                    f"{RETENTION_TIERS}", field="tier",
                )  # fmt: skip
            if policy.tier_at(command.tenant_id, project) == command.tier:
                return ()
            return (RetentionSet(command.tenant_id, project, command.tier),)

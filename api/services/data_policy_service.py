"""Residency and retention commands through the control plane's one command handler
(`ControlService.execute`): what `tollgate residency` and `tollgate retention` run, and what an
admin front end would call with the same validation and the same events."""

from __future__ import annotations

from typing import Any

from tollgate_llm.api.services.control_service import ControlService
from tollgate_llm.domain.control_plane.data_policy import (
    ClearResidency,
    SetResidency,
    SetRetention,
    parse_regions,
)
from tollgate_llm.domain.control_plane.state import tenant_stream


def set_residency(
    service: ControlService, tenant: str, regions: str, project: str | None = None
) -> bool:
    """Pin the tenant (or one of its projects) to `regions` ("eu-west,eu-central"); False when
    it was pinned to exactly those already."""
    command = SetResidency(tenant, parse_regions(regions), project)
    return bool(service.execute(tenant_stream(tenant), command))


def clear_residency(service: ControlService, tenant: str, project: str | None = None) -> bool:
    command = ClearResidency(tenant, project)
    return bool(service.execute(tenant_stream(tenant), command))


def set_retention(
    service: ControlService, tenant: str, tier: str, project: str | None = None
) -> bool:
    command = SetRetention(tenant, tier, project)
    return bool(service.execute(tenant_stream(tenant), command))


def data_policy(service: ControlService, tenant: str) -> dict[str, Any]:
    """The tenant's pins and tiers as set, level by level, and what is in force for each
    project (a project narrows its tenant)."""
    view = service.view
    view._tenant_or_error(tenant)
    policy = view.data_policy

    def regions(found: frozenset[str] | None) -> list[str] | None:
        return None if found is None else sorted(found)

    projects = [level.level_id for level, _ in view.hierarchy.projects(tenant)]
    return {
        "tenant": tenant,
        "regions": regions(policy.pinned(tenant)),
        "retention": policy.tier_at(tenant),
        "projects": [
            {
                "project": project,
                "regions": regions(policy.pinned(tenant, project)),
                "retention": policy.tier_at(tenant, project),
                "regions_in_force": regions(policy.regions(tenant, project)),
                "retention_in_force": policy.retention(tenant, project),
            }
            for project in sorted(projects)
        ],
    }

"""Where a tenant's requests may run and what of them is kept: `tollgate residency` and
`tollgate retention` (domain/control_plane/data_policy.py)."""

from __future__ import annotations

import json

import click

from tollgate_llm.api.services import control_service as control
from tollgate_llm.api.services import data_policy_service as policy
from tollgate_llm.cli.common import control_options, database_option, one_line_errors
from tollgate_llm.domain.audit.events import Actor


@click.group()
def residency() -> None:
    """Pin a tenant or project to regions: its requests are served only by replicas there."""


@residency.command("set")
@click.option("--tenant", required=True)
@click.option("--project", default=None, help="pin one project (within the tenant's regions)")
@click.option("--regions", required=True, help="comma-separated, e.g. eu-west,eu-central")
@control_options
@one_line_errors
def residency_set(
    tenant: str, project: str | None, regions: str, database_url: str, actor: Actor
) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = policy.set_residency(service, tenant, regions, project)
        pinned = service.view.data_policy.pinned(tenant, project)
    where = ", ".join(sorted(pinned or ()))
    state = "pinned to" if changed else "was already pinned to"
    click.echo(f"{_level(tenant, project)} {state} {where}")


@residency.command("clear")
@click.option("--tenant", required=True)
@click.option("--project", default=None)
@control_options
@one_line_errors
def residency_clear(tenant: str, project: str | None, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = policy.clear_residency(service, tenant, project)
    state = "no longer pinned" if changed else "was not pinned"
    click.echo(f"{_level(tenant, project)} {state}")


@click.group()
def retention() -> None:
    """What is kept of a tenant's or project's requests: standard, or zero (no response kept
    for an Idempotency-Key replay, batch files deleted once used)."""


@retention.command("set")
@click.option("--tenant", required=True)
@click.option("--project", default=None)
@click.option("--zero", "tier", flag_value="zero", help="keep no content at all")
@click.option("--standard", "tier", flag_value="standard", help="the default tier")
@control_options
@one_line_errors
def retention_set(
    tenant: str, project: str | None, tier: str | None, database_url: str, actor: Actor
) -> None:
    if tier is None:
        raise click.UsageError("give --zero or --standard")
    with control.ControlService.open(database_url, actor) as service:
        changed = policy.set_retention(service, tenant, tier, project)
    state = "is now" if changed else "was already"
    click.echo(f"{_level(tenant, project)} {state} on {tier} retention")


@click.command("data-policy")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def data_policy_show(tenant: str, database_url: str) -> None:
    """A tenant's residency and retention, as set and as in force for each project (JSON)."""
    with control.ControlService.open(database_url) as service:
        click.echo(json.dumps(policy.data_policy(service, tenant), indent=2))


def _level(tenant: str, project: str | None) -> str:
    return f"{tenant}/{project}" if project else tenant


COMMANDS = (residency, retention, data_policy_show)

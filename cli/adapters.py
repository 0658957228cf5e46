"""A tenant's LoRA adapters: `tollgate adapters register|revoke|list|show|price`
(domain/control_plane/adapters.py)."""

from __future__ import annotations

import json

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.api.services import adapter_service as adapters_svc
from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import (
    control_options,
    database_option,
    instant,
    micros,
    one_line_errors,
)
from tollgate_llm.cli.options import settings_options
from tollgate_llm.domain.audit.events import Actor


@click.group()
def adapters() -> None:
    """LoRA adapters of a tenant's own, served by the replicas of their base model."""


@adapters.command("register")
@click.option("--tenant", required=True)
@click.option("--name", required=True, help="what the tenant's requests ask for (`model`)")
@click.option("--base", required=True, help="the base model (name or version) it adapts")
@click.option("--path", required=True, help="its directory, as the replicas read it")
@click.option("--rank", type=int, default=None, help="default: `r` of PATH/adapter_config.json")
@click.option("--project", "projects", multiple=True, help="only these projects' keys (repeat)")
@control_options
@one_line_errors
def adapters_register(
    tenant: str, name: str, base: str, path: str, rank: int | None,
    projects: tuple[str, ...], database_url: str, actor: Actor,
) -> None:  # fmt: skip
    with control.ControlService.open(database_url, actor) as service:
        adapter = adapters_svc.register(service, tenant, name, base, path, rank, projects)
    scope = ", ".join(sorted(adapter.projects)) or "every key"
    click.echo(
        f"adapter {tenant}/{name} (rank {adapter.rank}, on {adapter.base_model}) v"
        f"{adapter.version} for {scope}"
    )


@adapters.command("revoke")
@click.option("--tenant", required=True)
@click.option("--name", required=True)
@control_options
@one_line_errors
def adapters_revoke(tenant: str, name: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = adapters_svc.revoke(service, tenant, name)
    click.echo(f"adapter {tenant}/{name} {'revoked' if changed else 'was revoked already'}")


@adapters.command("list")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def adapters_list(tenant: str, database_url: str) -> None:
    """A tenant's adapters, revoked ones included (JSON)."""
    with control.ControlService.open(database_url) as service:
        click.echo(json.dumps(adapters_svc.listing(service, tenant), indent=2))


@adapters.command("show")
@click.option("--tenant", required=True)
@click.option("--name", required=True)
@database_option
@one_line_errors
def adapters_show(tenant: str, name: str, database_url: str) -> None:
    with control.ControlService.open(database_url) as service:
        click.echo(json.dumps(adapters_svc.show(service, tenant, name), indent=2))


@adapters.command("price")
@click.option("--tenant", required=True)
@click.option("--name", required=True)
@click.option("--prompt", "prompt_", required=True, help="price per 1M prompt tokens")
@click.option("--completion", required=True, help="price per 1M completion tokens")
@click.option("--cached", required=True, help="price per 1M cached prompt tokens")
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@settings_options("database_url", "currency", "actor")
@one_line_errors
def adapters_price(
    tenant: str, name: str, prompt_: str, completion: str, cached: str,
    effective_at: str | None, settings: Settings,
) -> None:  # fmt: skip
    """The adapter's own price (without one, it is billed at its base model's)."""
    at = instant(effective_at) if effective_at else None
    actor = control.operator(settings.actor, required=settings.require_actor)
    with control.ControlService.open(settings.store_url(), actor) as service:
        at = adapters_svc.set_price(
            service, tenant, name, micros(prompt_, "--prompt"),
            micros(completion, "--completion"), micros(cached, "--cached"), at,
            currency=settings.currency,
        )  # fmt: skip
    click.echo(f"price for adapter {tenant}/{name} in {settings.currency} from {at.isoformat()}")


COMMANDS = (adapters,)

"""Who may call and how much: tenants, keys, limits, workspaces, projects, budgets, runs,
fallbacks."""

from __future__ import annotations

from typing import Any

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import (
    F,
    control_options,
    database_option,
    instant,
    micros,
    one_line_errors,
)
from tollgate_llm.cli.options import settings_options
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.errors import DomainError

# --- tenants, keys, limits, prices ---------------------------------------------------------------


@click.group()
def tenants() -> None:
    """Tenants and their plans."""


@tenants.command("create")
@click.argument("name")
@click.option(
    "--plan", type=str, default="standard", show_default=True, help="free | standard | enterprise"
)
@control_options
@one_line_errors
def tenants_create(name: str, plan: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.create_tenant(name, plan)
    click.echo(f"tenant {name} created on the {plan} plan")


@tenants.command("plan")
@click.argument("name")
@click.option("--plan", required=True, help="free | standard | enterprise")
@control_options
@one_line_errors
def tenants_plan(name: str, plan: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.change_plan(name, plan)
    click.echo(f"tenant {name} moved to the {plan} plan")


@tenants.command("list")
@database_option
@one_line_errors
def tenants_list(database_url: str) -> None:
    with control.ControlService.open(database_url) as service:
        for tenant in service.list_tenants():
            click.echo(f"{tenant.tenant_id}\t{tenant.plan}")


@click.group()
def keys() -> None:
    """API keys (stored only as SHA-256 hashes)."""


@keys.command("issue")
@click.option("--tenant", required=True)
@click.option(
    "--scope",
    type=click.Choice(["customer", "finance", "support", "admin"]),
    default="customer",
    show_default=True,
)
@click.option("--project", default=None, help="its project (default: the organization)")
@control_options
@one_line_errors
def keys_issue(
    tenant: str, scope: str, project: str | None, database_url: str, actor: Actor
) -> None:
    """Print a new key: its id, then the secret alone on the last line (shown once)."""
    with control.ControlService.open(database_url, actor) as service:
        key_id, secret = service.issue_key(tenant, scope, project)
    click.echo(f"issued {scope} key {key_id} for tenant {tenant}; store it now, it is not kept:")
    click.echo(secret)


@keys.command("assign")
@click.argument("key_id")
@click.option("--tenant", required=True)
@click.option("--project", required=True)
@control_options
@one_line_errors
def keys_assign(key_id: str, tenant: str, project: str, database_url: str, actor: Actor) -> None:
    """Move a key into a project (its requests are then bounded by the project's levels)."""
    with control.ControlService.open(database_url, actor) as service:
        service.assign_key(tenant, key_id, project)
    click.echo(f"key {key_id} belongs to project {project}")


@keys.command("revoke")
@click.argument("key_id")
@click.option("--tenant", required=True)
@control_options
@one_line_errors
def keys_revoke(key_id: str, tenant: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.revoke_key(tenant, key_id)
    click.echo(f"key {key_id} revoked")


@click.group()
def limits() -> None:
    """Per-tenant, per-model limits (unset options keep the plan's default)."""


def _non_negative(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise click.BadParameter("must be zero or more", ctx=ctx, param=param)
    return value


def _level(
    tenant: str, workspace: str | None, project: str | None, key: str | None, *, org: bool,
    per_end_user: bool = False,
) -> tuple[str, str] | None:  # fmt: skip
    """The one level named by --workspace / --project / --key (None: the organization), or with
    --per-end-user the end users of --project (the admin API's rule: control.level_of)."""
    try:
        return control.level_of(tenant, workspace, project, key, org=org,
                                per_end_user=per_end_user)  # fmt: skip
    except DomainError:
        if per_end_user:
            raise click.UsageError("--per-end-user takes --project (and no other level)") from None
        raise click.UsageError("give at most one of --workspace, --project, --key") from None


level_options = [
    click.option("--workspace", default=None, help="a workspace of the tenant"),
    click.option("--project", default=None, help="a project of the tenant"),
    click.option("--key", "key_id", default=None, help="an API key id of the tenant"),
]


def with_level(fn: F) -> F:
    for option in reversed(level_options):
        fn = option(fn)
    return fn


@limits.command("set")
@click.option("--tenant", required=True)
@with_level
@click.option(
    "--model", default=None,
    help="model name, version, or * for every model (required, except with --per-end-user: *)",
)
@click.option(
    "--per-end-user", is_flag=True,
    help="with --project: the limits of each end user of the project (the request's `user`, "
    "`safety_identifier` or X-Tollgate-End-User)",
)
@click.option("--usd-per-day", default=None, help="with --per-end-user: a daily budget in USD")
@click.option(
    "--amount-per-day", default=None,
    help="with --per-end-user: a daily budget in --currency, e.g. 1.00",
)
@click.option("--currency", default="USD", help="ISO 4217 of --amount-per-day (default USD)")
@click.option("--rpm", type=int, callback=_non_negative, help="requests per minute")
@click.option("--tpm", type=int, callback=_non_negative, help="tokens per minute")
@click.option("--max-context", type=int, callback=_non_negative, help="max prompt tokens")
@click.option("--max-output", type=int, callback=_non_negative, help="max completion tokens")
@click.option(
    "--kv-seconds",
    type=int,
    callback=_non_negative,
    help="cap on concurrent estimated KV GiB-seconds in flight",
)
@click.option(
    "--reserved-kv-seconds",
    type=int,
    callback=_non_negative,
    help="enterprise reserved floor, KV GiB-seconds",
)
@control_options
@one_line_errors
def limits_set(
    tenant: str,
    workspace: str | None,
    project: str | None,
    key_id: str | None,
    model: str | None,
    per_end_user: bool,
    usd_per_day: str | None,
    amount_per_day: str | None,
    currency: str,
    rpm: int | None,
    tpm: int | None,
    max_context: int | None,
    max_output: int | None,
    kv_seconds: int | None,
    reserved_kv_seconds: int | None,
    database_url: str,
    actor: Actor,
) -> None:
    """Limits of the organization (no level option) or of one workspace, project or key; a
    request is admitted only if every level on its path has room. With --per-end-user, the
    limits (and daily budget) of each end user of the project, each on its own."""
    if per_end_user or usd_per_day is not None or amount_per_day is not None:
        _end_user_limits_set(
            tenant, _level(tenant, workspace, project, key_id, org=False, per_end_user=True),
            model or "*", usd_per_day, amount_per_day, currency, database_url, actor,
            limits={"rpm": rpm, "tpm": tpm, "max_context": max_context, "max_output": max_output,
                    "kv_gib_seconds": kv_seconds, "reserved_kv_gib_seconds": reserved_kv_seconds},
        )  # fmt: skip
        return
    if model is None:
        raise click.UsageError("Missing option '--model'")
    level = _level(tenant, workspace, project, key_id, org=False)
    if level is not None and reserved_kv_seconds is not None:
        raise click.UsageError("--reserved-kv-seconds is an organization's limit")
    with control.ControlService.open(database_url, actor) as service:
        service.set_limits_at(
            tenant, level, model, rpm=rpm, tpm=tpm, max_context=max_context,
            max_output=max_output, kv_gib_seconds=kv_seconds,
            reserved_kv_gib_seconds=reserved_kv_seconds,
        )  # fmt: skip
    if level is not None:
        click.echo(f"limits for {level[0]} {level[1]} of {tenant} on {model} recorded")
    else:
        click.echo(f"limits for {tenant} on {model} recorded")


def _end_user_limits_set(
    tenant: str, level: tuple[str, str] | None, model: str, usd_per_day: str | None,
    amount_per_day: str | None, currency: str, database_url: str, actor: Actor, *,
    limits: dict[str, int | None],
) -> None:  # fmt: skip
    """`limits set --project P --per-end-user`: the rate limits and the daily budget every end
    user of P gets on its own (domain/governance/end_users.py), each recorded as a control-plane
    event (LevelLimitsSet, BudgetSet at level end_user of P) with its actor. Which limits an end
    user takes (rpm, tpm) and that its budget is daily are the command handler's rules, the
    admin API's too."""
    assert level is not None
    if usd_per_day is not None and amount_per_day is not None:
        raise click.UsageError("give --usd-per-day or --amount-per-day, not both")
    budget = usd_per_day if usd_per_day is not None else amount_per_day
    if budget is not None and usd_per_day is not None:
        currency = "USD"
    given = {name: value for name, value in limits.items() if value is not None}
    if not given and budget is None:
        raise click.UsageError("give --rpm, --tpm, --usd-per-day or --amount-per-day")
    option = "--usd-per-day" if usd_per_day is not None else "--amount-per-day"
    amount = None if budget is None else micros(budget, option)  # before anything is recorded
    with control.ControlService.open(database_url, actor) as service:
        if given:
            service.set_limits_at(tenant, level, model, **limits)
        if amount is not None:
            service.set_budget(tenant, *level, "day", amount, currency=currency)
    shown = [f"{name} {value}" for name, value in given.items()]
    if budget is not None:
        shown.append(f"{budget} {currency} a day")
    click.echo(f"limits per end user of project {level[1]} of {tenant}: {', '.join(shown)}")


@limits.command("show")
@click.option("--tenant", required=True)
@click.option("--model", required=True)
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def limits_show(tenant: str, model: str, at_: str | None, database_url: str) -> None:
    """The limits in force for a tenant and model, now or at a past instant."""
    at = instant(at_) if at_ else None
    with control.ControlService.open(database_url) as service:
        shown = service.limits_in_force(tenant, model, at)
    for name, value in shown.items():
        click.echo(f"{name}\t{value}")


# --- the hierarchy, budgets and runs -------------------------------------------------------------


@click.group()
def workspaces() -> None:
    """Workspaces: the level between an organization and its projects."""


@workspaces.command("create")
@click.argument("name")
@click.option("--tenant", required=True)
@control_options
@one_line_errors
def workspaces_create(name: str, tenant: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.create_workspace(tenant, name)
    click.echo(f"workspace {name} created in {tenant}")


@workspaces.command("list")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def workspaces_list(tenant: str, database_url: str) -> None:
    with control.ControlService.open(database_url) as service:
        tree = service.view.hierarchy
        for workspace in tree.workspaces(tenant):
            click.echo(workspace.level_id)
            for project, parent in tree.projects(tenant):
                if parent == workspace.level_id:
                    click.echo(f"  {project.level_id}")


@click.group()
def projects() -> None:
    """Projects: each in a workspace; keys belong to one (`keys issue --project`)."""


@projects.command("create")
@click.argument("name")
@click.option("--tenant", required=True)
@click.option("--workspace", required=True)
@control_options
@one_line_errors
def projects_create(
    name: str, tenant: str, workspace: str, database_url: str, actor: Actor
) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.create_project(tenant, name, workspace)
    click.echo(f"project {name} created in workspace {workspace} of {tenant}")


@projects.command("move")
@click.argument("name")
@click.option("--tenant", required=True)
@click.option("--workspace", required=True, help="the workspace it belongs to from now on")
@control_options
@one_line_errors
def projects_move(name: str, tenant: str, workspace: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.move_project(tenant, name, workspace)
    click.echo(f"project {name} is in workspace {workspace}")


@click.group()
def budgets() -> None:
    """Spend budgets per calendar day or month, at any level."""


@budgets.command("set")
@click.option("--tenant", required=True)
@with_level
@click.option("--period", required=True, type=click.Choice(["day", "month"]))
@click.option("--amount", default=None, help="the budget in --currency, e.g. 25.00")
@click.option("--usd", default=None, help="the same as --amount AMOUNT --currency USD")
@click.option("--clear", is_flag=True, help="remove the budget of that level and period")
@settings_options("database_url", "currency", "actor")
@one_line_errors
def budgets_set(
    tenant: str, workspace: str | None, project: str | None, key_id: str | None, period: str,
    amount: str | None, usd: str | None, clear: bool, settings: Settings,
) -> None:  # fmt: skip
    """Periods are calendar days and months in the organization's time zone (UTC unless set
    with `tollgate budgets timezone`); a new one starts from zero at its first instant. A
    budget counts only the spend priced in its currency (the deployment's unless given)."""
    given = [name for name, value in (("--amount", amount), ("--usd", usd)) if value is not None]
    if len(given) + clear != 1:
        raise click.UsageError("give one of --amount AMOUNT, --usd AMOUNT or --clear")
    currency = "USD" if usd is not None else settings.currency
    level = _level(tenant, workspace, project, key_id, org=True)
    assert level is not None
    micro = None if clear else micros(amount or usd or "", given[0])
    actor = control.operator(settings.actor, required=settings.require_actor)
    with control.ControlService.open(settings.store_url(), actor) as service:
        service.set_budget(tenant, *level, period, micro, currency=currency)
    shown = "cleared" if micro is None else f"{amount or usd} {currency}"
    periodly = {"day": "daily", "month": "monthly"}[period]
    click.echo(f"{periodly} budget of {level[0]} {level[1]}: {shown}")


@budgets.command("show")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def budgets_show(tenant: str, database_url: str) -> None:
    """Each level's spend this month (per currency) against its budgets, with their currency."""
    from datetime import UTC, datetime

    with control.open_backoffice(database_url) as bo:
        tree = bo.spend_tree(tenant, datetime.now(UTC))
    click.echo(f"{tenant}: month from {tree['month_start']} ({tree['time_zone']})")
    click.echo(f"{'level':<32} {'spent this month':>24} {'monthly budget':>20} {'used':>7} "
               f"{'daily budget':>20}")  # fmt: skip
    for row in tree["levels"]:
        name = "  " * row["depth"] + f"{row['level']} {row['name']}"
        spent = " · ".join(f"{a['amount']} {a['currency']}" for a in row["spent"]) or "-"
        month, day = row["month_budget"], row["day_budget"]
        used = "" if row["used_ppm"] is None else f"{row['used_ppm'] / 10_000:.1f} %"
        click.echo(f"{name:<32} {spent:>24} {_shown(month):>20} {used:>7} {_shown(day):>20}")


def _shown(amount: dict[str, Any] | None) -> str:
    return "-" if amount is None else f"{amount['amount']} {amount['currency']}"


@budgets.command("timezone")
@click.option("--tenant", required=True)
@click.option("--zone", required=True, help="an IANA time zone, e.g. Europe/Paris")
@control_options
@one_line_errors
def budgets_timezone(tenant: str, zone: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        service.set_time_zone(tenant, zone)
    click.echo(f"budget periods of {tenant} begin at midnight {zone}")


run_limit_options = [
    click.option("--max-calls", type=int, callback=_non_negative, help="model calls per run"),
    click.option("--max-tool-calls", type=int, callback=_non_negative,
                 help="tool calls the engine may return within a run"),  # fmt: skip
    click.option("--max-wall-s", type=int, callback=_non_negative,
                 help="seconds since the run started"),  # fmt: skip
    click.option("--max-cost", default=None, help="cost per run in --currency, e.g. 0.50"),
    click.option("--max-usd", default=None, help="the same as --max-cost COST --currency USD"),
    click.option("--max-in-flight", type=int, callback=_non_negative,
                 help="calls in flight at once"),  # fmt: skip
]


def with_run_limits(fn: F) -> F:
    for option in reversed(run_limit_options):
        fn = option(fn)
    return fn


def run_limits(
    max_calls: int | None, max_tool_calls: int | None, max_wall_s: int | None,
    max_cost: str | None, max_usd: str | None, max_in_flight: int | None, currency: str,
) -> Any:  # fmt: skip
    """The limits the options give; a cost limit is in `currency` (the deployment's setting),
    or in USD with --max-usd."""
    from tollgate_llm.domain.runs.state import RunLimits

    if max_cost is not None and max_usd is not None:
        raise click.UsageError("give --max-cost or --max-usd, not both")
    cost, option = (max_usd, "--max-usd") if max_usd is not None else (max_cost, "--max-cost")
    return RunLimits(
        max_calls, max_tool_calls, None if max_wall_s is None else max_wall_s * 1000,
        None if cost is None else micros(cost, option), max_in_flight,
        "USD" if max_usd is not None else currency,
    )  # fmt: skip


@click.group()
def runs() -> None:
    """Agent runs: the model calls of one task, under one run budget."""


@runs.command("policy")
@click.option("--tenant", required=True)
@click.option("--project", required=True)
@with_run_limits
@settings_options("database_url", "currency", "actor")
@one_line_errors
def runs_policy(tenant: str, project: str, settings: Settings, **limits: Any) -> None:
    """The run budget a project's runs get where their creator gives none."""
    policy = run_limits(**limits, currency=settings.currency)
    actor = control.operator(settings.actor, required=settings.require_actor)
    with control.ControlService.open(settings.store_url(), actor) as service:
        service.set_run_policy(tenant, project, policy)
    cost = "" if policy.max_cost_micros is None else f" (cost in {policy.currency})"
    click.echo(f"run policy of project {project} recorded{cost}")


@click.group()
def fallbacks() -> None:
    """A tenant's consent to be served another model when the one it asks for has no capacity."""


@fallbacks.command("allow")
@click.option("--tenant", required=True)
@click.option("--from", "from_model", required=True, help="the model asked for (name or version)")
@click.option("--to", "to_model", required=True, help="the model that may serve it instead")
@control_options
@one_line_errors
def fallbacks_allow(
    tenant: str, from_model: str, to_model: str, database_url: str, actor: Actor
) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = service.allow_fallback(tenant, from_model, to_model)
    state = "allowed" if changed else "was already allowed"
    click.echo(f"{tenant}: {from_model} -> {to_model} {state}")


@fallbacks.command("revoke")
@click.option("--tenant", required=True)
@click.option("--from", "from_model", required=True)
@click.option("--to", "to_model", required=True)
@control_options
@one_line_errors
def fallbacks_revoke(
    tenant: str, from_model: str, to_model: str, database_url: str, actor: Actor
) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = service.revoke_fallback(tenant, from_model, to_model)
    state = "revoked" if changed else "was not allowed"
    click.echo(f"{tenant}: {from_model} -> {to_model} {state}")


COMMANDS = (tenants, keys, limits, workspaces, projects, budgets, runs, fallbacks)

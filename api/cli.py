"""The `tollgate` command. Each command is one transaction; errors are one line and exit 1."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any, TypeVar

import click

from api import control_service as control
from api.config import DEFAULT_MODELS, ServeSettings, default_database_url
from api.logs import LOG_FORMATS, setup_logging
from domain.errors import MAX_AMOUNT_MICROS
from domain.leases import LEASE_TTL_S

F = TypeVar("F", bound=Callable[..., Any])

# The embedded fold worker runs at this lower CPU priority than the edge (nice(2) steps).
EMBEDDED_WORKER_NICENESS = 10

database_option = click.option(
    "--database-url",
    envvar="TOLLGATE_DATABASE_URL",
    default=None,
    help="sqlite:///path.db or postgresql+psycopg://user@host/db "
    "(env TOLLGATE_DATABASE_URL; default: a SQLite file under ./data).",
)

log_format_option = click.option(
    "--log-format",
    envvar="TOLLGATE_LOG_FORMAT",
    default="plain",
    show_default=True,
    type=click.Choice(LOG_FORMATS),
    help="the log on stderr: plain text lines or json, one object a line (env TOLLGATE_LOG_FORMAT)",
)


def one_line_errors(fn: F) -> F:
    """Known failures print `tollgate: error: ...` and exit 1; never a traceback (unless
    TOLLGATE_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.exceptions.Exit:
            raise
        except click.ClickException:
            raise
        except Exception as exc:  # noqa: BLE001 - the CLI's one place that renders every error
            if os.environ.get("TOLLGATE_DEBUG"):
                raise
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            click.echo(f"tollgate: error: {message}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


@click.group()
def main() -> None:
    """Tollgate: admission, quota, routing and exact billing in front of vLLM replicas."""


# --- database ------------------------------------------------------------------------------------


@main.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@database_option
@one_line_errors
def db_upgrade(database_url: str | None) -> None:
    """Create or migrate every table to the latest revision."""
    url = database_url or default_database_url()
    revision = control.upgrade(url)
    click.echo(f"database at revision {revision}")


# --- tenants, keys, limits, prices ---------------------------------------------------------------


@main.group()
def tenants() -> None:
    """Tenants and their plans."""


@tenants.command("create")
@click.argument("name")
@click.option(
    "--plan", type=str, default="standard", show_default=True, help="free | standard | enterprise"
)
@database_option
@one_line_errors
def tenants_create(name: str, plan: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.create_tenant(name, plan)
    click.echo(f"tenant {name} created on the {plan} plan")


@tenants.command("plan")
@click.argument("name")
@click.option("--plan", required=True, help="free | standard | enterprise")
@database_option
@one_line_errors
def tenants_plan(name: str, plan: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.change_plan(name, plan)
    click.echo(f"tenant {name} moved to the {plan} plan")


@tenants.command("list")
@database_option
@one_line_errors
def tenants_list(database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        for tenant in service.list_tenants():
            click.echo(f"{tenant.tenant_id}\t{tenant.plan}")


@main.group()
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
@database_option
@one_line_errors
def keys_issue(tenant: str, scope: str, project: str | None, database_url: str | None) -> None:
    """Print a new key: its id, then the secret alone on the last line (shown once)."""
    with control.ControlService.open(database_url) as service:
        key_id, secret = service.issue_key(tenant, scope, project)
    click.echo(f"issued {scope} key {key_id} for tenant {tenant}; store it now, it is not kept:")
    click.echo(secret)


@keys.command("assign")
@click.argument("key_id")
@click.option("--tenant", required=True)
@click.option("--project", required=True)
@database_option
@one_line_errors
def keys_assign(key_id: str, tenant: str, project: str, database_url: str | None) -> None:
    """Move a key into a project (its requests are then bounded by the project's levels)."""
    with control.ControlService.open(database_url) as service:
        service.assign_key(tenant, key_id, project)
    click.echo(f"key {key_id} belongs to project {project}")


@keys.command("revoke")
@click.argument("key_id")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def keys_revoke(key_id: str, tenant: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.revoke_key(tenant, key_id)
    click.echo(f"key {key_id} revoked")


@main.group()
def limits() -> None:
    """Per-tenant, per-model limits (unset options keep the plan's default)."""


def _non_negative(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 0:
        raise click.BadParameter("must be zero or more", ctx=ctx, param=param)
    return value


def _level(
    tenant: str, workspace: str | None, project: str | None, key: str | None, *, org: bool
) -> tuple[str, str] | None:
    """The one level named by --workspace / --project / --key (None: the organization)."""
    given = [(kind, value) for kind, value in
             (("workspace", workspace), ("project", project), ("key", key)) if value]  # fmt: skip
    if len(given) > 1:
        raise click.UsageError("give at most one of --workspace, --project, --key")
    if given:
        return given[0]
    return ("org", tenant) if org else None


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
@click.option("--model", required=True, help="model name, version, or * for every model")
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
@database_option
@one_line_errors
def limits_set(
    tenant: str,
    workspace: str | None,
    project: str | None,
    key_id: str | None,
    model: str,
    rpm: int | None,
    tpm: int | None,
    max_context: int | None,
    max_output: int | None,
    kv_seconds: int | None,
    reserved_kv_seconds: int | None,
    database_url: str | None,
) -> None:
    """Limits of the organization (no level option) or of one workspace, project or key; a
    request is admitted only if every level on its path has room."""
    level = _level(tenant, workspace, project, key_id, org=False)
    if level is not None:
        if reserved_kv_seconds is not None:
            raise click.UsageError("--reserved-kv-seconds is an organization's limit")
        with control.ControlService.open(database_url) as service:
            service.set_level_limits(
                tenant, *level, model, rpm=rpm, tpm=tpm, max_context=max_context,
                max_output=max_output, kv_gib_seconds=kv_seconds,
            )  # fmt: skip
        click.echo(f"limits for {level[0]} {level[1]} of {tenant} on {model} recorded")
        return
    with control.ControlService.open(database_url) as service:
        service.set_limits(
            tenant,
            model,
            rpm=rpm,
            tpm=tpm,
            max_context=max_context,
            max_output=max_output,
            kv_gib_seconds=kv_seconds,
            reserved_kv_gib_seconds=reserved_kv_seconds,
        )
    click.echo(f"limits for {tenant} on {model} recorded")


@limits.command("show")
@click.option("--tenant", required=True)
@click.option("--model", required=True)
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def limits_show(tenant: str, model: str, at_: str | None, database_url: str | None) -> None:
    """The limits in force for a tenant and model, now or at a past instant."""
    at = _instant(at_) if at_ else None
    with control.ControlService.open(database_url) as service:
        shown = service.limits_in_force(tenant, model, at)
    for name, value in shown.items():
        click.echo(f"{name}\t{value}")


# --- the hierarchy, budgets and runs -------------------------------------------------------------


@main.group()
def workspaces() -> None:
    """Workspaces: the level between an organization and its projects."""


@workspaces.command("create")
@click.argument("name")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def workspaces_create(name: str, tenant: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.create_workspace(tenant, name)
    click.echo(f"workspace {name} created in {tenant}")


@workspaces.command("list")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def workspaces_list(tenant: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        tree = service.view.hierarchy
        for workspace in tree.workspaces(tenant):
            click.echo(workspace.level_id)
            for project, parent in tree.projects(tenant):
                if parent == workspace.level_id:
                    click.echo(f"  {project.level_id}")


@main.group()
def projects() -> None:
    """Projects: each in a workspace; keys belong to one (`keys issue --project`)."""


@projects.command("create")
@click.argument("name")
@click.option("--tenant", required=True)
@click.option("--workspace", required=True)
@database_option
@one_line_errors
def projects_create(name: str, tenant: str, workspace: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.create_project(tenant, name, workspace)
    click.echo(f"project {name} created in workspace {workspace} of {tenant}")


@projects.command("move")
@click.argument("name")
@click.option("--tenant", required=True)
@click.option("--workspace", required=True, help="the workspace it belongs to from now on")
@database_option
@one_line_errors
def projects_move(name: str, tenant: str, workspace: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.move_project(tenant, name, workspace)
    click.echo(f"project {name} is in workspace {workspace}")


@main.group()
def budgets() -> None:
    """Spend budgets per calendar day or month, at any level."""


@budgets.command("set")
@click.option("--tenant", required=True)
@with_level
@click.option("--period", required=True, type=click.Choice(["day", "month"]))
@click.option("--usd", default=None, help="the budget, e.g. 25.00")
@click.option("--clear", is_flag=True, help="remove the budget of that level and period")
@database_option
@one_line_errors
def budgets_set(
    tenant: str, workspace: str | None, project: str | None, key_id: str | None, period: str,
    usd: str | None, clear: bool, database_url: str | None,
) -> None:  # fmt: skip
    """Periods are calendar days and months in the organization's time zone (UTC unless set
    with `tollgate budgets timezone`); a new one starts from zero at its first instant."""
    if (usd is None) == (not clear):
        raise click.UsageError("give --usd AMOUNT or --clear")
    level = _level(tenant, workspace, project, key_id, org=True)
    assert level is not None
    amount = None if clear else _micros(usd or "", "--usd")
    with control.ControlService.open(database_url) as service:
        service.set_budget(tenant, *level, period, amount)
    shown = "cleared" if amount is None else f"{usd} USD"
    periodly = {"day": "daily", "month": "monthly"}[period]
    click.echo(f"{periodly} budget of {level[0]} {level[1]}: {shown}")


@budgets.command("timezone")
@click.option("--tenant", required=True)
@click.option("--zone", required=True, help="an IANA time zone, e.g. Europe/Paris")
@database_option
@one_line_errors
def budgets_timezone(tenant: str, zone: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        service.set_time_zone(tenant, zone)
    click.echo(f"budget periods of {tenant} begin at midnight {zone}")


run_limit_options = [
    click.option("--max-calls", type=int, callback=_non_negative, help="model calls per run"),
    click.option("--max-tool-calls", type=int, callback=_non_negative,
                 help="tool calls the engine may return within a run"),  # fmt: skip
    click.option("--max-wall-s", type=int, callback=_non_negative,
                 help="seconds since the run started"),  # fmt: skip
    click.option("--max-usd", default=None, help="cost per run, e.g. 0.50"),
    click.option("--max-in-flight", type=int, callback=_non_negative,
                 help="calls in flight at once"),  # fmt: skip
]


def with_run_limits(fn: F) -> F:
    for option in reversed(run_limit_options):
        fn = option(fn)
    return fn


def run_limits(
    max_calls: int | None, max_tool_calls: int | None, max_wall_s: int | None,
    max_usd: str | None, max_in_flight: int | None,
) -> Any:  # fmt: skip
    from domain.hierarchy import RunLimits

    return RunLimits(
        max_calls, max_tool_calls, None if max_wall_s is None else max_wall_s * 1000,
        None if max_usd is None else _micros(max_usd, "--max-usd"), max_in_flight,
    )  # fmt: skip


@main.group()
def runs() -> None:
    """Agent runs: the model calls of one task, under one run budget."""


@runs.command("policy")
@click.option("--tenant", required=True)
@click.option("--project", required=True)
@with_run_limits
@database_option
@one_line_errors
def runs_policy(tenant: str, project: str, database_url: str | None, **limits: Any) -> None:
    """The run budget a project's runs get where their creator gives none."""
    with control.ControlService.open(database_url) as service:
        service.set_run_policy(tenant, project, run_limits(**limits))
    click.echo(f"run policy of project {project} recorded")


def _micros(text: str, option: str) -> int:
    """A decimal amount of dollars as micro-dollars, or a usage error naming `option`."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite():
        raise click.BadParameter(f"{text!r} is not a decimal amount", param_hint=option)
    if value < 0:
        raise click.BadParameter(f"{text} is negative", param_hint=option)
    if value > MAX_AMOUNT_MICROS // 1_000_000:  # before any arithmetic: 1e999999999 overflows
        raise click.BadParameter(
            f"{text} is over {MAX_AMOUNT_MICROS // 1_000_000:,} dollars", param_hint=option
        )
    micros = value * 1_000_000
    if micros != micros.to_integral_value():
        raise click.BadParameter(
            f"{text} has more precision than a micro-dollar", param_hint=option
        )
    return int(micros)


def _instant(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 instant") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


@main.group()
def prices() -> None:
    """Effective-dated prices per model version (currency units per million tokens)."""


@prices.command("set")
@click.option("--model", required=True)
@click.option("--prompt", "prompt_", required=True, help="price per 1M prompt tokens, e.g. 0.50")
@click.option("--completion", required=True, help="price per 1M completion tokens")
@click.option("--cached", required=True, help="price per 1M cached prompt tokens")
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@database_option
@one_line_errors
def prices_set(
    model: str,
    prompt_: str,
    completion: str,
    cached: str,
    effective_at: str | None,
    database_url: str | None,
) -> None:
    at = _instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url) as service:
        at = service.set_price(
            model, _micros(prompt_, "--prompt"), _micros(completion, "--completion"),
            _micros(cached, "--cached"), at,
        )  # fmt: skip
    click.echo(f"price for {model} effective {at.isoformat()}")


@prices.command("flex-discount")
@click.option("--model", required=True)
@click.option(
    "--percent", required=True, type=click.FloatRange(0, 100),
    help="the flex class's discount on the model's price, e.g. 50",
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@database_option
@one_line_errors
def prices_flex_discount(
    model: str, percent: float, effective_at: str | None, database_url: str | None
) -> None:
    """The flex class's (and the Batch API's) discount on a model's price, effective-dated."""
    at = _instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url) as service:
        at = service.set_flex_discount(model, round(percent * 10_000), at)
    click.echo(f"flex discount for {model}: {percent:g} % effective {at.isoformat()}")


# --- model profiles ------------------------------------------------------------------------------


@main.group()
def models() -> None:
    """Model profiles: the KV-cache shape admission reserves against (effective-dated)."""


@models.command("register")
@click.option("--model", required=True, help="model name or pinned version")
@click.option(
    "--hf-config",
    "hf_config",
    default=None,
    type=click.Path(exists=True, dir_okay=True),
    help="the model's config.json (or its directory): layers, KV heads, head dim, dtype",
)
@click.option("--layers", type=int, default=None)
@click.option("--kv-heads", type=int, default=None)
@click.option("--head-dim", type=int, default=None)
@click.option("--dtype-bytes", type=int, default=None, help="bytes per KV element (bf16: 2)")
@click.option("--mla-rank", type=int, default=None, help="MLA: kv_lora_rank (then --rope-dim)")
@click.option("--rope-dim", type=int, default=None, help="MLA: the decoupled RoPE key width")
@click.option(
    "--max-model-len", type=int, default=None,
    help="default: config.json's max_position_embeddings; a replica's own /v1/models wins",
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@database_option
@one_line_errors
def models_register(
    model: str,
    hf_config: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype_bytes: int | None,
    mla_rank: int | None,
    rope_dim: int | None,
    max_model_len: int | None,
    effective_at: str | None,
    database_url: str | None,
) -> None:
    """Record a model's KV profile. Flags given with --hf-config override what it says."""
    shape = control.profile_shape(
        model, hf_config, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes, kv_lora_rank=mla_rank, rope_dim=rope_dim,
        max_model_len=max_model_len,
    )  # fmt: skip
    at = _instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url) as service:
        profile, at = service.register_model(model, shape, at)
    click.echo(
        f"model profile for {model} effective {at.isoformat()}: "
        f"{profile.kv_bytes_per_token} KV bytes per token"
    )


@models.command("show")
@click.option("--model", required=True)
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def models_show(model: str, at_: str | None, database_url: str | None) -> None:
    """The profile in force (registered, else built-in), and the registered history."""
    import dataclasses

    import orjson

    at = _instant(at_) if at_ else None
    with control.ControlService.open(database_url) as service:
        profile = service.view.model_profile(model, at)
        history = service.view.model_profiles(model)
    shown = {
        **dataclasses.asdict(profile),
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "history": [
            {"effective_at": when.isoformat(), **dataclasses.asdict(p)} for when, p in history
        ],
    }
    click.echo(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())


@main.group()
def slo() -> None:
    """Service-level objectives per tier (time to first token, time per output token)."""


@slo.command("set")
@click.option("--tier", required=True, type=click.Choice(["free", "standard", "enterprise"]))
@click.option("--ttft-ms", required=True, type=click.IntRange(min=1), help="TTFT target, ms")
@click.option(
    "--tpot-ms", required=True, type=click.FloatRange(min=0.001), help="TPOT target, ms"
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: 5 s from now)")
@database_option
@one_line_errors
def slo_set(
    tier: str, ttft_ms: int, tpot_ms: float, effective_at: str | None, database_url: str | None
) -> None:
    at = _instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url) as service:
        at = service.set_slo(tier, ttft_ms, round(tpot_ms * 1000), at)
    click.echo(
        f"SLO for {tier}: TTFT <= {ttft_ms} ms, TPOT <= {tpot_ms:g} ms from {at.isoformat()}"
    )


@slo.command("show")
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def slo_show(at_: str | None, database_url: str | None) -> None:
    at = _instant(at_) if at_ else datetime.now(UTC)
    with control.ControlService.open(database_url) as service:
        for tier in ("free", "standard", "enterprise"):
            objective = service.view.slo(tier, at)
            click.echo(f"{tier}\tttft_ms {objective.ttft_ms}\ttpot_us {objective.tpot_us}")


@main.group()
def fallbacks() -> None:
    """A tenant's consent to be served another model when the one it asks for has no capacity."""


@fallbacks.command("allow")
@click.option("--tenant", required=True)
@click.option("--from", "from_model", required=True, help="the model asked for (name or version)")
@click.option("--to", "to_model", required=True, help="the model that may serve it instead")
@database_option
@one_line_errors
def fallbacks_allow(tenant: str, from_model: str, to_model: str, database_url: str | None) -> None:
    with control.ControlService.open(database_url) as service:
        changed = service.allow_fallback(tenant, from_model, to_model)
    state = "allowed" if changed else "was already allowed"
    click.echo(f"{tenant}: {from_model} -> {to_model} {state}")


@fallbacks.command("revoke")
@click.option("--tenant", required=True)
@click.option("--from", "from_model", required=True)
@click.option("--to", "to_model", required=True)
@database_option
@one_line_errors
def fallbacks_revoke(
    tenant: str, from_model: str, to_model: str, database_url: str | None
) -> None:
    with control.ControlService.open(database_url) as service:
        changed = service.revoke_fallback(tenant, from_model, to_model)
    state = "revoked" if changed else "was not allowed"
    click.echo(f"{tenant}: {from_model} -> {to_model} {state}")


# --- projections -----------------------------------------------------------------------------


@main.group()
def projections() -> None:
    """Read models folded from the event log."""


@projections.command("rebuild")
@click.argument("name", required=False)
@database_option
@one_line_errors
def projections_rebuild(name: str | None, database_url: str | None) -> None:
    """Drop and refold a projection (all of them without NAME); prints each table's digest."""
    for projection, digest, rows in control.rebuild_projections(database_url, name):
        click.echo(f"{projection}\t{rows} rows\tsha256 {digest}")


# --- finance and support -------------------------------------------------------------------

format_option = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
)
range_options = [
    click.option("--from", "start", default=None, help="ISO 8601 (default: 30 days before --to)"),
    click.option("--to", "end", default=None, help="ISO 8601 (default: now)"),
]


def _with_range(fn: F) -> F:
    for option in reversed(range_options):
        fn = option(fn)
    return fn


def _emit(rows: list[dict[str, Any]], fmt: str, columns: tuple[str, ...], title: str) -> None:
    from api.backoffice import to_csv

    if fmt == "json":
        import orjson

        click.echo(orjson.dumps({"data": rows}, option=orjson.OPT_INDENT_2).decode())
    elif fmt == "csv":
        click.echo(to_csv(rows, columns), nl=False)
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in columns:
            table.add_column(
                column,
                justify="right" if column.endswith(("tokens", "micros", "requests")) else "left",
            )
        for row in rows:
            table.add_row(*(str(row.get(c, "")) for c in columns))
        Console(width=None if sys.stdout.isatty() else 200).print(table)


@main.group()
def ledger() -> None:
    """The billing ledger: usage, entries, invoices, reconciliation."""


@ledger.command("usage")
@click.option("--tenant", default=None)
@click.option("--model", default=None)
@click.option(
    "--group-by",
    type=click.Choice(["hour", "day", "model", "key", "workspace", "project", "run"]),
    default="hour",
    show_default=True,
)
@_with_range
@format_option
@database_option
@one_line_errors
def ledger_usage(
    tenant: str | None,
    model: str | None,
    group_by: str,
    start: str | None,
    end: str | None,
    fmt: str,
    database_url: str | None,
) -> None:
    from api.backoffice import GROUP_COLUMNS, USAGE_COLUMNS, parse_range

    with control.open_backoffice(database_url) as bo:
        if tenant is not None:
            bo.billing_tenant("finance", "", tenant)
        lo, hi = parse_range(start, end, datetime.now(UTC))
        rows = bo.usage(tenant, lo, hi, model, group_by)
    extra = GROUP_COLUMNS.get(group_by)
    columns = USAGE_COLUMNS + ((extra,) if extra else ())
    _emit(rows, fmt, columns, f"usage by {group_by}")


@ledger.command("entries")
@click.option("--tenant", default=None)
@click.option("--model", default=None)
@click.option("--limit", default=1000, show_default=True, type=int)
@_with_range
@format_option
@database_option
@one_line_errors
def ledger_entries(
    tenant: str | None,
    model: str | None,
    limit: int,
    start: str | None,
    end: str | None,
    fmt: str,
    database_url: str | None,
) -> None:
    from api.backoffice import ENTRY_COLUMNS, parse_range

    with control.open_backoffice(database_url) as bo:
        if tenant is not None:
            bo.billing_tenant("finance", "", tenant)
        lo, hi = parse_range(start, end, datetime.now(UTC))
        rows = bo.entries(tenant, lo, hi, model, limit, None)
    _emit(rows, fmt, ENTRY_COLUMNS, "ledger entries")


@ledger.command("invoice")
@click.argument("tenant")
@click.option("--period", default=None, help="YYYY-MM (default: the current month, UTC)")
@format_option
@database_option
@one_line_errors
def ledger_invoice(tenant: str, period: str | None, fmt: str, database_url: str | None) -> None:
    from api.backoffice import INVOICE_COLUMNS

    with control.open_backoffice(database_url) as bo:
        invoice = bo.invoice(tenant, period, datetime.now(UTC))
    if fmt == "json":
        import orjson

        click.echo(orjson.dumps(invoice, option=orjson.OPT_INDENT_2).decode())
        return
    _emit(
        invoice["lines"],
        fmt,
        INVOICE_COLUMNS,
        f"invoice {tenant} {invoice['period']}: total {invoice['amount']}",
    )


@ledger.command("goodput")
@click.option("--tenant", default=None)
@click.option(
    "--group-by",
    default="tier",
    show_default=True,
    help="comma-separated: tenant, tier, model, hour",
)
@_with_range
@format_option
@database_option
@one_line_errors
def ledger_goodput(
    tenant: str | None,
    group_by: str,
    start: str | None,
    end: str | None,
    fmt: str,
    database_url: str | None,
) -> None:
    """Requests that ended in the range, by outcome against their tier's objective (attained,
    missed_ttft, missed_tpot, cancelled, failed, ..., refused_quota, invalid), with attainment
    (attained / served) and goodput (attained / offered) in parts per million."""
    from api.backoffice import groups, parse_range
    from ledger.finance import GOODPUT_COLUMNS, GOODPUT_GROUPS

    chosen = groups(group_by, GOODPUT_GROUPS, ("tier",), "group-by")
    with control.open_backoffice(database_url) as bo:
        if tenant is not None:
            bo.billing_tenant("finance", "", tenant)
        lo, hi = parse_range(start, end, datetime.now(UTC))
        rows = bo.goodput(tenant, lo, hi, chosen)
    _emit(rows, fmt, chosen + GOODPUT_COLUMNS, f"goodput by {', '.join(chosen)}")


@ledger.command("reconcile")
@_with_range
@database_option
@one_line_errors
def ledger_reconcile(start: str | None, end: str | None, database_url: str | None) -> None:
    """Admitted vs terminal vs ledger entries, reserved vs refunded vs billed; exit 1 on any
    mismatch."""
    import orjson

    from api.backoffice import parse_range

    with control.open_backoffice(database_url) as bo:
        lo, hi = parse_range(start, end, datetime.now(UTC))
        report = bo.reconciliation(lo, hi)
    click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    if not report["ok"]:
        sys.exit(1)


@main.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="the full timeline as JSON")
@database_option
@one_line_errors
def replay(request_id: str, as_json: bool, database_url: str | None) -> None:
    """Re-fold a request's events: every step, the state after it, quota and billing effects,
    the limits in force at admission, and anomalies."""
    import orjson

    from api.backoffice import timeline_json

    with control.open_backoffice(database_url) as bo:
        timeline = timeline_json(bo.timeline(request_id, "support", "", datetime.now(UTC)))
    if as_json:
        click.echo(orjson.dumps(timeline, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(
        f"{timeline['request_id']}  {timeline['status']}  tenant={timeline['tenant']} "
        f"model={timeline['model']} tier={timeline['tier']}"
    )
    click.echo(
        f"plan at admission: {timeline['plan_at_admission']}  limits: "
        f"{timeline['limits_at_admission']}"
    )
    if timeline.get("project") or timeline.get("run"):
        click.echo(
            f"workspace {timeline['workspace']}  project {timeline['project']}  run "
            f"{timeline['run']}  budget reserved {timeline['budget_reserved_micros']} micro-units"
        )
    rejection = timeline.get("rejection")
    if rejection:
        click.echo(f"refused: {rejection}")
    click.echo(
        f"replica {timeline['replica_id']} (occupancy at routing "
        f"{timeline['replica_occupancy_at_routing']}), ttft {timeline['ttft_ms']} ms, "
        f"tpot {timeline['tpot_us']} us, lease renewals {timeline['lease_renewals']}"
    )
    for step in timeline["events"]:
        effect = " ".join(f"{k}={v}" for k, v in step["quota_effect"].items())
        click.echo(
            f"  {step['occurred_at']}  v{step['stream_version']:<2} {step['type']:<20} "
            f"-> {step['state_after']:<13} {effect}"
        )
    click.echo(f"quota: {timeline['quota']}  tokens: {timeline['tokens']}")
    if timeline["billing"]:
        click.echo(
            f"billed: {timeline['billing']['amount_micros']} micro-units "
            f"({timeline['billing']['terminal']})"
        )
    for anomaly in timeline["anomalies"]:
        click.echo(f"ANOMALY {anomaly['kind']}: {anomaly['detail']}")


# --- serving -----------------------------------------------------------------------------------


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@database_option
@click.option(
    "--simulated-replicas",
    default=2,
    show_default=True,
    type=int,
    help="simulated vLLM replicas per model when no --replica is given",
)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    help="a real vLLM replica: MODEL=URL (MODEL: the version Tollgate serves; the engine's own "
    "name for it is read from its /v1/models)",
)
@click.option(
    "--tokenizer",
    "tokenizers",
    multiple=True,
    help="MODEL=DIR: the model's tokenizer.json and chat template, for the prompt estimate, when "
    "the replica's model directory is not readable here",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    help=f"model versions to simulate (default: {', '.join(DEFAULT_MODELS)})",
)
@click.option(
    "--sim-speed",
    default=1.0,
    show_default=True,
    type=float,
    help="speed multiplier of the simulated engines",
)
@click.option(
    "--autoscale",
    is_flag=True,
    help="add and remove simulated replicas by the autoscaling signal (tollgate_desired_replicas)",
)
@click.option(
    "--cold-start-s",
    default=ServeSettings.cold_start_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="how long a new replica takes before it serves: the signal's lead",
)
@click.option(
    "--scale-down-after-s",
    default=ServeSettings.scale_down_after_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="how long the signal must stay below the fleet before a replica is removed",
)
@click.option(
    "--sim-gpu-blocks",
    default=ServeSettings.sim_gpu_blocks,
    show_default=True,
    type=click.IntRange(min=16),
    help="KV blocks of 16 tokens per simulated replica",
)
@click.option(
    "--sim-max-seqs",
    default=ServeSettings.sim_max_num_seqs,
    show_default=True,
    type=click.IntRange(min=1),
    help="sequences a simulated replica runs at once",
)
@click.option(
    "--flex-ceiling",
    default=ServeSettings.flex_ceiling_ppm / 1_000_000,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    help="KV occupancy below which a replica takes flex work (below every tier's ceiling)",
)
@click.option(
    "--batch-window", "batch_windows", multiple=True,
    help="a Batch API completion window offered beside 24h, e.g. 30s (tests, demos); repeatable",
)
@click.option(
    "--batch-concurrency",
    default=ServeSettings.batch_concurrency,
    show_default=True,
    type=click.IntRange(min=1),
    help="batch items the batch runner keeps in flight at most",
)
@click.option("--no-demo", is_flag=True, help="do not seed the demo tenants and keys")
@click.option(
    "--trusted-proxies",
    envvar="TOLLGATE_TRUSTED_PROXIES",
    default=None,
    help="comma-separated CIDRs of proxies whose X-Forwarded-For names the client for the "
    "per-address limits (env TOLLGATE_TRUSTED_PROXIES; default: none, the TCP peer counts)",
)
@click.option(
    "--metrics-token",
    envvar="TOLLGATE_METRICS_TOKEN",
    default=None,
    help="/metrics answers only `Authorization: Bearer TOKEN` (env TOLLGATE_METRICS_TOKEN; "
    "Prometheus: `authorization: {credentials: TOKEN}`)",
)
@click.option(
    "--auth-failures-per-minute",
    default=ServeSettings.auth_failures_per_minute,
    show_default=True,
    type=click.IntRange(min=0),
    help="failed authentications per minute from one client address before every "
    "authentication from it is refused for a while (0: no limit)",
)
@click.option(
    "--slow-reader-timeout",
    "slow_reader_s",
    default=ServeSettings.slow_reader_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="seconds a streaming client may read nothing while its buffer is full before its "
    "generation is cancelled and billed as far as the engine got (0: never)",
)
@click.option(
    "--stream-buffer-chunks",
    default=ServeSettings.stream_buffer_chunks,
    show_default=True,
    type=click.IntRange(min=2),
    help="chunks buffered per stream for a client that reads slower than the engine writes",
)
@click.option(
    "--lease-renew-s",
    default=ServeSettings.lease_renew_s,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="seconds between this edge's lease renewals (one event for all its streams): what a "
    "crash of the edge can leave unbilled",
)
@click.option(
    "--client-send-buffer",
    "client_send_buffer_bytes",
    default=ServeSettings.client_send_buffer_bytes,
    show_default=True,
    type=click.IntRange(min=0),
    help="bytes of kernel send buffer per client connection (0: the kernel's autotuning)",
)
@click.option(
    "--keep-alive-s",
    default=ServeSettings.keep_alive_s,
    show_default=True,
    type=click.IntRange(min=1),
    help="seconds an idle client connection is kept open (keep it above the clients' own idle "
    "expiry, or a client may reuse a connection just as it is closed)",
)
@click.option(
    "--no-fold-worker",
    is_flag=True,
    help="do not start the fold worker (billing, read models, leases) as a child process; "
    "run `tollgate worker` against the same database instead",
)
@click.option(
    "--predictor",
    "predictor_path",
    default=None,
    help="an output-predictor model file, or a directory whose newest model is used (default: "
    "./data/predictor, where `tollgate predictor train` writes)",
)
@click.option(
    "--no-predictor", is_flag=True, help="reserve every request's whole output cap"
)
@log_format_option
@one_line_errors
def serve(
    host: str,
    port: int,
    database_url: str | None,
    simulated_replicas: int,
    replicas: tuple[str, ...],
    tokenizers: tuple[str, ...],
    models: tuple[str, ...],
    sim_speed: float,
    autoscale: bool,
    cold_start_s: float,
    scale_down_after_s: float,
    sim_gpu_blocks: int,
    sim_max_seqs: int,
    flex_ceiling: float,
    batch_windows: tuple[str, ...],
    batch_concurrency: int,
    no_demo: bool,
    trusted_proxies: str | None,
    metrics_token: str | None,
    auth_failures_per_minute: int,
    slow_reader_s: float,
    stream_buffer_chunks: int,
    client_send_buffer_bytes: int,
    keep_alive_s: int,
    lease_renew_s: float,
    no_fold_worker: bool,
    predictor_path: str | None,
    no_predictor: bool,
    log_format: str,
) -> None:
    """Run Tollgate embedded: migrate, seed the demo, start the fleet, serve the API."""
    from api.serve import run
    from domain.batch import window_seconds

    settings = ServeSettings(
        host=host,
        port=port,
        database_url=database_url or default_database_url(),
        simulated_replicas=simulated_replicas,
        replicas=replicas,
        tokenizers=tokenizers,
        models=models or DEFAULT_MODELS,
        sim_speed=sim_speed,
        seed_demo=not no_demo,
        metrics_token=metrics_token or None,
        trusted_proxies=tuple(p.strip() for p in (trusted_proxies or "").split(",") if p.strip()),
        auth_failures_per_minute=auth_failures_per_minute,
        slow_reader_s=slow_reader_s,
        stream_buffer_chunks=stream_buffer_chunks,
        client_send_buffer_bytes=client_send_buffer_bytes,
        keep_alive_s=keep_alive_s,
        lease_renew_s=lease_renew_s,
        fold_worker=not no_fold_worker,
        autoscale=autoscale,
        cold_start_s=cold_start_s,
        scale_down_after_s=scale_down_after_s,
        sim_gpu_blocks=sim_gpu_blocks,
        sim_max_num_seqs=sim_max_seqs,
        flex_ceiling_ppm=round(flex_ceiling * 1_000_000),
        predictor_path=predictor_path,
        predictor_enabled=not no_predictor,
        batch_windows=batch_windows,
        batch_concurrency=batch_concurrency,
        log_format=log_format,
    )
    for window in batch_windows:
        if window_seconds(window, (window,)) is None:
            raise click.BadParameter(
                f"{window!r}: a window is 1-99999 followed by s, m or h",
                param_hint="--batch-window",
            )
    run(settings)


kafka_options = [
    click.option(
        "--kafka-bootstrap",
        envvar="TOLLGATE_KAFKA_BOOTSTRAP",
        default=None,
        help="host:port[,host:port]: the Kafka cluster of the distributed mode (env "
        "TOLLGATE_KAFKA_BOOTSTRAP; other librdkafka settings as TOLLGATE_KAFKA_<SETTING>)",
    ),
    click.option(
        "--topic",
        envvar="TOLLGATE_KAFKA_TOPIC",
        default="tollgate.events",
        show_default=True,
        help="the event topic (env TOLLGATE_KAFKA_TOPIC)",
    ),
]


def with_kafka(fn: F) -> F:
    for option in reversed(kafka_options):
        fn = option(fn)
    return fn


@main.command(
    "api",
    params=[p for p in serve.params if p.name != "no_fold_worker"],
    context_settings={"ignore_unknown_options": False},
)
@click.pass_context
def api_command(ctx: click.Context, **options: Any) -> None:
    """Run an edge of the distributed mode: the API over PostgreSQL, no embedded fold worker.

    Same options as `tollgate serve` (`--replica MODEL=URL`, `--simulated-replicas N`, ...).
    Run several against one database, with `tollgate relay` and `tollgate worker` (Kafka) doing
    the folds."""
    url = options.get("database_url") or default_database_url()
    if not url.startswith("postgresql"):
        raise click.UsageError("tollgate api is an edge of the distributed mode: give it the "
                               "PostgreSQL store (--database-url or TOLLGATE_DATABASE_URL)")
    ctx.invoke(serve, no_fold_worker=True, **options)


def _start_process(
    database_url: str | None, log_format: str, postgres_only: str | None = None
) -> str:
    """What every long-running process of the pipeline does first: log to stderr in
    `log_format`, check the store (`postgres_only`: the error to give when it is not
    PostgreSQL), migrate it. Returns the store's URL."""
    from ledger.schema import upgrade

    url = database_url or default_database_url()
    if postgres_only and not url.startswith("postgresql"):
        raise click.UsageError(postgres_only)
    setup_logging(log_format)
    upgrade(url)
    return url


metrics_port_option = click.option(
    "--metrics-port",
    envvar="TOLLGATE_METRICS_PORT",
    default=0,
    show_default=True,
    type=click.IntRange(min=0, max=65535),
    help="serve Prometheus /metrics on this port (0: off; host TOLLGATE_METRICS_HOST, default "
    "127.0.0.1)",
)


@main.command()
@database_option
@click.option(
    "--lease-ttl",
    default=float(LEASE_TTL_S),
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="seconds without a renewal after which a request's lease expires",
)
@click.option("--parent-pid", default=0, type=int, hidden=True)
@with_kafka
@click.option(
    "--kafka-client",
    envvar="TOLLGATE_WORKER_KAFKA_CLIENT",
    type=click.Choice(["confluent", "faust"]),
    default="confluent",
    show_default=True,
    help="the library that reads the topic (env TOLLGATE_WORKER_KAFKA_CLIENT): confluent-kafka "
    "or faust-streaming; the same folds and the same exactly-once transaction either way "
    "(streams/README.md)",
)
@metrics_port_option
@log_format_option
@one_line_errors
def worker(
    database_url: str | None,
    lease_ttl: float,
    parent_pid: int,
    kafka_bootstrap: str | None,
    topic: str,
    kafka_client: str,
    metrics_port: int,
    log_format: str,
) -> None:
    """Run the folds: billing, the read models and the lease sweeper (until SIGTERM).

    Without a Kafka cluster they tail the SQL log (`tollgate serve` starts one itself; run this
    when serving with --no-fold-worker). With --kafka-bootstrap (TOLLGATE_KAFKA_BOOTSTRAP) they
    read the event topic the relay fills, as one member of a consumer group: run several."""
    from streams.worker import run_worker

    if parent_pid:  # `tollgate serve`'s child: killed by the kernel when serve dies
        from streams.supervisor import die_with_parent

        die_with_parent(parent_pid)
    url = _start_process(database_url, log_format)
    if parent_pid:
        # `tollgate serve`'s child shares the machine with the edge it serves: billing, the read
        # models and the batch runner can lag a little, a client's first token should not.
        os.nice(EMBEDDED_WORKER_NICENESS)
    # The embedded fold worker (`tollgate serve`'s child, --parent-pid) always tails the SQL
    # log, whatever the environment says.
    if kafka_bootstrap and not parent_pid:
        from streams.kafka_worker import run_kafka_worker

        if not url.startswith("postgresql"):
            raise click.UsageError("the Kafka worker needs the PostgreSQL store (--database-url)")
        from streams.topics import KafkaSettingError

        try:
            run_kafka_worker(
                url, kafka_bootstrap, topic, lease_ttl_s=lease_ttl, metrics_port=metrics_port,
                client=kafka_client,
            )
        except KafkaSettingError as exc:
            raise click.UsageError(str(exc)) from exc
        return
    run_worker(url, lease_ttl_s=lease_ttl, parent_pid=parent_pid, metrics_port=metrics_port)


@main.command()
@database_option
@with_kafka
@click.option(
    "--partitions",
    envvar="TOLLGATE_KAFKA_PARTITIONS",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="partitions of the event topic when the relay creates it",
)
@metrics_port_option
@log_format_option
@one_line_errors
def relay(
    database_url: str | None, kafka_bootstrap: str | None, topic: str, partitions: int,
    metrics_port: int, log_format: str,
) -> None:
    """Publish every committed event of the PostgreSQL store to the event topic (until SIGTERM).

    At least once, keyed by tenant id; resumes from its own place; re-publishes from the store
    when the broker lost the topic."""
    from streams.relay import TopicMismatch, run_relay

    if not kafka_bootstrap:
        raise click.UsageError("--kafka-bootstrap (or TOLLGATE_KAFKA_BOOTSTRAP) is required")
    url = _start_process(
        database_url, log_format, "the relay needs the PostgreSQL event store (--database-url)"
    )
    try:
        run_relay(url, kafka_bootstrap, topic, partitions, metrics_port=metrics_port)
    except TopicMismatch as exc:
        raise click.UsageError(str(exc)) from exc


@main.command("status")
@database_option
@with_kafka
@click.option("--json", "as_json", is_flag=True, help="machine output (one JSON object)")
@click.option(
    "--stale-after",
    envvar="TOLLGATE_PIPELINE_STALE_S",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="seconds a lagging part may go without moving before it is stale",
)
@click.option(
    "--unbilled-alarm-after",
    envvar="TOLLGATE_UNBILLED_ALARM_S",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="seconds a terminal event may go without its ledger row before it alarms",
)
@one_line_errors
def status(
    database_url: str | None, kafka_bootstrap: str | None, topic: str, as_json: bool,
    stale_after: float, unbilled_alarm_after: float,
) -> None:
    """Print the pipeline's lags: the relay, each consumer group per partition (with
    --kafka-bootstrap; else the embedded SQL-tail worker), and every worker process (each
    member of a consumer group, the batch runner): pid, host, heartbeat, partitions, last
    batch, lag.

    Exits 2 when something is stale or an alarm fires (1 on an error): a worker whose heartbeat
    is older than --stale-after (dead or hung; listed for an hour, a clean stop removes its row
    at once), a terminal event without its ledger row past --unbilled-alarm-after, an admitted
    request past its lease that nothing ended, a reconciliation that stopped."""
    import orjson

    from streams.status import cluster_status, render_table

    url = database_url or default_database_url()
    found = cluster_status(url, kafka_bootstrap, stale_after, unbilled_alarm_after)
    if as_json:
        click.echo(orjson.dumps(found.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_table(found))
    if found.problems:
        raise SystemExit(2)


# --- dead letters --------------------------------------------------------------------------------


@main.group("dead-letters")
def dead_letters_group() -> None:
    """Events a fold could not apply and moved past (DESIGN.md invariant 12)."""


@dead_letters_group.command("list")
@database_option
@click.option("--fold", default=None, help="only this fold's (billing, request_log, ...)")
@click.option("--all", "include_replayed", is_flag=True, help="the replayed ones too")
@click.option("--json", "as_json", is_flag=True, help="machine output (one JSON array)")
@one_line_errors
def dead_letters_list(
    database_url: str | None, fold: str | None, include_replayed: bool, as_json: bool
) -> None:
    """The unreplayed dead letters, oldest first: fold, where the event is (store position;
    topic, partition and offset when a Kafka worker met it), the event and why it failed."""
    import orjson

    from ledger import dead_letters
    from ledger.engine import create_engine_from_url

    engine = create_engine_from_url(database_url or default_database_url())
    try:
        with engine.connect() as conn:
            rows = dead_letters.listing(conn, fold=fold, include_replayed=include_replayed)
    finally:
        engine.dispose()
    if as_json:
        click.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    if not rows:
        click.echo("no dead letters")
        return
    for row in rows:
        where = f"position {row['position']}"
        if row["topic"] is not None:
            where += f", {row['topic']}[{row['kafka_partition']}]@{row['kafka_offset']}"
        replayed = ""
        if row["replayed_at"] is not None:
            replayed = f", replayed {row['replayed_at']:%Y-%m-%d %H:%M:%S}"
        click.echo(
            f"{row['fold']}  {row['event_type']} {row['event_id']} ({where}; stream "
            f"{row['stream_id']}, tenant {row['tenant_id']}; failed {row['failures']}x since "
            f"{row['first_failed_at']:%Y-%m-%d %H:%M:%S}{replayed})\n    {row['reason']}"
        )


@dead_letters_group.command("replay")
@database_option
@click.option("--fold", default=None, help="only this fold's (billing, request_log, ...)")
@one_line_errors
def dead_letters_replay(database_url: str | None, fold: str | None) -> None:
    """Apply the dead letters again through their folds' own code (after the fix); each that
    applies is marked replayed, each that still fails stays with its new reason. Exits 2 when
    some still fail."""
    from ledger.engine import create_engine_from_url
    from streams.worker import replay_dead_letters

    engine = create_engine_from_url(database_url or default_database_url())
    try:
        outcome = replay_dead_letters(engine, fold=fold)
    finally:
        engine.dispose()
    click.echo(f"replayed {len(outcome.replayed)}, still failing {len(outcome.failed)}")
    for row in outcome.failed:
        click.echo(f"  {row['fold']}  {row['event_id']}: {row['reason']}")
    if outcome.failed:
        raise SystemExit(2)


@main.command("batch-runner")
@database_option
@click.option(
    "--edge-url",
    envvar="TOLLGATE_EDGE_URL",
    required=True,
    help="an edge (`tollgate api`) to send batch items to [env TOLLGATE_EDGE_URL]",
)
@click.option(
    "--concurrency",
    envvar="TOLLGATE_BATCH_CONCURRENCY",
    default=8,
    show_default=True,
    type=click.IntRange(min=1, max=1024),
    help="batch items in flight at most",
)
@log_format_option
@one_line_errors
def batch_runner(
    database_url: str | None, edge_url: str, concurrency: int, log_format: str
) -> None:
    """Run the batch runner of the distributed mode (until SIGTERM): it feeds the items of every
    open batch to an edge as flex requests and writes their results.

    The edges and the runner share TOLLGATE_BATCH_TOKEN (the runner's proof, never a flag, so
    it is not in a process listing). `tollgate serve` runs its own runner in the fold worker.
    The edges of the distributed mode refuse to create a batch (503 batch_runner_unavailable)
    while no runner has reported for TOLLGATE_PIPELINE_STALE_S."""
    from streams.batch_runner import run_batch_runner

    token = os.environ.get("TOLLGATE_BATCH_TOKEN", "")
    if len(token) < 16:
        raise click.UsageError("set TOLLGATE_BATCH_TOKEN (16+ characters) here and on the edges")
    url = _start_process(
        database_url, log_format,
        "the batch runner of the distributed mode needs the PostgreSQL store "
        "(--database-url or TOLLGATE_DATABASE_URL)",
    )  # fmt: skip
    run_batch_runner(url, edge_url=edge_url.rstrip("/"), token=token, concurrency=concurrency)


@main.command("dev-cluster")
@click.option(
    "--database-url", envvar="TOLLGATE_DATABASE_URL",
    default="postgresql+psycopg://postgres@127.0.0.1:5432/test", show_default=True,
    help="the PostgreSQL store (env TOLLGATE_DATABASE_URL)",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int,
              help="one address in front of both edges, which listen on the next two ports")
@click.option("--kafka-port", default=9092, show_default=True, type=int,
              help="the development broker's port (0: a free one)")
@click.option("--simulated-replicas", default=1, show_default=True, type=click.IntRange(min=1),
              help="simulated vLLM replicas per model, shared by both edges")
@click.option("--model", "models", multiple=True,
              help=f"model versions to simulate (default: {', '.join(DEFAULT_MODELS)})")
@click.option("--sim-speed", default=1.0, show_default=True, type=float)
@click.option("--log-dir", default=None, help="the children's logs (default: ./data/logs)")
@one_line_errors
def dev_cluster(models: tuple[str, ...], log_dir: str | None, **options: Any) -> None:
    """Run the distributed mode on this machine: the development Kafka broker, two edges, the
    relay, two Kafka workers, the batch runner and a simulated fleet, supervised together (until
    Ctrl-C/SIGTERM).

    Checks PostgreSQL and migrates it first; prints where each part listens and the demo keys."""
    from pathlib import Path

    from api.dev_cluster import DevClusterSettings, run

    sys.exit(run(DevClusterSettings(
        models=models or DEFAULT_MODELS, log_dir=Path(log_dir) if log_dir else None, **options
    )))  # fmt: skip


@main.command("replica-sim")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=DEFAULT_MODELS[0], show_default=True)
@click.option("--seed", default=0, type=int)
@click.option("--speed", default=1.0, type=float)
@log_format_option
@one_line_errors
def replica_sim(host: str, port: int, model: str, seed: int, speed: float, log_format: str) -> None:
    """Run one simulated vLLM replica (vLLM 0.33 protocol and metrics) in this process."""
    from engine_adapter.simulator.cli import serve_forever

    setup_logging(log_format)
    serve_forever(host=host, port=port, model=model, seed=seed, speed=speed)


class LazyCommand(click.Command):
    """A subcommand whose module is imported only when it runs or prints its own help.

    `tollgate --help` lists it from `help` alone, so no other command imports what it needs
    (the load generator's httpx and rich views are not part of serving)."""

    def __init__(self, name: str, load: Callable[[], click.Command], help: str) -> None:
        super().__init__(name, help=help)
        self.load = load

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # The group runs `ctx.command`, so handing over the real command's context is enough.
        return self.load().make_context(info_name, args, parent=parent, **extra)


def _loadgen() -> click.Command:
    from loadgen.cli import loadgen

    return loadgen


main.add_command(
    LazyCommand(
        "loadgen",
        _loadgen,
        # The first paragraph of the command's own docstring (a test keeps the two the same).
        help="Send realistic, bounded traffic (a profile) and report what clients saw, per tenant "
        "and tier, reconciled against the finance ledger.",
    )
)



def _predictor() -> click.Command:
    from api.predictor_cli import predictor

    return predictor


main.add_command(
    LazyCommand(
        "predictor",
        _predictor,
        help="Learned output-length reservations: train, inspect, evaluate, and generate traffic.",
    )
)

if __name__ == "__main__":
    main()

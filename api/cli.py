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

F = TypeVar("F", bound=Callable[..., Any])

database_option = click.option(
    "--database-url",
    envvar="TOLLGATE_DATABASE_URL",
    default=None,
    help="sqlite:///path.db or postgresql+psycopg://user@host/db "
    "(env TOLLGATE_DATABASE_URL; default: a SQLite file under ./data).",
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
@database_option
@one_line_errors
def keys_issue(tenant: str, scope: str, database_url: str | None) -> None:
    """Print a new key: its id, then the secret alone on the last line (shown once)."""
    with control.ControlService.open(database_url) as service:
        key_id, secret = service.issue_key(tenant, scope)
    click.echo(f"issued {scope} key {key_id} for tenant {tenant}; store it now, it is not kept:")
    click.echo(secret)


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


@limits.command("set")
@click.option("--tenant", required=True)
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
    model: str,
    rpm: int | None,
    tpm: int | None,
    max_context: int | None,
    max_output: int | None,
    kv_seconds: int | None,
    reserved_kv_seconds: int | None,
    database_url: str | None,
) -> None:
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


def _micros(text: str) -> int:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise click.BadParameter(f"{text!r} is not a decimal amount") from None
    if value < 0:
        raise click.BadParameter("prices cannot be negative")
    micros = value * 1_000_000
    if micros != micros.to_integral_value():
        raise click.BadParameter(f"{text} has more precision than a micro-unit")
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
        at = service.set_price(model, _micros(prompt_), _micros(completion), _micros(cached), at)
    click.echo(f"price for {model} effective {at.isoformat()}")


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
    type=click.Choice(["hour", "day", "model", "key"]),
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
    from api.backoffice import USAGE_COLUMNS, parse_range

    with control.open_backoffice(database_url) as bo:
        if tenant is not None:
            bo.billing_tenant("finance", "", tenant)
        lo, hi = parse_range(start, end, datetime.now(UTC))
        rows = bo.usage(tenant, lo, hi, model, group_by)
    columns = USAGE_COLUMNS + (("key_id",) if group_by == "key" else ())
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
@click.option("--period", default=None, help="YYYY-MM (default: this month)")
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
    help="a real vLLM replica: MODEL=URL or URL (its served model is asked)",
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
@click.option("--no-demo", is_flag=True, help="do not seed the demo tenants and keys")
@click.option(
    "--no-fold-worker",
    is_flag=True,
    help="do not start the fold worker (billing, read models, leases) as a child process; "
    "run `tollgate worker` against the same database instead",
)
@one_line_errors
def serve(
    host: str,
    port: int,
    database_url: str | None,
    simulated_replicas: int,
    replicas: tuple[str, ...],
    models: tuple[str, ...],
    sim_speed: float,
    no_demo: bool,
    no_fold_worker: bool,
) -> None:
    """Run Tollgate embedded: migrate, seed the demo, start the fleet, serve the API."""
    from api.serve import run

    settings = ServeSettings(
        host=host,
        port=port,
        database_url=database_url or default_database_url(),
        simulated_replicas=simulated_replicas,
        replicas=replicas,
        models=models or DEFAULT_MODELS,
        sim_speed=sim_speed,
        seed_demo=not no_demo,
        fold_worker=not no_fold_worker,
    )
    run(settings)


@main.command()
@database_option
@click.option(
    "--lease-ttl",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=1.0),
    help="seconds without a renewal after which a request's lease expires",
)
@click.option("--parent-pid", default=0, type=int, hidden=True)
@one_line_errors
def worker(database_url: str | None, lease_ttl: float, parent_pid: int) -> None:
    """Run the folds: billing, the read models and the lease sweeper (until SIGTERM).

    `tollgate serve` starts one itself; run this when serving with --no-fold-worker."""
    import logging

    from ledger.schema import upgrade
    from streams.worker import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    url = database_url or default_database_url()
    upgrade(url)
    run_worker(url, lease_ttl_s=lease_ttl, parent_pid=parent_pid)


@main.command("replica-sim")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=DEFAULT_MODELS[0], show_default=True)
@click.option("--seed", default=0, type=int)
@click.option("--speed", default=1.0, type=float)
@one_line_errors
def replica_sim(host: str, port: int, model: str, seed: int, speed: float) -> None:
    """Run one simulated vLLM replica (vLLM 0.33 protocol and metrics) in this process."""
    from engine_adapter.simulated import serve_forever

    serve_forever(host=host, port=port, model=model, seed=seed, speed=speed)


def _register_loadgen() -> None:
    from api.loadgen.cli import loadgen

    main.add_command(loadgen)


_register_loadgen()

if __name__ == "__main__":
    main()

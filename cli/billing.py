"""What calls cost and what was billed: `tollgate prices` and `tollgate ledger`."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
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


@click.group()
def prices() -> None:
    """Effective-dated prices per model version (currency units per million tokens)."""


@prices.command("set")
@click.option("--model", required=True)
@click.option("--prompt", "prompt_", required=True, help="price per 1M prompt tokens, e.g. 0.50")
@click.option("--completion", required=True, help="price per 1M completion tokens")
@click.option("--cached", required=True, help="price per 1M cached prompt tokens")
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@settings_options("database_url", "currency", "actor")
@one_line_errors
def prices_set(
    model: str,
    prompt_: str,
    completion: str,
    cached: str,
    effective_at: str | None,
    settings: Settings,
) -> None:
    at = instant(effective_at) if effective_at else None
    actor = control.operator(settings.actor, required=settings.require_actor)
    with control.ControlService.open(settings.store_url(), actor) as service:
        at = service.set_price(
            model, micros(prompt_, "--prompt"), micros(completion, "--completion"),
            micros(cached, "--cached"), at, currency=settings.currency,
        )  # fmt: skip
    click.echo(f"price for {model} in {settings.currency} effective {at.isoformat()}")


@prices.command("flex-discount")
@click.option("--model", required=True)
@click.option(
    "--percent", required=True, type=click.FloatRange(0, 100),
    help="the flex class's discount on the model's price, e.g. 50",
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@control_options
@one_line_errors
def prices_flex_discount(
    model: str, percent: float, effective_at: str | None, database_url: str, actor: Actor
) -> None:
    """The flex class's (and the Batch API's) discount on a model's price, effective-dated."""
    at = instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url, actor) as service:
        at = service.set_flex_discount(model, round(percent * 10_000), at)
    click.echo(f"flex discount for {model}: {percent:g} % effective {at.isoformat()}")


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
    from tollgate_llm.api.services.backoffice import to_csv

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


@click.group()
def ledger() -> None:
    """The billing ledger: usage, entries, invoices, reconciliation."""


@ledger.command("usage")
@click.option("--tenant", default=None)
@click.option("--model", default=None)
@click.option(
    "--group-by",
    type=click.Choice(
        ["hour", "day", "model", "key", "workspace", "project", "run", "region", "adapter"]
    ),
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
    database_url: str,
) -> None:
    from tollgate_llm.api.services.backoffice import GROUP_COLUMNS, USAGE_COLUMNS, parse_range

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
    database_url: str,
) -> None:
    from tollgate_llm.api.services.backoffice import ENTRY_COLUMNS, parse_range

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
def ledger_invoice(tenant: str, period: str | None, fmt: str, database_url: str) -> None:
    from tollgate_llm.api.services.backoffice import INVOICE_COLUMNS

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
        f"invoice {tenant} {invoice['period']}: total "
        + ", ".join(f"{t['amount']} {t['currency']}" for t in invoice["totals"]),
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
    database_url: str,
) -> None:
    """Requests that ended in the range, by outcome against their tier's objective (attained,
    missed_ttft, missed_tpot, cancelled, failed, ..., refused_quota, invalid), with attainment
    (attained / served) and goodput (attained / offered) in parts per million."""
    from tollgate_llm.api.services.backoffice import groups, parse_range
    from tollgate_llm.ledger.finance import GOODPUT_COLUMNS, GOODPUT_GROUPS

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
def ledger_reconcile(start: str | None, end: str | None, database_url: str) -> None:
    """Admitted vs terminal vs ledger entries, reserved vs refunded vs billed; exit 1 on any
    mismatch."""
    import orjson

    from tollgate_llm.api.services.backoffice import parse_range

    with control.open_backoffice(database_url) as bo:
        lo, hi = parse_range(start, end, datetime.now(UTC))
        report = bo.reconciliation(lo, hi)
    click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    if not report["ok"]:
        sys.exit(1)


COMMANDS = (prices, ledger)

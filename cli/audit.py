"""`tollgate audit`: who changed the control plane, what and when (old -> new), and `audit
verify`, the check of every control stream's hash chain."""

from __future__ import annotations

from datetime import UTC, datetime

import click
import orjson

from tollgate_llm.api.services.audit_service import AUDIT_LIMIT_DEFAULT, AUDIT_LIMIT_MAX, AuditTrail
from tollgate_llm.cli.common import database_option, instant, one_line_errors
from tollgate_llm.cli.support import since_instant
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade


def _trail(database_url: str) -> AuditTrail:
    upgrade(database_url)
    return AuditTrail(create_engine_from_url(database_url))


@click.group(invoke_without_command=True)
@click.option("--tenant", default=None, help="only the changes to this tenant")
@click.option(
    "--since", default=None,
    help="recorded at or after: an ISO 8601 instant, or 90m / 6h / 2d ago",
)  # fmt: skip
@click.option(
    "--actor", "by", default=None, help="only the changes by this actor (a key id, a name)"
)
@click.option("--limit", default=AUDIT_LIMIT_DEFAULT, show_default=True,
              type=click.IntRange(1, AUDIT_LIMIT_MAX))  # fmt: skip
@click.option("--after", default=None, type=int, help="the last id of the previous page")
@click.option("--format", "fmt", type=click.Choice(("table", "json")), default="table",
              show_default=True)  # fmt: skip
@database_option
@one_line_errors
@click.pass_context
def audit(
    ctx: click.Context, tenant: str | None, since: str | None, by: str | None, limit: int,
    after: int | None, fmt: str, database_url: str,
) -> None:  # fmt: skip
    """Control-plane changes, newest first: when, by whom, the command, and each value it
    changed (old -> new). `tollgate audit verify` checks the trail's hash chains."""
    if ctx.invoked_subcommand is not None:
        return
    start = since_instant(since, datetime.now(UTC))
    trail = _trail(database_url)
    try:
        page = trail.entries(
            tenant=tenant, since=instant(start) if start else None, actor=by, after=after,
            limit=limit,
        )  # fmt: skip
    finally:
        trail.engine.dispose()
    if fmt == "json":
        click.echo(orjson.dumps(page, option=orjson.OPT_INDENT_2).decode())
        return
    for entry in page["data"]:
        click.echo(
            f"{entry['at']}  {entry['actor_kind']}:{entry['actor']}  {entry['command']}  "
            f"{entry['stream']}"
        )
        for change in entry["changes"]:
            old = "-" if change["old"] is None else change["old"]
            new = "-" if change["new"] is None else change["new"]
            click.echo(f"    {change['subject']}: {change['field']} {old} -> {new}")
    if page["has_more"]:
        click.echo(f"more: --after {page['last_id']}")


@audit.command("verify")
@click.option("--json", "as_json", is_flag=True, help="the whole report, heads included")
@database_option
@one_line_errors
def audit_verify(as_json: bool, database_url: str) -> None:
    """Check the hash chain of every control stream: exit 1 naming each edited or deleted
    event; else print each stream's head (keep it: a copy pins the history up to it)."""
    trail = _trail(database_url)
    try:
        report = trail.verify()
    finally:
        trail.engine.dispose()
    if as_json:
        click.echo(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
    else:
        for head in report["heads"]:
            click.echo(f"{head['stream']}\tsealed through {head['sealed_through']}\t{head['seal']}")
        click.echo(f"{report['streams']} streams, {report['events']} events checked")
    for problem in report["problems"]:
        click.echo(f"tollgate: audit: {problem['stream']}: {problem['problem']}", err=True)
    if not report["ok"]:
        raise SystemExit(1)


COMMANDS = (audit,)

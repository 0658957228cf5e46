"""`tollgate replay`: one request's story, re-folded from its events; `tollgate requests list`:
a tenant's recent requests, to find the one to replay."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

import click

from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import (
    database_option,
    instant,
    one_line_errors,
)
from tollgate_llm.domain.projections import REQUEST_LOG_STATUSES

# `--since 90m`, `--since 6h`, `--since 2d`: that long before now.
AGO = re.compile(r"^([0-9]+)([mhd])$")
AGO_UNITS = {"m": "minutes", "h": "hours", "d": "days"}


@click.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="the full timeline as JSON")
@database_option
@one_line_errors
def replay(request_id: str, as_json: bool, database_url: str) -> None:
    """Re-fold a request's events: every step, the state after it, quota and billing effects,
    the limits in force at admission, and anomalies."""
    import orjson

    from tollgate_llm.api.services.backoffice import timeline_json

    with control.open_backoffice(database_url) as bo:
        timeline = timeline_json(bo.timeline(request_id, "support", "", datetime.now(UTC)))
    if as_json:
        click.echo(orjson.dumps(timeline, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(
        f"{timeline['request_id']}  {timeline['status']}  tenant={timeline['tenant']} "
        f"model={timeline['model']} tier={timeline['tier']}"
    )
    if timeline.get("trace_id"):
        click.echo(f"trace {timeline['trace_id']}")
    click.echo(
        f"plan at admission: {timeline['plan_at_admission']}  limits: "
        f"{timeline['limits_at_admission']}"
    )
    if timeline.get("project") or timeline.get("run"):
        click.echo(
            f"workspace {timeline['workspace']}  project {timeline['project']}  run "
            f"{timeline['run']}  budget reserved {timeline['budget_reserved_micros']} micro-units "
            f"{timeline['budget_reserved_currency']}"
        )
    if timeline.get("routing"):
        r = timeline["routing"]
        click.echo(
            f"routed: asked {r['asked_model']}, served {r['served_model']} ({r['reason']}; "
            f"bound {r['estimate_ppm']} ppm, bar {r['bar_ppm']} ppm, class {r['task_class']})"
        )
    if timeline.get("feedback"):
        click.echo(f"feedback: {timeline['feedback']}")
    rejection = timeline.get("rejection")
    if rejection:
        click.echo(f"refused: {rejection}")
    click.echo(
        f"replica {timeline['replica_id']} (occupancy at routing "
        f"{timeline['replica_occupancy_at_routing']}), ttft {timeline['ttft_ms']} ms, "
        f"tpot {timeline['tpot_us']} us, lease renewals {timeline['lease_renewals']}"
    )
    click.echo(
        f"region {timeline.get('region') or '-'}  retention {timeline.get('retention')}  "
        f"end user {timeline.get('end_user') or '-'}"
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


@click.group("requests")
def requests_group() -> None:
    """A tenant's requests, from the request log (no prompt or completion content)."""


@requests_group.command("list")
@click.option("--tenant", required=True)
@click.option("--status", type=click.Choice(REQUEST_LOG_STATUSES), default=None)
@click.option("--key", "key_id", default=None, help="only this key id's requests")
@click.option("--model", default=None, help="a model name or version")
@click.option(
    "--since", default=None,
    help="admitted at or after: an ISO 8601 instant, or 90m / 6h / 2d ago (default: 30 days)",
)  # fmt: skip
@click.option("--limit", default=50, show_default=True, type=click.IntRange(1, 500))
@click.option("--after", default=None, help="the last request id of the previous page")
@click.option("--format", "fmt", type=click.Choice(("table", "json")), default="table",
              show_default=True)  # fmt: skip
@database_option
@one_line_errors
def requests_list(
    tenant: str, status: str | None, key_id: str | None, model: str | None, since: str | None,
    limit: int, after: str | None, fmt: str, database_url: str,
) -> None:  # fmt: skip
    """A tenant's requests, newest first, with the same filters and bounds as GET /v1/requests
    (a range of at most 366 days)."""
    from tollgate_llm.api.services.backoffice import parse_range

    now = datetime.now(UTC)
    start = since_instant(since, now)
    with control.open_backoffice(database_url) as bo:
        bo.requests_tenant("support", "", tenant)
        lo, hi = parse_range(start, None, now)
        page = bo.requests(tenant, lo, hi, status=status, key_id=key_id, model=model,
                           limit=limit, after=after)  # fmt: skip
    if fmt == "json":
        import orjson

        click.echo(orjson.dumps(page, option=orjson.OPT_INDENT_2).decode())
        return
    click.echo(
        f"{'request_id':<36}  {'status':<13} {'admitted_at':<27} {'model':<24} {'tier':<10} "
        f"{'key_id':<18} {'tokens':>13}  {'replica':<12} reject_reason"
    )
    for row in page["data"]:
        tokens = row["tokens"]
        used = (
            "-" if tokens["prompt_tokens"] is None
            else f"{tokens['prompt_tokens']}+{tokens['completion_tokens']}"
        )  # fmt: skip
        click.echo(
            f"{row['request_id']:<36}  {row['status']:<13} {row['admitted_at']:<27} "
            f"{row['model']:<24} {row['tier']:<10} {row['key_id']:<18} {used:>13}  "
            f"{row['replica'] or '-':<12} {row['reject_reason'] or ''}"
        )
    if page["has_more"]:
        click.echo(f"more: --after {page['last_id']}")


def since_instant(text: str | None, now: datetime) -> str | None:
    """An ISO instant as it is given, or `90m`/`6h`/`2d` as the instant that long ago."""
    if text is None:
        return None
    ago = AGO.fullmatch(text)
    if ago is None:
        return instant(text).isoformat()
    amount, unit = ago.groups()
    return (now - timedelta(**{AGO_UNITS[unit]: int(amount)})).isoformat()


COMMANDS = (replay, requests_group)

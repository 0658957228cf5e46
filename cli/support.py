"""`tollgate replay`: one request's story, re-folded from its events."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from api.services import control_service as control
from cli.common import (
    database_option,
    one_line_errors,
)


@click.command()
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True, help="the full timeline as JSON")
@database_option
@one_line_errors
def replay(request_id: str, as_json: bool, database_url: str) -> None:
    """Re-fold a request's events: every step, the state after it, quota and billing effects,
    the limits in force at admission, and anomalies."""
    import orjson

    from api.services.backoffice import timeline_json

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


COMMANDS = (replay,)

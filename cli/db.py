"""`tollgate db`, `projections` and `dead-letters`: the store's own upkeep."""

from __future__ import annotations

import click

from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import (
    database_option,
    one_line_errors,
)

# --- database ------------------------------------------------------------------------------------


@click.group()
def db() -> None:
    """Database schema (Alembic migrations)."""


@db.command("upgrade")
@database_option
@one_line_errors
def db_upgrade(database_url: str) -> None:
    """Create or migrate every table to the latest revision."""
    url = database_url
    revision = control.upgrade(url)
    click.echo(f"database at revision {revision}")


# --- projections -----------------------------------------------------------------------------


@click.group()
def projections() -> None:
    """Read models folded from the event log."""


@projections.command("rebuild")
@click.argument("name", required=False)
@database_option
@one_line_errors
def projections_rebuild(name: str | None, database_url: str) -> None:
    """Drop and refold a projection (all of them without NAME); prints each table's digest."""
    for projection, digest, rows in control.rebuild_projections(database_url, name):
        click.echo(f"{projection}\t{rows} rows\tsha256 {digest}")


# --- dead letters --------------------------------------------------------------------------------


@click.group("dead-letters")
def dead_letters_group() -> None:
    """Events a fold could not apply and moved past (DESIGN.md invariant 12)."""


@dead_letters_group.command("list")
@database_option
@click.option("--fold", default=None, help="only this fold's (billing, request_log, ...)")
@click.option("--all", "include_replayed", is_flag=True, help="the replayed ones too")
@click.option("--json", "as_json", is_flag=True, help="machine output (one JSON array)")
@one_line_errors
def dead_letters_list(
    database_url: str, fold: str | None, include_replayed: bool, as_json: bool
) -> None:
    """The unreplayed dead letters, oldest first: fold, where the event is (store position;
    topic, partition and offset when a Kafka worker met it), the event and why it failed."""
    import orjson

    from tollgate_llm.ledger import dead_letters
    from tollgate_llm.ledger.engine import create_engine_from_url

    engine = create_engine_from_url(database_url)
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
def dead_letters_replay(database_url: str, fold: str | None) -> None:
    """Apply the dead letters again through their folds' own code (after the fix); each that
    applies is marked replayed, each that still fails stays with its new reason. Exits 2 when
    some still fail."""
    from tollgate_llm.ledger.engine import create_engine_from_url
    from tollgate_llm.streams.dead_letter_replay import replay_dead_letters

    engine = create_engine_from_url(database_url)
    try:
        outcome = replay_dead_letters(engine, fold=fold)
    finally:
        engine.dispose()
    click.echo(f"replayed {len(outcome.replayed)}, still failing {len(outcome.failed)}")
    for row in outcome.failed:
        click.echo(f"  {row['fold']}  {row['event_id']}: {row['reason']}")
    if outcome.failed:
        raise SystemExit(2)


COMMANDS = (db, projections, dead_letters_group)

"""The distributed mode's other processes: `worker`, `relay`, `batch-runner`, and `status`."""

from __future__ import annotations

import os

import click

from api.config import default_database_url
from api.logs import setup_logging
from cli.common import (
    F,
    database_option,
    log_format_option,
    one_line_errors,
)
from domain.leases import LEASE_TTL_S

# The embedded fold worker runs at this lower CPU priority than the edge (nice(2) steps).
EMBEDDED_WORKER_NICENESS = 10

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


@click.command()
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


@click.command()
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


@click.command("status")
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


@click.command("batch-runner")
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


COMMANDS = (worker, relay, status, batch_runner)

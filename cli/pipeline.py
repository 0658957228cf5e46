"""The distributed mode's other processes: `worker`, `relay`, `batch-runner`, and `status`."""

from __future__ import annotations

import os

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.api.logs import setup_logging
from tollgate_llm.cli.common import one_line_errors
from tollgate_llm.cli.options import settings_options

# The embedded fold worker runs at this lower CPU priority than the edge (nice(2) steps).
EMBEDDED_WORKER_NICENESS = 10

KAFKA = ("kafka_bootstrap", "kafka_topic")


def _start_process(settings: Settings, postgres_only: str | None = None) -> str:
    """What every long-running process of the pipeline does first: log to stderr in the
    settings' format, check the store (`postgres_only`: the error to give when it is not
    PostgreSQL), migrate it. Returns the store's URL."""
    from tollgate_llm.ledger.schema import upgrade

    url = settings.store_url()
    if postgres_only and not url.startswith("postgresql"):
        raise click.UsageError(postgres_only)
    setup_logging(settings.log_format)
    upgrade(url)
    return url


@click.command()
@click.option("--parent-pid", default=0, type=int, hidden=True)
@settings_options("database_url", "lease_ttl_s", *KAFKA, "worker_kafka_client", "metrics_port",
                  "log_format")  # fmt: skip
@one_line_errors
def worker(settings: Settings, parent_pid: int) -> None:
    """Run the folds: billing, the read models and the lease sweeper (until SIGTERM).

    Without a Kafka cluster they tail the SQL log (`tollgate serve` starts one itself; run this
    when serving with --no-fold-worker). With --kafka-bootstrap (TOLLGATE_KAFKA_BOOTSTRAP) they
    read the event topic the relay fills, as one member of a consumer group: run several."""
    from tollgate_llm.streams.worker import BatchRunnerSettings, run_worker

    if parent_pid:  # `tollgate serve`'s child: killed by the kernel when serve dies
        from tollgate_llm.streams.supervisor import die_with_parent

        die_with_parent(parent_pid)
    url = _start_process(settings)
    if parent_pid:
        # `tollgate serve`'s child shares the machine with the edge it serves: billing, the read
        # models and the batch runner can lag a little, a client's first token should not.
        os.nice(EMBEDDED_WORKER_NICENESS)
    # The embedded fold worker (`tollgate serve`'s child, --parent-pid) always tails the SQL
    # log, whatever the environment says.
    if settings.kafka_bootstrap and not parent_pid:
        from tollgate_llm.streams.kafka_worker import run_kafka_worker

        if not url.startswith("postgresql"):
            raise click.UsageError("the Kafka worker needs the PostgreSQL store (--database-url)")
        from tollgate_llm.streams.topics import KafkaSettingError

        try:
            run_kafka_worker(
                url, settings.kafka_bootstrap, settings.kafka_topic,
                lease_ttl_s=settings.lease_ttl_s, metrics_port=settings.metrics_port,
                metrics_host=settings.metrics_host, client=settings.worker_kafka_client,
                kafka_settings=settings.kafka_client_settings(),
            )  # fmt: skip
        except KafkaSettingError as exc:
            raise click.UsageError(str(exc)) from exc
        return
    # The batch runner beside the folds, when the edge said where it is and how to prove
    # itself (`tollgate serve` does, in its child's environment).
    batches = None
    if settings.edge_url and settings.batch_token:
        batches = BatchRunnerSettings(
            edge_url=settings.edge_url, token=settings.batch_token,
            concurrency=settings.batch_concurrency,
        )  # fmt: skip
    run_worker(
        url, lease_ttl_s=settings.lease_ttl_s, parent_pid=parent_pid,
        metrics_port=settings.metrics_port, metrics_host=settings.metrics_host, batches=batches,
    )  # fmt: skip


@click.command()
@settings_options("database_url", *KAFKA, "kafka_partitions", "metrics_port", "log_format")
@one_line_errors
def relay(settings: Settings) -> None:
    """Publish every committed event of the PostgreSQL store to the event topic (until SIGTERM).

    At least once, keyed by tenant id; resumes from its own place; re-publishes from the store
    when the broker lost the topic."""
    from tollgate_llm.streams.relay import TopicMismatch, run_relay

    if not settings.kafka_bootstrap:
        raise click.UsageError("--kafka-bootstrap (or TOLLGATE_KAFKA_BOOTSTRAP) is required")
    url = _start_process(
        settings, "the relay needs the PostgreSQL event store (--database-url)"
    )
    try:
        run_relay(
            url, settings.kafka_bootstrap, settings.kafka_topic, settings.kafka_partitions,
            metrics_port=settings.metrics_port, metrics_host=settings.metrics_host,
            kafka_settings=settings.kafka_client_settings(),
        )  # fmt: skip
    except TopicMismatch as exc:
        raise click.UsageError(str(exc)) from exc


@click.command("status")
@click.option("--json", "as_json", is_flag=True, help="machine output (one JSON object)")
@settings_options("database_url", *KAFKA, "pipeline_stale_s", "unbilled_alarm_s")
@one_line_errors
def status(settings: Settings, as_json: bool) -> None:
    """Print the pipeline's lags: the relay, each consumer group per partition (with
    --kafka-bootstrap; else the embedded SQL-tail worker), and every worker process (each
    member of a consumer group, the batch runner): pid, host, heartbeat, partitions, last
    batch, lag.

    Exits 2 when something is stale or an alarm fires (1 on an error): a worker whose heartbeat
    is older than --stale-after (dead or hung; listed for an hour, a clean stop removes its row
    at once), a terminal event without its ledger row past --unbilled-alarm-after, an admitted
    request past its lease that nothing ended, a reconciliation that stopped."""
    import orjson

    from tollgate_llm.streams.status import cluster_status, render_table

    found = cluster_status(
        settings.store_url(), settings.kafka_bootstrap, settings.pipeline_stale_s,
        settings.unbilled_alarm_s, kafka_settings=settings.kafka_client_settings(),
    )  # fmt: skip
    if as_json:
        click.echo(orjson.dumps(found.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(render_table(found))
    if found.problems:
        raise SystemExit(2)


@click.command("batch-runner")
@settings_options("database_url", "edge_url", "batch_concurrency", "log_format",
                  flags={"batch_concurrency": "--concurrency"})  # fmt: skip
@one_line_errors
def batch_runner(settings: Settings) -> None:
    """Run the batch runner of the distributed mode (until SIGTERM): it feeds the items of every
    open batch to an edge as flex requests and writes their results.

    The edges and the runner share TOLLGATE_BATCH_TOKEN (the runner's proof, never a flag, so
    it is not in a process listing). `tollgate serve` runs its own runner in the fold worker.
    The edges of the distributed mode refuse to create a batch (503 batch_runner_unavailable)
    while no runner has reported for TOLLGATE_PIPELINE_STALE_S."""
    from tollgate_llm.streams.batch_runner import run_batch_runner

    if not settings.edge_url:
        raise click.UsageError("--edge-url (or TOLLGATE_EDGE_URL) is required")
    if len(settings.batch_token) < 16:
        raise click.UsageError("set TOLLGATE_BATCH_TOKEN (16+ characters) here and on the edges")
    url = _start_process(
        settings,
        "the batch runner of the distributed mode needs the PostgreSQL store "
        "(--database-url or TOLLGATE_DATABASE_URL)",
    )
    run_batch_runner(
        url, edge_url=settings.edge_url.rstrip("/"), token=settings.batch_token,
        concurrency=settings.batch_concurrency,
    )  # fmt: skip


COMMANDS = (worker, relay, status, batch_runner)

"""Development tools, never imported by `tollgate serve` or `tollgate api`: `dev-cluster`
(the distributed mode on one machine) and `replica-sim` (one simulated vLLM replica)."""

from __future__ import annotations

import sys
from typing import Any

import click

from api.config import DEFAULT_MODELS
from api.logs import setup_logging
from cli.common import log_format_option, one_line_errors


@click.command("dev-cluster")
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

    from cli.dev.cluster import DevClusterSettings, run

    sys.exit(run(DevClusterSettings(
        models=models or DEFAULT_MODELS, log_dir=Path(log_dir) if log_dir else None, **options
    )))  # fmt: skip


@click.command("replica-sim")
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


COMMANDS = (dev_cluster, replica_sim)

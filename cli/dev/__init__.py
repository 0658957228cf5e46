"""Development tools, never imported by `tollgate serve` or `tollgate api`: `dev-cluster`
(the distributed mode on one machine) and `replica-sim` (one simulated vLLM replica)."""

from __future__ import annotations

import sys

import click

from tollgate_llm.api.config import DEFAULT_MODELS, Settings
from tollgate_llm.api.logs import setup_logging
from tollgate_llm.cli.common import one_line_errors
from tollgate_llm.cli.options import settings_options

# The test PostgreSQL of a development machine (written here: cli/dev/cluster.py imports httpx,
# which `tollgate serve --help` must not).
DEV_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@click.command("dev-cluster")
@click.option("--kafka-port", default=9092, show_default=True, type=int,
              help="the development broker's port (0: a free one)")
@click.option("--log-dir", default=None, help="the children's logs (default: <data dir>/logs)")
@click.option("--simulated-max-loras", default=2, show_default=True, type=click.IntRange(min=0),
              help="LoRA slots of each simulated replica (vLLM's --max-loras; 0: LoRA off)")
@settings_options(
    "database_url", "host", "port", "simulated_replicas", "models", "sim_speed", "kafka_topic",
    "log_format", "simulated_regions", "region",
    # A development cluster's own defaults: the test PostgreSQL, one replica per model.
    defaults={"database_url": DEV_DATABASE_URL, "simulated_replicas": 1},
)
@one_line_errors
def dev_cluster(
    settings: Settings, kafka_port: int, log_dir: str | None, simulated_max_loras: int
) -> None:
    """Run the distributed mode on this machine: the development Kafka broker, two edges, the
    relay, two Kafka workers, the batch runner and a simulated fleet, supervised together (until
    Ctrl-C/SIGTERM).

    Checks PostgreSQL and migrates it first; prints where each part listens and the demo keys.
    --port is one address in front of both edges, which listen on the next two ports. The
    simulated replicas serve tenants' LoRA adapters (`tollgate adapters register`) with
    --simulated-max-loras slots each."""
    from pathlib import Path

    from tollgate_llm.cli.dev.cluster import DevClusterSettings, run

    if settings.simulated_replicas < 1:
        raise click.BadParameter("a development cluster needs a replica per model",
                                 param_hint="--simulated-replicas")  # fmt: skip
    sys.exit(run(DevClusterSettings(
        database_url=settings.database_url, host=settings.host, port=settings.port,
        kafka_port=kafka_port, simulated_replicas=settings.simulated_replicas,
        models=settings.models, sim_speed=settings.sim_speed, topic=settings.kafka_topic,
        log_dir=Path(log_dir) if log_dir else None, data_dir=settings.data_path(),
        log_format=settings.log_format, simulated_regions=settings.simulated_regions,
        region=settings.region, simulated_max_loras=simulated_max_loras,
    )))  # fmt: skip


@click.command("replica-sim")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default=DEFAULT_MODELS[0], show_default=True)
@click.option("--seed", default=0, type=int)
@click.option("--speed", default=1.0, type=float)
@click.option("--enable-lora/--no-enable-lora", default=False, show_default=True,
              help="serve LoRA adapters: vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter")
@click.option("--max-loras", default=1, show_default=True, type=click.IntRange(min=1),
              help="LoRA slots (vLLM's --max-loras)")
@click.option("--max-lora-rank", default=16, show_default=True, type=click.IntRange(min=1),
              help="the highest adapter rank it loads (vLLM's --max-lora-rank)")
@settings_options("log_format")
@one_line_errors
def replica_sim(settings: Settings, host: str, port: int, model: str, seed: int,
                speed: float, enable_lora: bool, max_loras: int,
                max_lora_rank: int) -> None:  # fmt: skip
    """Run one simulated vLLM replica (vLLM 0.33 protocol and metrics) in this process.

    Its options are the replica's own, not settings of Tollgate: only the log format is."""
    from tollgate_llm.engine_adapter.simulator.cli import serve_forever

    setup_logging(settings.log_format)
    serve_forever(host=host, port=port, model=model, seed=seed, speed=speed,
                  enable_lora=enable_lora, max_loras=max_loras,
                  max_lora_rank=max_lora_rank)  # fmt: skip


COMMANDS = (dev_cluster, replica_sim)

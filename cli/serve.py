"""`tollgate serve` (embedded) and `tollgate api` (an edge of the distributed mode)."""

from __future__ import annotations

from typing import Any

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.cli.common import one_line_errors
from tollgate_llm.cli.options import settings_options

# The settings `tollgate serve` and `tollgate api` take on the command line, in --help's order
# (every other setting is still read from the environment and the file).
SERVE_OPTIONS = (
    "host", "port", "database_url", "simulated_replicas", "replicas", "tokenizers", "models",
    "sim_speed", "autoscale", "cold_start_s", "scale_down_after_s", "sim_gpu_blocks",
    "sim_max_num_seqs", "flex_ceiling", "batch_windows", "batch_concurrency", "seed_demo",
    "trusted_proxies", "metrics_token", "auth_failures_per_minute", "slow_reader_s",
    "stream_buffer_chunks", "lease_renew_s", "client_send_buffer_bytes", "keep_alive_s",
    "fold_worker", "predictor_path", "predictor_enabled", "log_format", "currency",
    "region", "simulated_regions",
)  # fmt: skip


def run_serve(settings: Settings) -> None:
    from tollgate_llm.api.serve import run

    settings.store_url()  # the default SQLite file's directory, before anything opens it
    actuator_factory = None
    if settings.autoscale:
        # A development tool (simulated replicas), imported only when asked for.
        from tollgate_llm.cli.dev.actuator import SimulatedActuator

        actuator_factory = SimulatedActuator
    run(settings, actuator_factory)


@click.command()
@settings_options(*SERVE_OPTIONS)
@one_line_errors
def serve(settings: Settings) -> None:
    """Run Tollgate embedded: migrate, seed the demo, start the fleet, serve the API."""
    run_serve(settings)


@click.command("api")
@settings_options(*(name for name in SERVE_OPTIONS if name != "fold_worker"))
@one_line_errors
def api_command(settings: Settings, **_: Any) -> None:
    """Run an edge of the distributed mode: the API over PostgreSQL, no embedded fold worker.

    Same options as `tollgate serve` (`--replica MODEL=URL`, `--simulated-replicas N`, ...).
    Run several against one database, with `tollgate relay` and `tollgate worker` (Kafka) doing
    the folds."""
    if not settings.database_url.startswith("postgresql"):
        raise click.UsageError("tollgate api is an edge of the distributed mode: give it the "
                               "PostgreSQL store (--database-url or TOLLGATE_DATABASE_URL)")
    settings.fold_worker = False
    run_serve(settings)


COMMANDS = (serve, api_command)

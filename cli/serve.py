"""`tollgate serve` (embedded) and `tollgate api` (an edge of the distributed mode)."""

from __future__ import annotations

from typing import Any

import click

from api.config import DEFAULT_MODELS, ServeSettings, default_database_url
from cli.common import (
    database_option,
    log_format_option,
    one_line_errors,
)

# --- serving -----------------------------------------------------------------------------------


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@database_option
@click.option(
    "--simulated-replicas",
    default=2,
    show_default=True,
    type=int,
    help="simulated vLLM replicas per model when no --replica is given",
)
@click.option(
    "--replica",
    "replicas",
    multiple=True,
    help="a real vLLM replica: MODEL=URL (MODEL: the version Tollgate serves; the engine's own "
    "name for it is read from its /v1/models)",
)
@click.option(
    "--tokenizer",
    "tokenizers",
    multiple=True,
    help="MODEL=DIR: the model's tokenizer.json and chat template, for the prompt estimate, when "
    "the replica's model directory is not readable here",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    help=f"model versions to simulate (default: {', '.join(DEFAULT_MODELS)})",
)
@click.option(
    "--sim-speed",
    default=1.0,
    show_default=True,
    type=float,
    help="speed multiplier of the simulated engines",
)
@click.option(
    "--autoscale",
    is_flag=True,
    help="add and remove simulated replicas by the autoscaling signal (tollgate_desired_replicas)",
)
@click.option(
    "--cold-start-s",
    default=ServeSettings.cold_start_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="how long a new replica takes before it serves: the signal's lead",
)
@click.option(
    "--scale-down-after-s",
    default=ServeSettings.scale_down_after_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="how long the signal must stay below the fleet before a replica is removed",
)
@click.option(
    "--sim-gpu-blocks",
    default=ServeSettings.sim_gpu_blocks,
    show_default=True,
    type=click.IntRange(min=16),
    help="KV blocks of 16 tokens per simulated replica",
)
@click.option(
    "--sim-max-seqs",
    default=ServeSettings.sim_max_num_seqs,
    show_default=True,
    type=click.IntRange(min=1),
    help="sequences a simulated replica runs at once",
)
@click.option(
    "--flex-ceiling",
    default=ServeSettings.flex_ceiling_ppm / 1_000_000,
    show_default=True,
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    help="KV occupancy below which a replica takes flex work (below every tier's ceiling)",
)
@click.option(
    "--batch-window", "batch_windows", multiple=True,
    help="a Batch API completion window offered beside 24h, e.g. 30s (tests, demos); repeatable",
)
@click.option(
    "--batch-concurrency",
    default=ServeSettings.batch_concurrency,
    show_default=True,
    type=click.IntRange(min=1),
    help="batch items the batch runner keeps in flight at most",
)
@click.option("--no-demo", is_flag=True, help="do not seed the demo tenants and keys")
@click.option(
    "--trusted-proxies",
    envvar="TOLLGATE_TRUSTED_PROXIES",
    default=None,
    help="comma-separated CIDRs of proxies whose X-Forwarded-For names the client for the "
    "per-address limits (env TOLLGATE_TRUSTED_PROXIES; default: none, the TCP peer counts)",
)
@click.option(
    "--metrics-token",
    envvar="TOLLGATE_METRICS_TOKEN",
    default=None,
    help="/metrics answers only `Authorization: Bearer TOKEN` (env TOLLGATE_METRICS_TOKEN; "
    "Prometheus: `authorization: {credentials: TOKEN}`)",
)
@click.option(
    "--auth-failures-per-minute",
    default=ServeSettings.auth_failures_per_minute,
    show_default=True,
    type=click.IntRange(min=0),
    help="failed authentications per minute from one client address before every "
    "authentication from it is refused for a while (0: no limit)",
)
@click.option(
    "--slow-reader-timeout",
    "slow_reader_s",
    default=ServeSettings.slow_reader_s,
    show_default=True,
    type=click.FloatRange(min=0),
    help="seconds a streaming client may read nothing while its buffer is full before its "
    "generation is cancelled and billed as far as the engine got (0: never)",
)
@click.option(
    "--stream-buffer-chunks",
    default=ServeSettings.stream_buffer_chunks,
    show_default=True,
    type=click.IntRange(min=2),
    help="chunks buffered per stream for a client that reads slower than the engine writes",
)
@click.option(
    "--lease-renew-s",
    default=ServeSettings.lease_renew_s,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="seconds between this edge's lease renewals (one event for all its streams): what a "
    "crash of the edge can leave unbilled",
)
@click.option(
    "--client-send-buffer",
    "client_send_buffer_bytes",
    default=ServeSettings.client_send_buffer_bytes,
    show_default=True,
    type=click.IntRange(min=0),
    help="bytes of kernel send buffer per client connection (0: the kernel's autotuning)",
)
@click.option(
    "--keep-alive-s",
    default=ServeSettings.keep_alive_s,
    show_default=True,
    type=click.IntRange(min=1),
    help="seconds an idle client connection is kept open (keep it above the clients' own idle "
    "expiry, or a client may reuse a connection just as it is closed)",
)
@click.option(
    "--no-fold-worker",
    is_flag=True,
    help="do not start the fold worker (billing, read models, leases) as a child process; "
    "run `tollgate worker` against the same database instead",
)
@click.option(
    "--predictor",
    "predictor_path",
    default=None,
    help="an output-predictor model file, or a directory whose newest model is used (default: "
    "./data/predictor, where `tollgate predictor train` writes)",
)
@click.option(
    "--no-predictor", is_flag=True, help="reserve every request's whole output cap"
)
@log_format_option
@one_line_errors
def serve(
    host: str,
    port: int,
    database_url: str | None,
    simulated_replicas: int,
    replicas: tuple[str, ...],
    tokenizers: tuple[str, ...],
    models: tuple[str, ...],
    sim_speed: float,
    autoscale: bool,
    cold_start_s: float,
    scale_down_after_s: float,
    sim_gpu_blocks: int,
    sim_max_seqs: int,
    flex_ceiling: float,
    batch_windows: tuple[str, ...],
    batch_concurrency: int,
    no_demo: bool,
    trusted_proxies: str | None,
    metrics_token: str | None,
    auth_failures_per_minute: int,
    slow_reader_s: float,
    stream_buffer_chunks: int,
    client_send_buffer_bytes: int,
    keep_alive_s: int,
    lease_renew_s: float,
    no_fold_worker: bool,
    predictor_path: str | None,
    no_predictor: bool,
    log_format: str,
) -> None:
    """Run Tollgate embedded: migrate, seed the demo, start the fleet, serve the API."""
    from api.serve import run
    from domain.batch import window_seconds

    settings = ServeSettings(
        host=host,
        port=port,
        database_url=database_url or default_database_url(),
        simulated_replicas=simulated_replicas,
        replicas=replicas,
        tokenizers=tokenizers,
        models=models or DEFAULT_MODELS,
        sim_speed=sim_speed,
        seed_demo=not no_demo,
        metrics_token=metrics_token or None,
        trusted_proxies=tuple(p.strip() for p in (trusted_proxies or "").split(",") if p.strip()),
        auth_failures_per_minute=auth_failures_per_minute,
        slow_reader_s=slow_reader_s,
        stream_buffer_chunks=stream_buffer_chunks,
        client_send_buffer_bytes=client_send_buffer_bytes,
        keep_alive_s=keep_alive_s,
        lease_renew_s=lease_renew_s,
        fold_worker=not no_fold_worker,
        autoscale=autoscale,
        cold_start_s=cold_start_s,
        scale_down_after_s=scale_down_after_s,
        sim_gpu_blocks=sim_gpu_blocks,
        sim_max_num_seqs=sim_max_seqs,
        flex_ceiling_ppm=round(flex_ceiling * 1_000_000),
        predictor_path=predictor_path,
        predictor_enabled=not no_predictor,
        batch_windows=batch_windows,
        batch_concurrency=batch_concurrency,
        log_format=log_format,
    )
    for window in batch_windows:
        if window_seconds(window, (window,)) is None:
            raise click.BadParameter(
                f"{window!r}: a window is 1-99999 followed by s, m or h",
                param_hint="--batch-window",
            )
    actuator_factory = None
    if autoscale:
        from cli.dev.actuator import SimulatedActuator

        actuator_factory = SimulatedActuator
    run(settings, actuator_factory)


@click.command(
    "api",
    params=[p for p in serve.params if p.name != "no_fold_worker"],
    context_settings={"ignore_unknown_options": False},
)
@click.pass_context
def api_command(ctx: click.Context, **options: Any) -> None:
    """Run an edge of the distributed mode: the API over PostgreSQL, no embedded fold worker.

    Same options as `tollgate serve` (`--replica MODEL=URL`, `--simulated-replicas N`, ...).
    Run several against one database, with `tollgate relay` and `tollgate worker` (Kafka) doing
    the folds."""
    url = options.get("database_url") or default_database_url()
    if not url.startswith("postgresql"):
        raise click.UsageError("tollgate api is an edge of the distributed mode: give it the "
                               "PostgreSQL store (--database-url or TOLLGATE_DATABASE_URL)")
    ctx.invoke(serve, no_fold_worker=True, **options)


COMMANDS = (serve, api_command)

"""Where Tollgate keeps its data and how it is reached: flags override the environment, which
overrides the defaults. Choosing PostgreSQL or real replicas is configuration, never code."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from domain.capacity import FLEX_CEILING_PPM
from domain.leases import LEASE_RENEW_S, LEASE_TTL_S
from engine_adapter.exchange import MAX_BUFFERED_CHUNKS

DEFAULT_MODELS = ("llama-3.1-8b-2026-05", "llama-3.1-70b-2026-05")


def data_dir() -> Path:
    return Path(os.environ.get("TOLLGATE_DATA_DIR", "data")).resolve()


def default_predictor_dir() -> Path:
    """Where `tollgate predictor train` writes model files and `tollgate serve` loads the
    newest from."""
    return data_dir() / "predictor"


def default_database_url() -> str:
    configured = os.environ.get("TOLLGATE_DATABASE_URL")
    if configured:
        return configured
    directory = data_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{directory / 'tollgate.db'}"


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    database_url: str = field(default_factory=default_database_url)
    simulated_replicas: int = 2  # per model, when no --replica is given
    replicas: tuple[str, ...] = ()  # URLs of real `vllm serve` replicas ("URL" or "MODEL=URL")
    tokenizers: tuple[str, ...] = ()  # "MODEL=DIR": a model's tokenizer, for the estimator
    models: tuple[str, ...] = DEFAULT_MODELS
    sim_speed: float = 1.0  # >1 makes the simulated engines faster
    sim_seed: int = 7
    sim_gpu_blocks: int = 8_192  # KV blocks of 16 tokens per simulated replica
    sim_max_num_seqs: int = 256  # vLLM's usual default: KV, not sequence slots, binds
    # The simulated replicas schedule as `vllm serve --scheduling-policy priority` (the tier's
    # and the flex class's `priority` field is honoured), as real ones should be started.
    sim_scheduling_policy: str = "priority"
    # Flex work is admitted only into a replica below this KV occupancy (below every tier's).
    flex_ceiling_ppm: int = FLEX_CEILING_PPM
    # Completion windows offered beside OpenAI's "24h" (e.g. "30s" for tests and demos).
    batch_windows: tuple[str, ...] = ()
    # Batch items the runner keeps in flight at once, at most (it backs off when flex is
    # refused or preempted).
    batch_concurrency: int = 8
    # How the batch runner proves itself to the edge: TOLLGATE_BATCH_TOKEN, else drawn at start
    # and handed to the fold worker in its environment; never stored.
    batch_token: str = field(default_factory=lambda: os.environ.get("TOLLGATE_BATCH_TOKEN", ""))
    max_body_bytes: int = 4 * 1024 * 1024
    # Failed authentications one client address may make per minute before every authentication
    # from it is refused for a while (0: no limit). A person with a wrong key makes a few; a
    # client that polls with a key not yet known to the edge (≤ 0.2 s) makes a handful.
    auth_failures_per_minute: int = 100
    lease_renew_s: float = LEASE_RENEW_S
    # A streaming client that reads nothing for this long with its buffer full is cancelled at
    # the engine and billed what the engine produced (0: never); its buffer, in chunks. A client
    # that pauses reads again well within 10 s; one gone silent no longer holds KV for minutes.
    slow_reader_s: float = 10.0
    stream_buffer_chunks: int = MAX_BUFFERED_CHUNKS
    # The kernel's send buffer of each client connection (0: the kernel's autotuning, up to
    # net.ipv4.tcp_wmem's maximum): what a slow reader can leave unread before the edge's own
    # buffer fills. Fixed by default: autotuned, it grew to megabytes on loopback, so 50 clients
    # that read nothing never filled the edge's buffer and each got all 2,000 tokens generated
    # (issue 27, item 4). 64 KiB (the kernel doubles it) is a few seconds of any token stream
    # and far more than a round trip of one, so a reading client never waits on it.
    client_send_buffer_bytes: int = 64 * 1024
    # Seconds an idle client connection is kept open. Longer than the idle expiry of the usual
    # clients (httpx and so the openai SDK: 5 s, aiohttp: 15 s, a cloud load balancer: 60 s),
    # so a client never reuses a connection at the instant the edge closes it (with uvicorn's
    # 5 s, an httpx client reusing a connection idle for just under 5 s got ReadError on about
    # one request in twenty; measured).
    keep_alive_s: int = 75
    lease_ttl_s: float = LEASE_TTL_S
    # /readyz calls the pipeline stale when a part of it (the relay, a consumer group, a
    # worker) is behind and has not moved for this long, or a worker's heartbeat is this old.
    pipeline_stale_s: float = field(
        default_factory=lambda: float(os.environ.get("TOLLGATE_PIPELINE_STALE_S", "10"))
    )
    # SQLite: how often the WAL is checkpointed and truncated, so that deleted content (a batch
    # file, a purged replay) leaves the files within this many seconds.
    sqlite_checkpoint_s: float = field(
        default_factory=lambda: float(os.environ.get("TOLLGATE_SQLITE_CHECKPOINT_S", "60"))
    )
    # Proxies (CIDRs) whose X-Forwarded-For names the client a limit is kept for; nobody else's
    # header is believed.
    trusted_proxies: tuple[str, ...] = field(
        default_factory=lambda: tuple(
            p for p in os.environ.get("TOLLGATE_TRUSTED_PROXIES", "").split(",") if p.strip()
        )
    )
    # With a token, /metrics answers only `Authorization: Bearer <token>` (it names tenants).
    metrics_token: str | None = field(
        default_factory=lambda: os.environ.get("TOLLGATE_METRICS_TOKEN") or None
    )
    # /readyz alarms when a terminal event has gone this long without its ledger row.
    unbilled_alarm_s: float = field(
        default_factory=lambda: float(os.environ.get("TOLLGATE_UNBILLED_ALARM_S", "30"))
    )
    # How the process logs (api/logs.py): "plain" text lines or "json", one object a line;
    # the fold worker child logs the same way.
    log_format: str = field(default_factory=lambda: os.environ.get("TOLLGATE_LOG_FORMAT", "plain"))
    scrape_interval_s: float = 0.25
    tpot_target_us: int = 40_000
    seed_demo: bool = True
    metrics_max_tenants: int = 50  # tenants named in metric labels; the rest are "other"
    autoscale: bool = False  # add and remove simulated replicas by the autoscaling signal
    cold_start_s: float = 60.0  # how long a new replica takes before it serves (the lead)
    scale_down_after_s: float = 120.0
    fold_worker: bool = True  # run the folds in a child process (else: `tollgate worker`)
    # Output-length predictions: a model file, or a directory whose newest model file is used
    # (and a newer one picked up within `predictor_reload_s`). None: default_predictor_dir().
    predictor_path: str | None = None
    predictor_enabled: bool = True
    predictor_reload_s: float = 30.0

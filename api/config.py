"""Where Tollgate keeps its data and how it is reached: flags override the environment, which
overrides the defaults. Choosing PostgreSQL or real replicas is configuration, never code."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MODELS = ("llama-3.1-8b-2026-05", "llama-3.1-70b-2026-05")


def data_dir() -> Path:
    return Path(os.environ.get("TOLLGATE_DATA_DIR", "data")).resolve()


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
    models: tuple[str, ...] = DEFAULT_MODELS
    sim_speed: float = 1.0  # >1 makes the simulated engines faster
    sim_seed: int = 7
    max_body_bytes: int = 4 * 1024 * 1024
    lease_renew_s: float = 5.0
    lease_ttl_s: float = 15.0
    scrape_interval_s: float = 0.25
    tpot_target_us: int = 40_000
    seed_demo: bool = True
    fold_worker: bool = True  # run the folds in a child process (else: `tollgate worker`)

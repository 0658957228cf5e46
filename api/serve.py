"""`tollgate serve`: the embedded main job. Migrates, seeds the demo tenants on first start,
starts a simulated fleet (or uses real replicas), prints the keys and a curl line, serves."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import uvicorn
import uvloop

from api.app import create_app
from api.config import DEFAULT_MODELS, ServeSettings, data_dir
from api.control_service import ControlService
from api.runtime import Runtime

log = logging.getLogger("tollgate.serve")

DEMO_TENANTS = (
    ("demo-free", "free"),
    ("demo-standard", "standard"),
    ("demo-enterprise", "enterprise"),
)
# Demo list prices per million tokens, in micro-units (prompt, completion, cached).
DEMO_PRICES = {
    "llama-3.1-8b": (150_000, 600_000, 75_000),
    "llama-3.1-70b": (900_000, 2_700_000, 450_000),
}


def demo_keys_file() -> Path:
    return data_dir() / "demo-keys.json"


def seed_demo(settings: ServeSettings) -> dict[str, Any]:
    """Create the demo tenants, keys and prices once. The demo secrets are also written to
    data/demo-keys.json (mode 600) so a restart and `tollgate loadgen --demo` can show them:
    the store itself keeps only their hashes."""
    path = demo_keys_file()
    if path.exists():
        return dict(json.loads(path.read_text()))
    keys: dict[str, Any] = {}
    with ControlService.open(settings.database_url) as service:
        existing = {t.tenant_id for t in service.list_tenants()}
        for name, plan in DEMO_TENANTS:
            if name not in existing:
                service.create_tenant(name, plan)
            keys[name] = service.issue_key(name, "customer")[1]
        if "tollgate-ops" not in existing:
            service.create_tenant("tollgate-ops", "enterprise")
        keys["finance"] = service.issue_key("tollgate-ops", "finance")[1]
        keys["support"] = service.issue_key("tollgate-ops", "support")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(keys, indent=2))
    os.chmod(path, 0o600)
    return keys


def ensure_demo_prices(settings: ServeSettings, models: list[str]) -> None:
    """Give each served model without any price the demo list price, so the demo can bill it.
    (Outside the demo an unpriced model is simply not offered: see Edge.models.)"""
    from datetime import UTC, datetime

    from domain.cost import base_model

    with ControlService.open(settings.database_url) as service:
        for model in models:
            if not service.view.has_price(model, datetime.now(UTC) + timedelta(days=3650)):
                prices = DEMO_PRICES.get(base_model(model), (500_000, 1_500_000, 250_000))
                service.set_price(model, *prices)


async def start_simulated_fleet(
    settings: ServeSettings,
) -> tuple[list[Any], list[tuple[str, str, str]]]:
    from engine_adapter.simulated import SimConfig, start_simulated_replica

    handles, replicas = [], []
    for m_index, model in enumerate(settings.models):
        for i in range(settings.simulated_replicas):
            config = SimConfig(
                model=model,
                seed=settings.sim_seed + 100 * m_index + i,
                speed=settings.sim_speed,
                max_model_len=32_768,
                num_gpu_blocks=8_192,
            )
            handle = await start_simulated_replica(config)
            handles.append(handle)
            replicas.append((f"sim-{model}-{i}", model, handle.url))
    return handles, replicas


def parse_replica_flags(flags: tuple[str, ...]) -> list[tuple[str, str, str]]:
    out = []
    for i, flag in enumerate(flags):
        model, sep, url = flag.partition("=")
        if not sep:
            raise ValueError(
                f"--replica {flag!r}: give MODEL=URL (the model version the replica serves)"
            )
        out.append((f"replica-{i}", model, url.rstrip("/")))
    return out


def run(settings: ServeSettings) -> None:
    # The event loop shares the GIL with the fold and group-commit threads. After each socket
    # send it must win the GIL back, and with the default 5 ms switch interval a busy fold thread
    # made every send cost up to 5 ms (py-spy: 18 % of the loop in transport.write). 0.5 ms keeps
    # the loop responsive; the threads' throughput barely changes.
    sys.setswitchinterval(float(os.environ.get("TOLLGATE_SWITCH_INTERVAL_S", "0.0005")))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if settings.replicas and settings.models == DEFAULT_MODELS:
        settings.models = tuple(
            dict.fromkeys(m for _, m, _ in parse_replica_flags(settings.replicas))
        )
    keys = seed_demo(settings) if settings.seed_demo else {}
    if settings.seed_demo:
        ensure_demo_prices(settings, list(settings.models))
    # uvloop: the same asyncio API with the loop and its transports in C; measured here it cut
    # the CPU of a 16-chunk stream by about a fifth (bench/gateway.py, A/B in one run).
    uvloop.run(_serve(settings, keys))


async def _serve(settings: ServeSettings, keys: dict[str, Any]) -> None:
    handles: list[Any] = []
    if settings.replicas:
        replicas = parse_replica_flags(settings.replicas)
    else:
        handles, replicas = await start_simulated_fleet(settings)
    runtime = Runtime(settings)
    await runtime.start(replicas)
    app = create_app(runtime)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="none",
        http="httptools",
        access_log=False,
        log_level="warning",
        lifespan="off",
        proxy_headers=False,  # no proxy in front by default; the client address is unused
    )
    server = uvicorn.Server(config)
    # Everything built so far lives as long as the process: freeze it out of the collector, so
    # a full collection no longer walks ~130k start-up objects (measured: a 71 ms pause of the
    # event loop under load, the largest single stall we found). Young collections keep
    # CPython's defaults (short pauses); full ones, which walk everything created since, run a
    # hundred times less often. Open loop at 200 req/s, added p99 (two runs each): streams
    # 5.5-5.8 ms with these, 7.3-7.8 with the defaults, 10.4-10.6 with (2000, 20, 100).
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 10, 1000)
    base = f"http://{settings.host}:{settings.port}"
    _print_banner(base, settings, keys, replicas)
    try:
        await server.serve()
    finally:
        await runtime.stop()
        for handle in handles:
            with contextlib.suppress(Exception):
                await handle.stop()


def _print_banner(
    base: str, settings: ServeSettings, keys: dict[str, Any], replicas: list[tuple[str, str, str]]
) -> None:
    lines = [
        f"Tollgate serving on {base}  (database: {settings.database_url})",
        f"fleet: {len(replicas)} replicas of {', '.join(sorted({r[1] for r in replicas}))}",
    ]
    for name, secret in keys.items():
        lines.append(f"  {name:16s} {secret}")
    if "demo-standard" in keys:
        lines.append("try:")
        lines.append(
            f"  curl -s {base}/v1/chat/completions -H 'Authorization: Bearer "
            f"{keys['demo-standard']}' -H 'Content-Type: application/json' -d '{{\"model\": "
            f'"{settings.models[0]}", "messages": [{{"role": "user", "content": '
            f'"Hello!"}}]}}\' -i'
        )
    print("\n".join(lines), flush=True)

"""`tollgate serve`: the embedded main job. Migrates, seeds the demo tenants on first start,
starts a simulated fleet (or uses real replicas), prints the keys and a curl line, serves."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import uvicorn
import uvloop
from uvicorn.config import LOGGING_CONFIG

from tollgate_llm.api.config import DEFAULT_MODELS, Settings
from tollgate_llm.api.http.app import create_app
from tollgate_llm.api.logs import setup_logging
from tollgate_llm.api.replica_regions import simulated_region, split_region
from tollgate_llm.api.runtime import Runtime
from tollgate_llm.api.services.control_service import SYSTEM, ControlService
from tollgate_llm.api.services.scaling import Actuator
from tollgate_llm.engine_adapter.fleet import Fleet

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


def demo_keys_file(settings: Settings) -> Path:
    return settings.data_path() / "demo-keys.json"


def seed_demo(settings: Settings) -> dict[str, Any]:
    """Create the demo tenants, keys and prices once. The demo secrets are also written to
    data/demo-keys.json (mode 600) so a restart and `tollgate loadgen --demo` can show them:
    the store itself keeps only their hashes."""
    path = demo_keys_file(settings)
    if path.exists():
        return dict(json.loads(path.read_text()))
    keys: dict[str, Any] = {}
    with ControlService.open(settings.database_url, SYSTEM) as service:
        existing = {t.tenant_id for t in service.list_tenants()}
        for name, plan in DEMO_TENANTS:
            if name not in existing:
                service.create_tenant(name, plan)
            keys[name] = service.issue_key(name, "customer")[1]
        if "tollgate-ops" not in existing:
            service.create_tenant("tollgate-ops", "enterprise")
        keys["finance"] = service.issue_key("tollgate-ops", "finance")[1]
        keys["support"] = service.issue_key("tollgate-ops", "support")[1]
        keys["admin"] = service.issue_key("tollgate-ops", "admin")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(keys, indent=2))
    os.chmod(path, 0o600)
    return keys


def ensure_demo_prices(settings: Settings, models: list[str]) -> None:
    """Give each served model without any price the demo list price, so the demo can bill it.
    (Outside the demo an unpriced model is simply not offered: see Edge.models.)"""
    from datetime import UTC, datetime

    from tollgate_llm.domain.cost import base_model

    with ControlService.open(settings.database_url, SYSTEM) as service:
        for model in models:
            if not service.view.has_price(model, datetime.now(UTC) + timedelta(days=3650)):
                prices = DEMO_PRICES.get(base_model(model), (500_000, 1_500_000, 250_000))
                service.set_price(model, *prices, currency=settings.currency)


async def start_simulated_replica_of(settings: Settings, model: str, index: int) -> Any:
    from tollgate_llm.engine_adapter.simulator.engine import SimConfig
    from tollgate_llm.engine_adapter.simulator.server import start_simulated_replica

    m_index = list(settings.models).index(model) if model in settings.models else 0
    config = SimConfig(
        model=model,
        seed=settings.sim_seed + 100 * m_index + index,
        speed=settings.sim_speed,
        # a request never longer than the whole cache (vLLM refuses to start otherwise)
        max_model_len=min(32_768, settings.sim_gpu_blocks * 16),
        num_gpu_blocks=settings.sim_gpu_blocks,
        max_num_seqs=settings.sim_max_num_seqs,
        scheduling_policy=settings.sim_scheduling_policy,
    )
    return await start_simulated_replica(config)


async def start_simulated_fleet(
    settings: Settings,
) -> tuple[list[Any], list[tuple[str, str, str]]]:
    handles, replicas = [], []
    for model in settings.models:
        for i in range(settings.simulated_replicas):
            handle = await start_simulated_replica_of(settings, model, i)
            handles.append(handle)
            replicas.append((f"sim-{model}-{i}", model, handle.url))
    return handles, replicas


def simulated_regions(
    settings: Settings, replicas: list[tuple[str, str, str]]
) -> dict[str, str]:
    """Each simulated replica's region: a model's replicas take `simulated_regions` in turn."""
    index: dict[str, int] = {}
    out = {}
    for replica_id, model, _ in replicas:
        i = index[model] = index.get(model, -1) + 1
        out[replica_id] = simulated_region(settings.simulated_regions, i, settings.region)
    return out


def parse_model_flags(flags: tuple[str, ...], option: str) -> list[tuple[str, str]]:
    """MODEL=VALUE flags, in order."""
    out = []
    for flag in flags:
        model, sep, value = flag.partition("=")
        if not sep or not model or not value:
            raise ValueError(f"{option} {flag!r}: give MODEL=VALUE")
        out.append((model, value))
    return out


def parse_replica_flags(flags: tuple[str, ...]) -> list[tuple[str, str, str]]:
    return [(replica_id, model, url) for replica_id, model, url, _ in parse_replicas(flags)]


def parse_replicas(
    flags: tuple[str, ...], default_region: str = ""
) -> list[tuple[str, str, str, str]]:
    """(replica id, model, url, region) of each `--replica MODEL=URL[@REGION]`."""
    out = []
    for i, flag in enumerate(flags):
        model, sep, url = flag.partition("=")
        if not sep:
            raise ValueError(
                f"--replica {flag!r}: give MODEL=URL[@REGION] (the model version the replica "
                "serves, and where it runs)"
            )
        url, region = split_region(url, default_region)
        out.append((f"replica-{i}", model, url.rstrip("/"), region))
    return out


class OwningActuator(Actuator, Protocol):
    """What `--autoscale` acts through: an actuator that owns the simulated replicas it runs
    (`handles`, by replica id), which serving stops when it ends."""

    handles: dict[str, Any]


# Builds it from the settings, the fleet (once the runtime has started it) and the simulated
# replicas by id. The command line injects it (cli/dev/actuator.py), so serving imports no
# development tool.
ActuatorFactory = Callable[[Settings, Callable[[], Fleet], dict[str, Any]], OwningActuator]


def run(settings: Settings, actuator_factory: ActuatorFactory | None = None) -> None:
    # The event loop shares the GIL with the fold and group-commit threads. After each socket
    # send it must win the GIL back, and with the default 5 ms switch interval a busy fold thread
    # made every send cost up to 5 ms (py-spy: 18 % of the loop in transport.write). 0.5 ms keeps
    # the loop responsive; the threads' throughput barely changes.
    sys.setswitchinterval(settings.switch_interval_s)
    setup_logging(settings.log_format)
    if settings.replicas and settings.models == DEFAULT_MODELS:
        settings.models = tuple(
            dict.fromkeys(m for _, m, _ in parse_replica_flags(settings.replicas))
        )
    keys = seed_demo(settings) if settings.seed_demo else {}
    if settings.seed_demo:
        ensure_demo_prices(settings, list(settings.models))
    # uvloop: the same asyncio API with the loop and its transports in C; measured here it cut
    # the CPU of a 16-chunk stream by about a fifth (bench/gateway.py, A/B in one run).
    uvloop.run(_serve(settings, keys, actuator_factory))


async def _serve(
    settings: Settings, keys: dict[str, Any], actuator_factory: ActuatorFactory | None
) -> None:
    handles: list[Any] = []
    if settings.replicas:
        given = parse_replicas(settings.replicas, settings.region)
        replicas = [(replica_id, model, url) for replica_id, model, url, _ in given]
        regions = {replica_id: region for replica_id, _, _, region in given}
    else:
        handles, replicas = await start_simulated_fleet(settings)
        regions = simulated_regions(settings, replicas)
    runtime = Runtime(settings)
    actuator = None
    if settings.autoscale:
        if settings.replicas:
            raise ValueError("--autoscale adds simulated replicas: it needs no --replica")
        if actuator_factory is None:
            raise ValueError("--autoscale needs an actuator to add and remove replicas")
        by_id = {r[0]: h for r, h in zip(replicas, handles, strict=True)}

        def fleet() -> Fleet:
            assert runtime.fleet is not None  # started before the scaling loop ever acts
            return runtime.fleet

        actuator = actuator_factory(settings, fleet, by_id)
        handles = []  # the actuator owns them now (it stops those it removes)
    try:
        await runtime.start(
            replicas, simulated=not settings.replicas,
            tokenizers=dict(parse_model_flags(settings.tokenizers, "--tokenizer")),
            actuator=actuator, regions=regions,
        )  # fmt: skip
    except BaseException:
        # Refused (a model without a profile, a replica serving another model): nothing runs.
        await runtime.stop()
        if actuator is not None:
            handles = list(actuator.handles.values())
        for handle in handles:
            with contextlib.suppress(Exception):
                await handle.stop()
        raise
    app = create_app(runtime)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="none",
        http="httptools",
        access_log=False,
        timeout_keep_alive=settings.keep_alive_s,
        log_level="warning",
        # json: uvicorn's own lines through the process's handler instead of its text one
        log_config=None if settings.log_format == "json" else LOGGING_CONFIG,
        lifespan="off",
        proxy_headers=False,  # no proxy in front by default; the client address is unused
    )
    server = _Server(config)
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
        await server.serve(sockets=_listening(settings))
    finally:
        await runtime.stop()
        if actuator is not None:
            handles = list(actuator.handles.values())
        for handle in handles:
            with contextlib.suppress(Exception):
                await handle.stop()


class _Server(uvicorn.Server):
    """uvicorn, stopped by SIGTERM or SIGINT without dying of it. uvicorn re-raises the signal
    once it has stopped serving, to the handler that was there before (the default: end the
    process at once), so what `_serve` does after serving never ran on a SIGTERM: the appends
    still waiting for their group commit, the refusals counted in the open window, the fold
    worker's last fold. Here the signal stops the serving and `_serve` goes on to its shutdown;
    a second signal during that shutdown ends the process as before."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _listening(settings: Settings) -> list[socket.socket] | None:
    """The listening socket, bound here when client connections get a fixed kernel send buffer
    (Linux gives accepted sockets the listener's; a fixed size also turns off the kernel's
    autotuning, which on loopback grows to megabytes). None: uvicorn binds its own."""
    size = settings.client_send_buffer_bytes
    if size <= 0:
        return None
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    sock.bind((settings.host, settings.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return [sock]


def _print_banner(
    base: str, settings: Settings, keys: dict[str, Any], replicas: list[tuple[str, str, str]]
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

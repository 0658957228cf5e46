"""`tollgate loadgen`: bounded, realistic load against a Tollgate (or any OpenAI-compatible) URL."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import ipaddress
import json
import os
import resource
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import httpx
import orjson
from rich.console import Console

from tollgate_llm.loadgen import EXTRA_HINT
from tollgate_llm.loadgen.profiles import DEMO_TIERS, ProfileError, available_profiles, load_profile

NON_TENANT_KEYS = {"finance", "support", "admin"}


def check_base_url(url: str) -> tuple[str, bool]:
    """(normalised URL, is loopback). Only http(s) with a host; a trailing /v1 is dropped."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise click.BadParameter(f"{url!r}: expected http://HOST:PORT", param_hint="--base-url")
    base = url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    host = parts.hostname
    if host == "localhost":
        return base, True
    try:
        return base, ipaddress.ip_address(host).is_loopback
    except ValueError:
        return base, False


def load_keys(path: Path) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(tenant -> key, tenant -> declared tier, finance key) from a JSON map. Values are a key
    string or {"key": ..., "tier": ...}; "finance" (and "support", "admin") are not tenants."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise click.ClickException(f"keys file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise click.ClickException(f"keys file {path}: {exc}") from None
    if not isinstance(raw, dict):
        raise click.ClickException(f"keys file {path}: expected a JSON object tenant -> key")
    keys, tiers = {}, {}
    for name, value in raw.items():
        if name in NON_TENANT_KEYS:
            continue
        if isinstance(value, dict):
            if not isinstance(value.get("key"), str):
                raise click.ClickException(f"keys file {path}: {name!r} has no \"key\" string")
            keys[name] = value["key"]
            if isinstance(value.get("tier"), str):
                tiers[name] = value["tier"]
        elif isinstance(value, str):
            keys[name] = value
        else:
            raise click.ClickException(f"keys file {path}: {name!r} must be a key string")
    finance = raw.get("finance")
    if isinstance(finance, dict):
        finance = finance.get("key")
    if not keys:
        raise click.ClickException(f"keys file {path}: no tenant keys in it")
    return keys, tiers, finance if isinstance(finance, str) else None


def demo_keys_path() -> Path:
    # Read here and not through Tollgate's settings: the load generator imports nothing of
    # Tollgate (an import contract), and this is only where `tollgate serve` wrote its keys.
    return Path(os.environ.get("TOLLGATE_DATA_DIR", "data")).resolve() / "demo-keys.json"


@click.command("loadgen")
@click.option("--base-url", default="http://127.0.0.1:8080", show_default=True,
              help="Tollgate (or any OpenAI-compatible server). A non-loopback host is used only "
                   "because you named it here, and is printed.")
@click.option("--keys", "keys_file", type=click.Path(path_type=Path),
              help="JSON map tenant -> key (plus optional \"finance\" for reconciliation)")
@click.option("--demo", is_flag=True,
              help="use $TOLLGATE_DATA_DIR/demo-keys.json (default ./data) and the demo tenants")
@click.option("--rate", type=float, help="open loop: arrivals per second (default: the profile's)")
@click.option("--concurrency", type=int, help="closed loop: this many clients, back to back")
@click.option("--burst", type=float,
              help="burst factor: rate multiplier inside bursts (makes arrivals bursty)")
@click.option("--duration", type=float, default=30.0, show_default=True,
              help="stop sending after this many seconds")
@click.option("--max-requests", type=int, default=10_000, show_default=True,
              help="stop after this many HTTP requests (retries included)")
@click.option("--drain", type=float, default=30.0, show_default=True,
              help="then wait at most this long for in-flight requests, and cancel the rest")
@click.option("--profile", "profile_name", default="seeds", show_default=True,
              help=f"a name ({', '.join(available_profiles())}) or a .toml path")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--client", type=click.Choice(["openai", "httpx"]), default="openai",
              show_default=True, help="the official AsyncOpenAI SDK, or raw httpx")
@click.option("--stream-ratio", type=click.FloatRange(0, 1),
              help="share of streamed requests where the profile does not say (default 0.8)")
@click.option("--model", "models", multiple=True,
              help="send every request to this model (repeatable) instead of the profile's mix")
@click.option("--max-in-flight", type=int, default=2_000, show_default=True,
              help="open loop: arrivals beyond this many in flight are counted as dropped")
@click.option("--timeout", type=float, default=120.0, show_default=True,
              help="per-request read timeout, seconds")
@click.option("--reconcile-timeout", type=float, default=20.0, show_default=True,
              help="how long to wait for billing to catch up")
@click.option("--no-reconcile", is_flag=True, help="skip the ledger comparison")
@click.option("--no-live", is_flag=True, help="no live view")
@click.option("--plot", "plot_dir", help="write PNG charts into this directory (matplotlib)")
@click.option("--out", "out_file", type=click.Path(path_type=Path),
              help="write the JSON result here")
def loadgen(base_url: str, keys_file: Path | None, demo: bool, rate: float | None,
            concurrency: int | None, burst: float | None, duration: float, max_requests: int,
            drain: float, profile_name: str, seed: int, client: str,
            stream_ratio: float | None, models: tuple[str, ...], max_in_flight: int,
            timeout: float, reconcile_timeout: float, no_reconcile: bool, no_live: bool,
            plot_dir: str | None, out_file: Path | None) -> None:
    """Send realistic, bounded traffic (a profile) and report what clients saw, per tenant and
    tier, reconciled against the finance ledger.

    \b
    tollgate loadgen --demo --profile seeds --rate 5 --duration 60
    tollgate loadgen --demo --profile mix --concurrency 32 --plot plots/ --out result.json
    tollgate loadgen --keys keys.json --base-url http://10.0.0.5:8080 --profile chat --rate 20
    """
    console = Console(stderr=True)
    if (keys_file is None) == (not demo):
        raise click.UsageError("give exactly one of --keys FILE or --demo")
    if rate is not None and concurrency is not None:
        raise click.UsageError("--rate (open loop) and --concurrency (closed loop) exclude each "
                               "other")
    for name, value in (("--rate", rate), ("--concurrency", concurrency),
                        ("--duration", duration), ("--max-requests", max_requests),
                        ("--max-in-flight", max_in_flight), ("--timeout", timeout)):
        if value is not None and value <= 0:
            raise click.BadParameter("must be positive", param_hint=name)
    if burst is not None and burst < 1:
        raise click.BadParameter("must be at least 1", param_hint="--burst")
    if drain < 0 or reconcile_timeout < 0:
        raise click.BadParameter("must not be negative", param_hint="--drain/--reconcile-timeout")
    if client == "openai":
        try:
            importlib.import_module("openai")
        except ImportError:
            raise click.ClickException(f"--client openai (the default) needs the openai SDK, "
                                       f"which is not installed: {EXTRA_HINT}, or use "
                                       f"--client httpx") from None
    if plot_dir is not None:
        # Refused before the run, not after it: the charts are drawn only once the load is over.
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            raise click.ClickException(f"--plot needs matplotlib, which is not installed: "
                                       f"{EXTRA_HINT}") from None
    base, loopback = check_base_url(base_url)
    if not loopback:
        console.print(f"[yellow]target {base} is not a loopback address; sending to it because "
                      f"it was named explicitly in --base-url[/yellow]")
    try:
        profile = load_profile(profile_name)
    except ProfileError as exc:
        raise click.ClickException(f"profile: {exc}") from None
    if demo:
        path = demo_keys_path()
        if not path.exists():
            raise click.ClickException(f"{path} does not exist: start `tollgate serve` first (or "
                                       "set TOLLGATE_DATA_DIR to its data directory)")
        keys, tiers, finance = load_keys(path)
        keys = {t: k for t, k in keys.items() if t in DEMO_TIERS}
        tiers = {t: DEMO_TIERS[t] for t in keys}
        if not keys:
            raise click.ClickException(f"{path}: no demo tenant keys in it")
    else:
        assert keys_file is not None
        keys, tiers, finance = load_keys(keys_file)

    from tollgate_llm.loadgen.runner import RunConfig

    cfg = RunConfig(
        base_url=base, keys=keys, tiers=tiers, profile=profile, rate=rate,
        concurrency=concurrency, duration_s=duration, max_requests=max_requests, seed=seed,
        client=client, stream_ratio=stream_ratio if stream_ratio is not None else
        (profile.stream_ratio if profile.stream_ratio is not None else 0.8),
        burst=burst, drain_s=drain, max_in_flight=max_in_flight, timeout_s=timeout,
        models=models,
    )
    try:
        code = asyncio.run(_main(cfg, console, finance if not no_reconcile else None,
                                 reconcile_timeout, no_reconcile, not no_live, plot_dir,
                                 out_file))
    except KeyboardInterrupt:  # only before the run installed its own Ctrl-C handling
        console.print("interrupted before the run started; nothing was sent")
        code = 130
    sys.exit(code)


async def _billing_lag(base: str) -> float | None:
    from tollgate_llm.loadgen.runner import parse_metrics

    try:
        async with httpx.AsyncClient(base_url=base, timeout=2.0) as http:
            r = await http.get("/metrics")
        return parse_metrics(r.text)[1] if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


async def _main(cfg: Any, console: Console, finance: str | None, reconcile_timeout: float,
                no_reconcile: bool, live: bool, plot_dir: str | None,
                out_file: Path | None) -> int:
    from tollgate_llm.loadgen import reconcile as rc
    from tollgate_llm.loadgen.live import live_view
    from tollgate_llm.loadgen.runner import Runner
    from tollgate_llm.loadgen.summary import print_reconciliation, print_summary, result_json

    p = cfg.profile
    tenants = sorted(cfg.keys)
    runner = Runner(cfg)
    runner.install_signal_handlers()  # before anything slow, so Ctrl-C is always clean
    started_at = datetime.now(UTC)
    frm, to = rc.window(started_at, cfg.duration_s + cfg.drain_s + reconcile_timeout + 60)
    baseline: dict[str, Any] | None = None
    rec_unavailable = "--no-reconcile" if no_reconcile else (
        None if finance else "no finance key (add \"finance\" to the keys file)")
    if finance and not no_reconcile:
        try:
            baseline = await rc.take_baseline(cfg.base_url, finance, tenants, frm, to)
        except rc.Unavailable as exc:
            rec_unavailable = str(exc)

    bursty = p.arrival == "bursty" or (cfg.burst or 1) > 1
    shape = f"bursty x{cfg.burst or p.burst:g}" if bursty else "Poisson"
    mode = (f"closed loop, concurrency {cfg.concurrency}" if cfg.concurrency else
            f"open loop, {cfg.rate or p.default_rate:g} req/s {shape}")
    console.print(f"profile {p.name}: {p.description}\n  source: {p.source}\n  {mode}; "
                  f"tenants {', '.join(tenants)}; {cfg.client} client; at most "
                  f"{cfg.max_requests} requests / {cfg.duration_s:g} s (+{cfg.drain_s:g} s drain)"
                  f" against {cfg.base_url}")
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    header = f"tollgate loadgen — {p.name} — {mode}"
    view = asyncio.create_task(live_view(runner, header, live))
    try:
        await runner.run()
    finally:
        view.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await view
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    wall = runner.wall_s or 1e-9
    user, system = ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime
    stats = runner.stats
    meta = {
        "profile": p.name, "profile_source": p.source, "profile_path": p.path,
        "mode": cfg.mode, "rate": cfg.rate or (None if cfg.concurrency else p.default_rate),
        "concurrency": cfg.concurrency, "arrival": p.arrival, "burst": cfg.burst or p.burst,
        "client": cfg.client, "seed": cfg.seed, "stream_ratio": cfg.stream_ratio,
        "base_url": cfg.base_url, "tenants": {t: runner.cfg.tiers.get(t) for t in tenants},
        "started_at": rc.iso(started_at), "wall_s": round(wall, 3),
        "duration_s": cfg.duration_s, "max_requests": cfg.max_requests,
        "stop_reason": runner.stop_reason or "done", "offered_rps": stats.sent / wall,
        "generator_cpu": {
            "user_s": round(user, 3), "system_s": round(system, 3),
            "percent_of_one_core": round(100 * (user + system) / wall, 1),
            "us_per_request": round(1e6 * (user + system) / max(1, stats.sent), 1),
            "note": "resource.getrusage(RUSAGE_SELF) of the load generator process only",
        },
    }
    reconciliation: dict[str, Any]
    if baseline is not None and finance:
        console.print("waiting for billing to catch up…" if runner.interrupts < 2 else "")
        try:
            reconciliation = await rc.reconcile(
                cfg.base_url, finance, tenants, frm, to, baseline, stats.attempts,
                reconcile_timeout, lambda: _billing_lag(cfg.base_url),
                lambda: runner.interrupts >= 2,
            )
        except rc.Unavailable as exc:
            reconciliation = {"available": False, "reason": str(exc)}
    else:
        reconciliation = {"available": False, "reason": rec_unavailable}

    out_console = Console() if Console().is_terminal else Console(width=200)
    print_summary(out_console, stats, meta)
    print_reconciliation(out_console, reconciliation)
    result = result_json(stats, meta, reconciliation, runner.kv_samples)
    if out_file:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        out_console.print(f"result written to {out_file}")
    if plot_dir:
        from tollgate_llm.loadgen.plots import write_plots

        for path in write_plots(plot_dir, stats.attempts, runner.kv_samples, p.name):
            out_console.print(f"plot written to {path}")
    if reconciliation.get("available") and not reconciliation.get("zero_difference_for_completed"):
        console.print("[bold red]reconciliation: the ledger and the clients disagree[/bold red]")
        return 3
    return 130 if runner.stop_reason == "interrupted" else 0

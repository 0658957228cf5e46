"""`tollgate predictor train | status | evaluate | generate`: learned output-length reservations
(predictor/README.md). Imported only when one of them runs; only `train` imports torch."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import click
import httpx

from tollgate_llm.api.config import Settings
from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import one_line_errors
from tollgate_llm.cli.options import settings_options
from tollgate_llm.ledger.control import ControlLog
from tollgate_llm.ledger.store import SqlEventStore, create_engine_from_url
from tollgate_llm.predictor import model_file

model_option = click.option(
    "--model", "model_path", default=None,
    help="a model file, or a directory whose newest model is used (default: the data "
    "directory's predictor/)",
)  # fmt: skip


@contextmanager
def _store(settings: Settings) -> Iterator[SqlEventStore]:
    url = settings.store_url()
    control.upgrade(url)
    engine = create_engine_from_url(url)
    try:
        yield SqlEventStore(engine)
    finally:
        engine.dispose()


def _model(model_path: str | None, settings: Settings) -> tuple[Path, model_file.ModelFile]:
    path = Path(model_path) if model_path else settings.predictor_dir()
    found = model_file.latest(path) if path.is_dir() else path
    if found is None or not found.is_file():
        raise click.ClickException(f"no model file at {path}: run `tollgate predictor train`")
    return found, model_file.load(found)


@click.group()
def predictor() -> None:
    """Learned output-length reservations: train, inspect, evaluate, and generate traffic."""


@predictor.command()
@settings_options("database_url")
@click.option("--out", default=None, help="directory for the model file (default ./data/predictor)")
@click.option("--quantile", default=0.95, show_default=True, type=click.FloatRange(0.5, 0.999))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--holdout", default=0.2, show_default=True, type=click.FloatRange(0, 0.9),
              help="the latest share of requests kept out of training, for `evaluate`")
@click.option("--max-seconds", default=120.0, show_default=True, type=click.FloatRange(min=1),
              help="wall-clock bound on fitting")
@click.option("--max-requests", default=500_000, show_default=True, type=click.IntRange(min=100),
              help="the most recent requests read (memory bound)")
@click.option("--min-calibration", default=50, show_default=True, type=click.IntRange(min=5),
              help="calibration requests a tenant needs to be predicted at all")
@click.option("--hidden", default=0, show_default=True, type=click.IntRange(0, 64),
              help="ReLU units of a hidden layer (0: linear in log space)")
@one_line_errors
def train(
    settings: Settings, out: str | None, quantile: float, seed: int, holdout: float,
    max_seconds: float, max_requests: int, min_calibration: int, hidden: int,
) -> None:
    """Train on the completed and cancelled requests of the event log; write a model file."""
    if importlib.util.find_spec("torch") is None:
        raise click.ClickException(
            "training needs torch: pip install 'tollgate-llm[predictor]' (torch, the CPU build)"
        )
    from tollgate_llm.predictor.train import NotEnoughData, TrainConfig, train_and_save
    config = TrainConfig(quantile=quantile, seed=seed, holdout=holdout, max_seconds=max_seconds,
                         max_requests=max_requests, min_calibration=min_calibration,
                         hidden=hidden)  # fmt: skip
    with _store(settings) as store:
        try:
            path, mf = train_and_save(store, config, Path(out) if out else settings.predictor_dir())
        except NotEnoughData as exc:
            raise click.ClickException(str(exc)) from None
    t = mf.training
    click.echo(
        f"model {mf.version}: p{round(quantile * 100, 1):g}, {mf.examples} examples "
        f"({t['fit_examples']} fitted, {t['calibration_examples']} calibrating), "
        f"{t['epochs']} epochs in {t['seconds']} s, pinball {t['final_loss']}"
    )
    click.echo(f"window {_iso(mf.window_from)} .. {_iso(mf.window_to)}; held out from "
               f"{_iso(mf.holdout_from) if mf.holdout_from else '(nothing)'}")  # fmt: skip
    known = sum(1 for v in mf.tenants.values() if v.get("offset") is not None)
    click.echo(f"{known} of {len(mf.tenants)} tenants predicted (the rest reserve their cap)")
    click.echo(str(path))


@predictor.command()
@settings_options("database_url")
@model_option
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def status(settings: Settings, model_path: str | None, as_json: bool) -> None:
    """The model `tollgate serve` loads, its training window, and per tenant its realised
    coverage (read from the log: requests this model predicted, over the last 500 each)."""
    path, mf = _model(model_path, settings)
    from tollgate_llm.predictor.status import realised

    with _store(settings) as store:
        tenants = realised(store, mf)
    report = {
        "model": mf.version, "file": str(path), "quantile": mf.model.quantile,
        "trained_at": _iso(mf.trained_at),
        "window": {"from": _iso(mf.window_from), "to": _iso(mf.window_to)},
        "holdout_from": _iso(mf.holdout_from) if mf.holdout_from else None,
        "examples": mf.examples, "training": mf.training, "tenants": tenants,
    }  # fmt: skip
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"model {mf.version} (p{round(mf.model.quantile * 100, 1):g}) from {path}")
    click.echo(f"trained {report['trained_at']} on {mf.examples} requests admitted "
               f"{report['window']['from']} .. {report['window']['to']}")  # fmt: skip
    click.echo(f"{'tenant':<24} {'offset':>8} {'predicted':>9} {'coverage':>9} {'fallbacks':>9}")
    for tenant, row in tenants.items():
        coverage = "-" if row["coverage"] is None else f"{row['coverage']:.3f}"
        offset = "-" if row["offset"] is None else f"{row['offset']:+.3f}"
        click.echo(f"{tenant:<24} {offset:>8} {row['predicted']:>9} {coverage:>9} "
                   f"{row['fallbacks']:>9}")  # fmt: skip


@predictor.command()
@settings_options("database_url")
@model_option
@click.option("--from", "since", default=None, help="ISO 8601: replay from here (default: the "
              "model's held-out slice)")
@click.option("--time-scale", default=1.0, show_default=True, type=click.FloatRange(min=0.001),
              help="stretch the slice's instants (a generation run compressed time by this)")
@click.option("--tpm", default=None, type=click.IntRange(min=1), help="every tenant's tokens/min")
@click.option("--tpm-per-offered", default=None, type=click.FloatRange(min=0.01),
              help="each tenant's tokens/min as this multiple of its own offered tokens/min")
@click.option("--kv-gib-seconds", default=None, type=click.IntRange(min=1),
              help="every tenant's concurrent KV GiB·s")
@click.option("--json", "as_json", is_flag=True)
@one_line_errors
def evaluate(
    settings: Settings, model_path: str | None, since: str | None, time_scale: float,
    tpm: int | None, tpm_per_offered: float | None, kv_gib_seconds: int | None, as_json: bool,
) -> None:
    """Replay a held-out slice through admission with max_tokens, the model, and an oracle."""
    from tollgate_llm.domain.registry import parse_instant
    from tollgate_llm.predictor.dataset import read_requests
    from tollgate_llm.predictor.evaluate import Replay, held_out
    from tollgate_llm.predictor.evaluate import evaluate as run_evaluation

    _, mf = _model(model_path, settings)
    override = {k: v for k, v in (("tpm", tpm), ("kv_gib_seconds", kv_gib_seconds)) if v}
    with _store(settings) as store:
        requests = read_requests(store)
        control_view = ControlLog(store).view
    before, sliced = held_out(requests, mf, parse_instant(since) if since else None)
    if not sliced:
        raise click.ClickException("the slice is empty: no requests admitted after the model's "
                                   "training window (give --from)")  # fmt: skip
    replay = Replay(sliced, before, control_view, override, time_scale, tpm_per_offered)
    result = run_evaluation(replay, mf)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(f"model {result['model_version']} on {result['slice']['requests']} requests "
               f"admitted {result['slice']['from']} .. {result['slice']['to']}")  # fmt: skip
    click.echo(f"{'policy':<11} {'admitted':>8} {'reserved/actual':>15} {'coverage':>8} "
               f"{'429 tpm':>7} {'false':>5} {'429 kv':>6} {'false':>5} {'over-adm.':>9}")
    for name, p in result["policies"].items():
        coverage = "-" if p["coverage"] is None else f"{p['coverage']:.3f}"
        ratio = "-" if p["reserved_per_actual"] is None else f"{p['reserved_per_actual']:.2f}"
        click.echo(
            f"{name:<11} {p['admitted']:>8} {ratio:>15} {coverage:>8} "
            f"{p['refused'].get('tokens', 0):>7} {p['false_refusals'].get('tokens', 0):>5} "
            f"{p['refused'].get('concurrency', 0):>6} "
            f"{p['false_refusals'].get('concurrency', 0):>5} "
            f"{p['peak_over_admission'] * 100:>8.1f}%"
        )


GENERATION_LIMITS = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_output": 4096,
                     "kv_gib_seconds": 10_000_000}  # fmt: skip


@predictor.command()
@settings_options("database_url")
@click.option("--url", default="http://127.0.0.1:8080", show_default=True,
              help="a running `tollgate serve` on the same database, with simulated replicas")
@click.option("--requests", "n", default=6_000, show_default=True, type=click.IntRange(min=1))
@click.option("--rate", default=40.0, show_default=True, type=click.FloatRange(min=0.01),
              help="arrivals per second (Poisson)")
@click.option("--concurrency", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--prefix", default="gen", show_default=True, help="the tenants' name prefix")
@click.option("--model", default="llama-3.1-8b-2026-05", show_default=True)
@one_line_errors
def generate(
    settings: Settings, url: str, n: int, rate: float, concurrency: int, seed: int,
    prefix: str, model: str,
) -> None:
    """Send chat, summarisation and agent traffic (per-tenant answer lengths; every client
    asks max_tokens=4096) through a running Tollgate, for `train` and `evaluate`."""
    from tollgate_llm.predictor.generate import TENANT_KINDS, drive

    keys: dict[str, list[str]] = {}
    actor = control.operator(settings.actor, required=settings.require_actor)
    with control.ControlService.open(settings.store_url(), actor) as service:
        known = {t.name for t in service.list_tenants()}
        for kind in TENANT_KINDS:
            tenant = f"{prefix}-{kind}"
            if tenant not in known:
                service.create_tenant(tenant, "standard")
            # Room enough that generation records the traffic as offered: `evaluate` replays
            # it under the limits it is asked about.
            service.set_limits(tenant, "*", **GENERATION_LIMITS)
            keys[kind] = [service.issue_key(tenant, "customer")[1] for _ in range(2)]
    _wait_for_keys(url, [k for pair in keys.values() for k in pair])
    click.echo(f"generator: predictor/generate.py, seed {seed}, {n} requests at {rate}/s to {url}")
    report = asyncio.run(
        drive(url, keys, model, requests=n, rate_per_s=rate, concurrency=concurrency, seed=seed,
              progress=lambda i: click.echo(f"  {i} sent", err=True))
    )  # fmt: skip
    statuses = dict(sorted((report.statuses or {}).items()))
    click.echo(f"sent {report.sent} in {report.seconds:.0f} s: statuses {statuses}")
    for kind, outputs in (report.output_tokens or {}).items():
        if outputs:
            outputs.sort()
            p50, p95 = outputs[len(outputs) // 2], outputs[int(len(outputs) * 0.95)]
            click.echo(f"  {prefix}-{kind}: {len(outputs)} answers, output p50 {p50} p95 {p95}")


def _wait_for_keys(url: str, secrets: list[str], timeout_s: float = 30.0) -> None:
    """The server follows the control plane every 0.2 s: wait until it knows every new key."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=5) as client:
        for secret in secrets:
            while True:
                try:
                    status = client.get(
                        "/v1/models", headers={"Authorization": f"Bearer {secret}"}
                    ).status_code
                except httpx.HTTPError as exc:
                    raise click.ClickException(f"no Tollgate at {url}: {exc}") from None
                if status == 200:
                    break
                if time.monotonic() > deadline:
                    raise click.ClickException(f"{url} does not know the new keys ({status})")
                time.sleep(0.2)


def _iso(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


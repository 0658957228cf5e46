"""`tollgate routing`: a tenant's consent to the router (`auto` served by the cheapest allowed
model that meets its quality bar on the tenant's own feedback), and what it saved."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import control_options, database_option, one_line_errors
from tollgate_llm.cli.options import settings_options
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.control_plane.decide import AllowRouting
from tollgate_llm.domain.router_model import MODEL_MIN_EVIDENCE
from tollgate_llm.domain.routing import DEFAULT_EXPLORATION_PPM, ON_CAPACITY


@click.group()
def routing() -> None:
    """The router: consent per tenant or project, and the saving it made."""


@routing.command("allow")
@click.option("--tenant", required=True)
@click.option("--project", default="", help="one project only (default: the whole organization)")
@click.option("--models", required=True, help="comma-separated: the models that may serve `auto`")
@click.option(
    "--quality-bar",
    type=click.FloatRange(0, 1, min_open=True),
    required=True,
    help="the quality a routed model must meet (a lower confidence bound), 0-1",
)
@click.option(
    "--exploration",
    type=click.FloatRange(0, 0.2),
    default=DEFAULT_EXPLORATION_PPM / 1e6,
    show_default=True,
    help="share of a class's requests that may try a cheaper model not yet proven",
)
@click.option(
    "--on-capacity",
    type=click.Choice(ON_CAPACITY),
    default="asked",
    show_default=True,
    help="when the chosen model has no room: serve the reference model, or refuse",
)
@click.option(
    "--route-reference",
    is_flag=True,
    help="route requests that name the most expensive of --models too, as `auto` is",
)
@click.option("--reset-drift", is_flag=True, help="forget the classes latched for drift")
@control_options
@one_line_errors
def routing_allow(
    tenant: str,
    project: str,
    models: str,
    quality_bar: float,
    exploration: float,
    on_capacity: str,
    route_reference: bool,
    reset_drift: bool,
    database_url: str,
    actor: Actor,
) -> None:
    command = AllowRouting(
        tenant,
        tuple(m.strip() for m in models.split(",") if m.strip()),
        round(quality_bar * 1_000_000),
        round(exploration * 1_000_000),
        on_capacity,
        project,
        reset_drift,
        route_reference,
    )
    with control.ControlService.open(database_url, actor) as service:
        changed = service.allow_routing(command)
    where = f"{tenant}/{project}" if project else tenant
    state = "allowed" if changed else "was already allowed, unchanged"
    click.echo(f"{where}: routing over {', '.join(command.models)} at bar {quality_bar:g} {state}")


@routing.command("revoke")
@click.option("--tenant", required=True)
@click.option("--project", default="")
@control_options
@one_line_errors
def routing_revoke(tenant: str, project: str, database_url: str, actor: Actor) -> None:
    with control.ControlService.open(database_url, actor) as service:
        changed = service.revoke_routing(tenant, project)
    where = f"{tenant}/{project}" if project else tenant
    click.echo(f"{where}: routing {'revoked' if changed else 'was not allowed'}")


@routing.command("show")
@click.option("--tenant", required=True)
@database_option
@one_line_errors
def routing_show(tenant: str, database_url: str) -> None:
    with control.ControlService.open(database_url) as service:
        policies = service.view.routing_book.policies(tenant)
    if not policies:
        click.echo(f"{tenant}: no routing consent (`auto` is refused, every model served as asked)")
    for p in policies:
        click.echo(
            f"{tenant}/{p.project_id or '*'}: {', '.join(p.models)} bar "
            f"{p.quality_bar_ppm / 1e6:g} exploration {p.exploration_ppm / 1e6:g} on capacity "
            f"{p.on_capacity}{', the reference routed too' if p.route_reference else ''}, "
            f"since {p.since.isoformat()}"
        )


@routing.command("savings")
@click.option("--tenant", default=None, help="one tenant (default: all)")
@click.option("--month", required=True, help="YYYY-MM (UTC)")
@database_option
@one_line_errors
def routing_savings(tenant: str | None, month: str, database_url: str) -> None:
    """Per tenant: what routed requests were billed, what the reference model would have
    billed for the same tokens, the saving, and the customers' mean score of each side."""
    from tollgate_llm.api.services.errors import ApiError
    from tollgate_llm.api.services.routing_savings import SAVINGS_COLUMNS, routing_savings

    with control.ControlService.open(database_url) as service:
        try:
            rows = routing_savings(service.store, service.view, tenant, month)
        except ApiError:
            raise click.BadParameter("YYYY-MM", param_hint="--month") from None
    click.echo(",".join(SAVINGS_COLUMNS))
    for r in rows:
        click.echo(",".join("" if r[c] is None else str(r[c]) for c in SAVINGS_COLUMNS))


@routing.command("evaluate")
@click.option("--requests", default=30_000, show_default=True, type=click.IntRange(min=100))
@click.option("--rate", default=20.0, show_default=True, type=click.FloatRange(min=0.1),
              help="arrivals per simulated second")  # fmt: skip
@click.option("--seed", default=1, show_default=True, type=int)
@click.option("--drift-at", default=0.7, show_default=True, type=click.FloatRange(0, 1),
              help="from this share of the traffic on, one task kind gets harder for the small "
              "model (1: never)")  # fmt: skip
@click.option("--quality-bar", default=0.8, show_default=True,
              type=click.FloatRange(0, 1, min_open=True))  # fmt: skip
@click.option("--exploration", default=DEFAULT_EXPLORATION_PPM / 1e6, show_default=True,
              type=click.FloatRange(0, 0.2))  # fmt: skip
@click.option("--feedback-share", default=0.3, show_default=True, type=click.FloatRange(0, 1),
              help="share of answers the customers score")  # fmt: skip
@click.option("--on-capacity", type=click.Choice(ON_CAPACITY), default="asked", show_default=True)
@click.option("--inference-calls", default=0, show_default=True, type=click.IntRange(min=0),
              help="also time the routing step at admission, this many calls (3 runs)")  # fmt: skip
@click.option("--no-model", is_flag=True,
              help="skip `router_model` (the router with a model trained with torch)")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="the whole result as JSON")
def routing_evaluate(
    requests: int, rate: float, seed: int, drift_at: float, quality_bar: float,
    exploration: float, feedback_share: float, on_capacity: str, inference_calls: int,
    no_model: bool, as_json: bool,
) -> None:  # fmt: skip
    """Judge the router on generated traffic with a known ground truth per task kind, replayed
    through the real admission in simulated time: `auto` with consent against always the
    reference model and an oracle (api/router_evaluation/); with torch installed, also the
    router reading a model refitted on the feedback logged so far (`router_model`: Wilson's
    bound where the model's coverage guard fails). Needs no database or server."""
    import asyncio
    import json

    from tollgate_llm.api.router_evaluation.replay import Setup, evaluate, inference
    from tollgate_llm.api.router_evaluation.traffic import generate

    setup = Setup(quality_bar, exploration, on_capacity, feedback_share, seed=seed)
    traffic = generate(requests, rate, seed, drift_at if drift_at < 1 else None)
    train = None
    if not no_model and importlib.util.find_spec("torch") is not None:
        from tollgate_llm.predictor.router_train import fit as train
    result = asyncio.run(evaluate(traffic, setup, train))
    world = result.pop("router_world")
    if inference_calls:
        result["inference"] = inference(world, traffic, inference_calls, runs=3)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo("policy,admitted,capacity_refusals,saving_vs_asked,cost_vs_oracle,"
               "bar_attainment,share_routed_away,reasons")  # fmt: skip
    for name, p in result["policies"].items():
        reasons = " ".join(f"{k}={v}" for k, v in p["reasons"].items())
        click.echo(
            f"{name},{p['admitted']},{p['capacity_refusals']},{p['saving_vs_asked']},"
            f"{p['cost_vs_oracle']},{p['bar_attainment']},{p['share_routed_away']},{reasons}"
        )
    for name, p in result["policies"].items():
        t = p.get("routing_step")
        if t:
            click.echo(f"{name}: routing step timed in the replay, {t['decisions']} decisions: "
                       f"p50 {t['p50_us']} us, p99 {t['p99_us']} us, "
                       f"p99.9 {t['p999_us']} us")  # fmt: skip
    click.echo(f"load average {result['load_average']}")
    if inference_calls:
        t = result["inference"]
        click.echo(f"routing step at admission: p50 {t['route_p50_us']} us, p99 "
                   f"{t['route_p99_us']} us (CPU p99 {t['route_cpu_p99_us']} us)")  # fmt: skip


@click.command("train")
@settings_options("database_url")
@click.option("--out", default=None,
              help="directory for the model file (default: the data directory's "
              "predictor/)")  # fmt: skip
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--holdout-every", default=5, show_default=True, type=click.IntRange(min=2),
              help="every N-th feedback event is held out to calibrate the margin")  # fmt: skip
@click.option("--min-evidence", default=MODEL_MIN_EVIDENCE, show_default=True,
              type=click.FloatRange(min=1),
              help="fitted feedback a class needs for the model's estimate to be used")  # fmt: skip
@one_line_errors
def router_train(
    settings: Settings, out: str | None, seed: int, holdout_every: int, min_evidence: float
) -> None:
    """Fit the router's quality model with torch on the log's feedback and write a model file;
    `tollgate serve` reads the newest at start (admission never imports torch)."""
    if importlib.util.find_spec("torch") is None:
        raise click.ClickException(
            "training needs torch: pip install 'tollgate-llm[predictor]' (torch, the CPU build)"
        )
    from tollgate_llm.cli.predictor import _store
    from tollgate_llm.predictor.router_train import (
        NotEnoughFeedback,
        RouterTrainConfig,
        train_and_save,
    )

    config = RouterTrainConfig(seed=seed, holdout_every=holdout_every, min_evidence=min_evidence)
    with _store(settings) as store:
        try:
            path, model, training = train_and_save(
                store, config, Path(out) if out else settings.predictor_dir()
            )
        except NotEnoughFeedback as exc:
            raise click.ClickException(str(exc)) from None
    covered = len(model.table())
    click.echo(f"router model {model.version}: {training['feedback_events']} feedback events, "
               f"{len(model.tenants)} tenants, {covered} (tenant, model, class) covered, "
               f"{training['seconds']} s")  # fmt: skip
    for tenant, t in sorted(model.tenants.items()):
        click.echo(f"{tenant}: bias {t.bias:+.3f}, spread {t.spread:.3f}")
    click.echo(str(path))


# `tollgate router evaluate | train`, as the issue names them.
router = click.Group(
    "router", commands={"evaluate": routing_evaluate, "train": router_train},
    help="The router's model and evaluation (`evaluate` is also `tollgate routing evaluate`).",
)  # fmt: skip

COMMANDS = (routing, router)

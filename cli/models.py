"""The served models: `tollgate models` (KV profiles) and `tollgate slo` (targets per tier)."""

from __future__ import annotations

from datetime import UTC, datetime

import click

from tollgate_llm.api.services import control_service as control
from tollgate_llm.cli.common import (
    control_options,
    database_option,
    instant,
    one_line_errors,
)
from tollgate_llm.domain.audit.events import Actor

# --- model profiles ------------------------------------------------------------------------------


@click.group()
def models() -> None:
    """Model profiles: the KV-cache shape admission reserves against (effective-dated)."""


@models.command("register")
@click.option("--model", required=True, help="model name or pinned version")
@click.option(
    "--hf-config",
    "hf_config",
    default=None,
    type=click.Path(exists=True, dir_okay=True),
    help="the model's config.json (or its directory): layers, KV heads, head dim, dtype",
)
@click.option("--layers", type=int, default=None)
@click.option("--kv-heads", type=int, default=None)
@click.option("--head-dim", type=int, default=None)
@click.option("--dtype-bytes", type=int, default=None, help="bytes per KV element (bf16: 2)")
@click.option("--mla-rank", type=int, default=None, help="MLA: kv_lora_rank (then --rope-dim)")
@click.option("--rope-dim", type=int, default=None, help="MLA: the decoupled RoPE key width")
@click.option(
    "--max-model-len", type=int, default=None,
    help="default: config.json's max_position_embeddings; a replica's own /v1/models wins",
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: now)")
@control_options
@one_line_errors
def models_register(
    model: str,
    hf_config: str | None,
    layers: int | None,
    kv_heads: int | None,
    head_dim: int | None,
    dtype_bytes: int | None,
    mla_rank: int | None,
    rope_dim: int | None,
    max_model_len: int | None,
    effective_at: str | None,
    database_url: str,
    actor: Actor,
) -> None:
    """Record a model's KV profile. Flags given with --hf-config override what it says."""
    shape = control.profile_shape(
        model, hf_config, layers=layers, kv_heads=kv_heads, head_dim=head_dim,
        dtype_bytes=dtype_bytes, kv_lora_rank=mla_rank, rope_dim=rope_dim,
        max_model_len=max_model_len,
    )  # fmt: skip
    at = instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url, actor) as service:
        profile, at = service.register_model(model, shape, at)
    click.echo(
        f"model profile for {model} effective {at.isoformat()}: "
        f"{profile.kv_bytes_per_token} KV bytes per token"
    )


@models.command("show")
@click.option("--model", required=True)
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def models_show(model: str, at_: str | None, database_url: str) -> None:
    """The profile in force (registered, else built-in), and the registered history."""
    import dataclasses

    import orjson

    at = instant(at_) if at_ else None
    with control.ControlService.open(database_url) as service:
        profile = service.view.model_profile(model, at)
        history = service.view.model_profiles(model)
    shown = {
        **dataclasses.asdict(profile),
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "history": [
            {"effective_at": when.isoformat(), **dataclasses.asdict(p)} for when, p in history
        ],
    }
    click.echo(orjson.dumps(shown, option=orjson.OPT_INDENT_2).decode())


@click.group()
def slo() -> None:
    """Service-level objectives per tier (time to first token, time per output token)."""


@slo.command("set")
@click.option("--tier", required=True, type=click.Choice(["free", "standard", "enterprise"]))
@click.option("--ttft-ms", required=True, type=click.IntRange(min=1), help="TTFT target, ms")
@click.option(
    "--tpot-ms", required=True, type=click.FloatRange(min=0.001), help="TPOT target, ms"
)
@click.option("--effective-at", default=None, help="ISO 8601 (default: 5 s from now)")
@control_options
@one_line_errors
def slo_set(
    tier: str, ttft_ms: int, tpot_ms: float, effective_at: str | None, database_url: str,
    actor: Actor,
) -> None:
    at = instant(effective_at) if effective_at else None
    with control.ControlService.open(database_url, actor) as service:
        at = service.set_slo(tier, ttft_ms, round(tpot_ms * 1000), at)
    click.echo(
        f"SLO for {tier}: TTFT <= {ttft_ms} ms, TPOT <= {tpot_ms:g} ms from {at.isoformat()}"
    )


@slo.command("show")
@click.option("--at", "at_", default=None, help="ISO 8601 instant (default: now)")
@database_option
@one_line_errors
def slo_show(at_: str | None, database_url: str) -> None:
    at = instant(at_) if at_ else datetime.now(UTC)
    with control.ControlService.open(database_url) as service:
        for tier in ("free", "standard", "enterprise"):
            objective = service.view.slo(tier, at)
            click.echo(f"{tier}\tttft_ms {objective.ttft_ms}\ttpot_us {objective.tpot_us}")


COMMANDS = (models, slo)

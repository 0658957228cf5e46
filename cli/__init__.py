"""The `tollgate` command: one module per command group, gathered here into `main`."""

from __future__ import annotations

import click

from tollgate_llm.cli import (
    adapters,
    audit,
    billing,
    config,
    data_policy,
    db,
    dev,
    models,
    pipeline,
    routing,
    serve,
    support,
    tenants,
)
from tollgate_llm.cli.common import LazyCommand


@click.group()
def main() -> None:
    """Tollgate: admission, quota, routing and exact billing in front of vLLM replicas."""


for _module in (
    db, tenants, data_policy, adapters, billing, models, support, serve, pipeline, config, dev,
    routing, audit,
):
    for _command in _module.COMMANDS:
        main.add_command(_command)


def _loadgen() -> click.Command:
    from tollgate_llm.loadgen.cli import loadgen

    return loadgen


def _predictor() -> click.Command:
    from tollgate_llm.cli.predictor import predictor

    return predictor


# Imported only when they run or print their own help, so no other command imports what they
# need (the load generator's httpx and rich views, the predictor's training stack).
main.add_command(
    LazyCommand(
        "loadgen",
        _loadgen,
        # The first paragraph of the command's own docstring (a test keeps the two the same).
        help="Send realistic, bounded traffic (a profile) and report what clients saw, per tenant "
        "and tier, reconciled against the finance ledger.",
    )
)
main.add_command(
    LazyCommand(
        "predictor",
        _predictor,
        help="Learned output-length reservations: train, inspect, evaluate, and generate traffic.",
    )
)

__all__ = ["main"]
